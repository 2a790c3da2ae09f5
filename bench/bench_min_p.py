"""The sampler step with min_p on every row against the plain sampler.

    .venv/bin/python -m pytest bench/bench_min_p.py --benchmark-only -q

The shape and the cases are those of ``plugin_cases``; the request fields are the
plugin's ``BENCH_PARAMS``.
"""

from __future__ import annotations

import pytest
from plugin_cases import CASES, processor_alone, sampler_step

from freetoken_plugins.min_p import BENCH_PARAMS, MinP


@pytest.mark.parametrize("case", CASES)
def test_sampler_step(benchmark, case: str) -> None:
    sampler_step(benchmark, "min_p", case)


def test_processor_alone(benchmark) -> None:
    processor_alone(benchmark, MinP, BENCH_PARAMS)
