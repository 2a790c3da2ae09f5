"""The sampler step with penalties (repetition, presence, frequency) on every row against the plain sampler.

    .venv/bin/python -m pytest bench/bench_penalties.py --benchmark-only -q

The shape and the cases are those of ``plugin_cases``; the request fields are the
plugin's ``BENCH_PARAMS``.
"""

from __future__ import annotations

import pytest
from plugin_cases import CASES, processor_alone, sampler_step

from freetoken_plugins.penalties import BENCH_PARAMS, Penalties


@pytest.mark.parametrize("case", CASES)
def test_sampler_step(benchmark, case: str) -> None:
    sampler_step(benchmark, "penalties", case)


def test_processor_alone(benchmark) -> None:
    processor_alone(benchmark, Penalties, BENCH_PARAMS)
