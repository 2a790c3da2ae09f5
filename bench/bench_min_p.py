"""The sampler step with min_p on every row against the plain sampler (pytest-benchmark).

    .venv/bin/python -m pytest bench/bench_min_p.py --benchmark-only -q

Batch 64, vocabulary 151,936, 3,000 history tokens per row, temperature 0.8, top_p 0.95,
``min_p`` from the plugin's ``BENCH_PARAMS``. Three cases in one group: ``plain`` (no
processors), ``idle`` (min_p enabled, no row uses it), ``active`` (every row uses it);
compare their means in the table. ``freetoken bench plugin min_p`` prints the same three
as ratios. The step is ``freetoken_core.bench.SamplerStep`` (logits refresh untimed).
"""

from __future__ import annotations

import pytest

from freetoken_core.bench import BenchShape, PluginBench, build_plugin_bench

SHAPE = BenchShape(batch=64, vocab=151_936, history=3000, device="cpu")
ROUNDS = 5


@pytest.fixture(scope="module")
def min_p_bench() -> PluginBench:
    return build_plugin_bench("min_p", SHAPE, num_steps=ROUNDS + 2)


@pytest.mark.parametrize("case", ["plain", "idle", "active"])
def test_sampler_step(benchmark, min_p_bench: PluginBench, case: str) -> None:
    step = getattr(min_p_bench, case)
    benchmark.group = f"min_p sampler step, batch {SHAPE.batch}, vocab {SHAPE.vocab}"
    benchmark.pedantic(step.run, setup=step.reset, rounds=ROUNDS, warmup_rounds=2)
    assert len(step.last_tokens) == SHAPE.batch
