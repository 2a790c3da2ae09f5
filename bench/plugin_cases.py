"""The cases every per-plugin benchmark runs (pytest-benchmark), shared by bench_<plugin>.py.

Shape: batch 64, vocabulary 151,936, 3,000 history tokens per row, temperature 0.8,
top_p 0.95, on model-like logits (``freetoken_core.bench.model_like_logits``); CUDA when
available (the Triton kernels), else the CPU (the torch path).

- ``sampler_step(benchmark, name, case)``: the engine's sampler step for ``case`` in
  ``CASES``: ``plain`` (no processors), ``idle`` (the plugin enabled, no row uses it: must
  cost nothing) and ``active`` (every row uses the plugin's ``BENCH_PARAMS``). The three
  share a benchmark group, so the table reads as a ratio; ``freetoken bench plugin NAME``
  prints the same three as ratios in one run.
- ``processor_alone(benchmark, cls, params)``: just the processor's ``prepare_step`` +
  ``apply`` + ``update`` on the same rows (and, for a processor that ``reads_history``,
  the engine's append to the token history), the part of ``active`` that the plugin adds
  (``params``: its ``BENCH_PARAMS``, validated as the server validates them).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from freetoken_core.bench import (
    BASE_PARAMS,
    BenchShape,
    PluginBench,
    build_plugin_bench,
    load_bench_model,
)
from freetoken_core.history import TokenHistory
from freetoken_core.plugins import PluginManager
from freetoken_core.processors import LogitsProcessor, ProcessorContext, RequestView
from freetoken_core.sampling_params import SamplingParams

SHAPE = BenchShape(batch=64, vocab=151_936, history=3000,
                   device="cuda" if torch.cuda.is_available() else "cpu")
ROUNDS = 5
CASES = ["plain", "idle", "active"]
# History tokens come from the most common ids, so that tokens repeat as in real text.
COMMON_IDS = 20_000


@functools.cache
def plugin_bench(name: str) -> PluginBench:
    return build_plugin_bench(name, SHAPE, num_steps=ROUNDS + 2)


def sampler_step(benchmark, name: str, case: str) -> None:
    step = getattr(plugin_bench(name), case)
    benchmark.group = f"{name} sampler step, batch {SHAPE.batch}, vocab {SHAPE.vocab}"
    benchmark.pedantic(step.run, setup=step.reset, rounds=ROUNDS, warmup_rounds=2)
    assert len(step.last_tokens) == SHAPE.batch


def processor_alone(benchmark, cls: type[LogitsProcessor], bench_params: dict) -> None:
    device = torch.device(SHAPE.device)
    source = load_bench_model()  # the default model's tokenizer and EOS ids, as the bench's
    model = SHAPE.model(ROUNDS + 2, source.eos_token_ids)
    # Loading the installed plugins names ``cls`` (its entry point's name); validation is
    # the server's: typed fields, then the plugin's ``validate``.
    manager = PluginManager(plugins="all")
    params = SamplingParams(**{**BASE_PARAMS, **bench_params})
    manager.validate(params, model)
    assert cls.name in params.fields, f"{bench_params} do not use {cls.__name__}"
    # The engine's token history, for a processor that reads it; the step appends to it, as
    # the pipeline does, so its cost counts as the plugin's.
    token_history = (TokenHistory(SHAPE.batch, model.max_model_len, device)
                     if cls.reads_history else None)
    proc = cls(ProcessorContext(SHAPE.batch, model, device, source.tokenizer, manager.options,
                                manager.hook, token_history))
    gen = torch.Generator().manual_seed(0)
    history = torch.randint(0, COMMON_IDS, (SHAPE.batch, SHAPE.history), generator=gen)
    for slot, tokens in enumerate(history.tolist()):
        view = RequestView(str(slot), 0, params.fields[cls.name], params, tokens, ())
        if token_history is not None:
            token_history.add(slot, tokens, ())
        future = proc.prepare_request(view)
        if future is not None:
            view = dataclasses.replace(view, prepared=future.result())
        proc.add_request(slot, view)
    slot_list = list(range(SHAPE.batch))
    slots = torch.arange(SHAPE.batch, device=device)
    logits = torch.randn(SHAPE.batch, SHAPE.vocab, device=device)
    before = logits.clone()
    sampled = torch.randint(0, COMMON_IDS, (SHAPE.batch,), device=device)

    def step() -> None:
        proc.prepare_step(slot_list)
        proc.apply(logits, slots)
        if token_history is not None:
            token_history.append(slots, sampled)
        proc.update(slots, sampled)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    benchmark.group = f"{cls.name} processor alone, batch {SHAPE.batch}, vocab {SHAPE.vocab}"
    benchmark.pedantic(step, rounds=50, warmup_rounds=3)
    assert not torch.equal(logits, before)
