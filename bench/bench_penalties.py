"""Sampler step with the penalties processor on every row, against the plain sampler.

    .venv/bin/python -m pytest bench/bench_penalties.py --benchmark-only -q

Shape: batch 64, vocabulary 151,936, each row with a 3,000-token history (1,500 prompt +
1,500 generated tokens, drawn from the 20,000 most common ids so tokens repeat), sampling
at temperature 0.8 and top_p 0.95, penalties ``BENCH_PARAMS`` (repetition 1.2, presence
0.5, frequency 0.5). Three cases in one group, so the table reads as a ratio:

- ``plain``: ``Sampler()`` with no pipeline;
- ``installed_unused``: the penalties processor is installed but no row uses it (must cost
  nothing: the pipeline skips it);
- ``active``: every row uses it (apply before temperature, update after the draw);
- ``processor_only``: just the processor's ``apply`` + ``update`` on the same rows, the
  part of ``active`` that the plugin adds (the sampler's top-p sort dominates the rest).

Each round samples fresh random logits (cloned outside the timing). CUDA when available
(the Triton kernels), else CPU (the torch path). On a CPU shared with other jobs, torch's
thread pool makes every op wait for a time slice; ``OMP_NUM_THREADS=1`` gives steadier
figures there.
"""

from __future__ import annotations

import pytest
import torch

from freetoken_core.engine.sampler import Sampler, SamplingBatch
from freetoken_core.processors import ModelInfo, ProcessorPipeline
from freetoken_core.sampling_params import SamplingParams
from freetoken_plugins.penalties import BENCH_PARAMS, Penalties

BATCH, VOCAB, HISTORY = 64, 151_936, 3_000
COMMON_IDS = 20_000
MAX_MODEL_LEN = 8_192
ROUNDS = 5
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sampling_batch() -> SamplingBatch:
    rows = torch.arange(BATCH, device=DEVICE)
    return SamplingBatch(
        slots=rows,
        temperature=torch.full((BATCH,), 0.8, device=DEVICE),
        top_p=torch.full((BATCH,), 0.95, device=DEVICE),
        top_k=torch.full((BATCH,), -1, dtype=torch.long, device=DEVICE),
        seeds=rows * 7919 + 1,
        counters=torch.full((BATCH,), HISTORY // 2, dtype=torch.long, device=DEVICE),
        all_greedy=False,
        filter_rows=rows,
        max_logprobs=0,
        num_logprobs=[None] * BATCH,
    )


def pipeline(active: bool) -> ProcessorPipeline:
    pipe = ProcessorPipeline([Penalties], BATCH, ModelInfo(VOCAB, frozenset({2}), MAX_MODEL_LEN),
                             DEVICE)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.8, top_p=0.95, **(BENCH_PARAMS if active else {}))
    for slot in range(BATCH):
        history = torch.randint(0, COMMON_IDS, (HISTORY,), generator=gen).tolist()
        pipe.add_request(slot, params, history[:HISTORY // 2], history[HISTORY // 2:])
    assert bool(pipe.active()) == active
    return pipe


@pytest.fixture(scope="module")
def logits() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(BATCH, VOCAB, generator=gen) * 4).to(DEVICE)


def run(benchmark, sampler: Sampler, logits: torch.Tensor) -> None:
    batch = sampling_batch()
    sampler(logits.clone(), batch)  # warm-up (Triton compiles here on CUDA)
    out = benchmark.pedantic(sampler, args=None, setup=lambda: ((logits.clone(), batch), {}),
                             rounds=ROUNDS, iterations=1)
    assert len(out.token_ids) == BATCH


@pytest.mark.benchmark(group="penalties: sampler step, batch 64 x vocab 151,936")
def test_plain(benchmark, logits: torch.Tensor) -> None:
    run(benchmark, Sampler(), logits)


@pytest.mark.benchmark(group="penalties: sampler step, batch 64 x vocab 151,936")
def test_installed_unused(benchmark, logits: torch.Tensor) -> None:
    run(benchmark, Sampler(pipeline(active=False)), logits)


@pytest.mark.benchmark(group="penalties: sampler step, batch 64 x vocab 151,936")
def test_active(benchmark, logits: torch.Tensor) -> None:
    run(benchmark, Sampler(pipeline(active=True)), logits)


@pytest.mark.benchmark(group="penalties: sampler step, batch 64 x vocab 151,936")
def test_processor_only(benchmark, logits: torch.Tensor) -> None:
    proc = pipeline(active=True).processors[0]
    slots = torch.arange(BATCH, device=DEVICE)
    sampled = torch.randint(0, COMMON_IDS, (BATCH,), device=DEVICE)

    def step(x: torch.Tensor) -> None:
        proc.apply(x, slots)
        proc.update(slots, sampled)
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()

    step(logits.clone())  # warm-up
    benchmark.pedantic(step, setup=lambda: ((logits.clone(),), {}), rounds=ROUNDS * 5,
                       iterations=1)
