"""The sampler step with min_tokens on every row against the plain sampler (pytest-benchmark).

    .venv/bin/python -m pytest bench/bench_min_tokens.py --benchmark-only -q

Batch 64, vocabulary 151,936, 3,000 history tokens per row, temperature 0.8, top_p 0.95,
``min_tokens`` from the plugin's ``BENCH_PARAMS``. Three cases in one group: ``plain`` (no
processors), ``idle`` (min_tokens enabled, no row uses it), ``active`` (every row uses it);
compare their means in the table. ``freetoken bench plugin min_tokens`` prints the same three
as ratios. The step is ``freetoken_core.bench.SamplerStep`` (logits refresh untimed).
A second group times the processor alone (``apply`` then ``update`` for the 64 rows), the
part of the active step that the plugin adds.
"""

from __future__ import annotations

import pytest
import torch

from freetoken_core.bench import BASE_PARAMS, BenchShape, PluginBench, build_plugin_bench
from freetoken_core.sampling_params import SamplingParams
from freetoken_plugins.min_tokens import BENCH_PARAMS, MinTokens

SHAPE = BenchShape(batch=64, vocab=151_936, history=3000, device="cpu")
ROUNDS = 5


@pytest.fixture(scope="module")
def min_tokens_bench() -> PluginBench:
    return build_plugin_bench("min_tokens", SHAPE, num_steps=ROUNDS + 2)


@pytest.mark.parametrize("case", ["plain", "idle", "active"])
def test_sampler_step(benchmark, min_tokens_bench: PluginBench, case: str) -> None:
    step = getattr(min_tokens_bench, case)
    benchmark.group = f"min_tokens sampler step, batch {SHAPE.batch}, vocab {SHAPE.vocab}"
    benchmark.pedantic(step.run, setup=step.reset, rounds=ROUNDS, warmup_rounds=2)
    assert len(step.last_tokens) == SHAPE.batch


def test_processor_alone(benchmark) -> None:
    device = torch.device(SHAPE.device)
    model = SHAPE.model(ROUNDS + 2)
    proc = MinTokens(SHAPE.batch, model, device)
    params = SamplingParams(**{**BASE_PARAMS, **BENCH_PARAMS})
    MinTokens.validate(params, model)
    history = torch.randint(0, SHAPE.vocab, (SHAPE.batch, SHAPE.history)).tolist()
    for slot, prompt in enumerate(history):
        proc.add_request(slot, params, prompt, [])
    slots = torch.arange(SHAPE.batch, device=device)
    logits = torch.randn(SHAPE.batch, SHAPE.vocab, device=device)
    before = logits.clone()
    sampled = torch.randint(0, SHAPE.vocab, (SHAPE.batch,), device=device)

    def step() -> None:
        proc.apply(logits, slots)
        proc.update(slots, sampled)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    benchmark.group = f"min_tokens processor alone, batch {SHAPE.batch}, vocab {SHAPE.vocab}"
    benchmark.pedantic(step, rounds=50, warmup_rounds=3)
    assert not torch.equal(logits, before)
