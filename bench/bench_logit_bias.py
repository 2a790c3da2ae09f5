"""The sampler step with logit_bias on every row against the plain sampler.

    .venv/bin/python -m pytest bench/bench_logit_bias.py --benchmark-only -q

The shape and the cases are those of ``plugin_cases``; the request fields are the
plugin's ``BENCH_PARAMS``.
"""

from __future__ import annotations

import pytest
from plugin_cases import CASES, processor_alone, sampler_step

from freetoken_plugins.logit_bias import BENCH_PARAMS, LogitBias


@pytest.mark.parametrize("case", CASES)
def test_sampler_step(benchmark, case: str) -> None:
    sampler_step(benchmark, "logit_bias", case)


def test_processor_alone(benchmark) -> None:
    processor_alone(benchmark, LogitBias, BENCH_PARAMS)
