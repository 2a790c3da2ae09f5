"""What a plugin costs the sampler step: ``freetoken bench plugin NAME``.

One run measures, on the same model-like random float32 logits [batch, vocab] (see
``model_like_logits``; temperature 0.8, top_p 0.95, ``history`` prompt tokens per row),
the median time of one engine sampler step in three setups:

(a) plain: a ``ProcessorPipeline`` with no processors;
(b) idle: the plugin enabled, no row using it (must cost nothing: the pipeline skips it);
(c) active: every row uses the plugin, with the request fields of the ``BENCH_PARAMS`` dict
    of the module that defines the plugin's class, validated as the server validates them
    (``PluginManager.validate``); its processors get each row's history through
    ``add_request`` and fold each step's tokens in ``update`` (the sampler calls it, as in
    the engine).

A step is what the engine does per decode step for these rows: the sampler (the
processors' ``prepare_step`` and ``apply``, temperature, top-p, seeded draw, ``update``),
then appending the drawn tokens to the sequences, the processors' ``accept_tokens`` and
every enabled plugin's ``freetoken_check_stop`` over the rows whose request uses that
plugin. No sequence ever finishes (a stop is ignored). Refreshing the logits happens
between timed steps. The three setups run round-robin so that drift hits them alike. A
processor or stop hook that raises during a step is a ``BenchError`` (the engine would
fail those requests; a bench of it would measure nothing).

``NAME`` may be ``all``: every installed plugin at once, ``BENCH_PARAMS`` merged (plugins
without ``BENCH_PARAMS`` are skipped with a note). ``bench/bench_<plugin>.py`` use the
same ``SamplerStep`` under pytest-benchmark.

The processors get the tokenizer and EOS ids of a real model (``--model``, by default the
embedded default model; its weights are never loaded), as in the engine, so that a
processor that reads ``ProcessorContext.tokenizer`` (a grammar matcher) runs on a real
vocabulary. ``--vocab`` stays the logits' width: a processor that needs it to cover the
tokenizer (at least ``len(tokenizer)``) may refuse a smaller one, which is a
``BenchError``.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from freetoken_core.engine.pipeline import ProcessorPipeline
from freetoken_core.engine.sampler import Sampler, SamplingBatch
from freetoken_core.engine.sequence import Sequence
from freetoken_core.errors import FreeTokenError, InvalidRequest, ModelLoadError
from freetoken_core.plugins import PluginManager, StopHook
from freetoken_core.processors import (
    LogitsProcessor,
    ModelInfo,
    Plugin,
    ProcessorContext,
    StopView,
)
from freetoken_core.sampling_params import SamplingParams

MAX_TOKENS = 4096
BASE_PARAMS: dict[str, Any] = {"temperature": 0.8, "top_p": 0.95, "max_tokens": MAX_TOKENS}
EOS_TOKEN_IDS = frozenset({2})
NUM_WARMUP_STEPS = 3


class BenchError(FreeTokenError):
    """A benchmark that cannot run as asked (bad shape, plugin with nothing to measure)."""


@dataclass(frozen=True)
class BenchShape:
    """The batch a benchmark step works on."""

    batch: int = 64
    vocab: int = 151_936
    history: int = 3000
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("batch", "vocab", "history"):
            if getattr(self, name) < 1:
                raise BenchError(f"--{name} must be >= 1")
        if self.vocab <= max(EOS_TOKEN_IDS):
            raise BenchError(f"--vocab must be > {max(EOS_TOKEN_IDS)}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise BenchError(f"--device {self.device}: CUDA is not available")

    def model(self, num_steps: int, eos_token_ids: frozenset[int] = EOS_TOKEN_IDS
              ) -> ModelInfo:
        if self.vocab <= max(eos_token_ids):
            raise BenchError(f"--vocab must be > the model's EOS ids {sorted(eos_token_ids)}")
        return ModelInfo(self.vocab, eos_token_ids,
                         self.history + max(MAX_TOKENS, num_steps + 16))


@dataclass(frozen=True, eq=False)
class BenchModel:
    """What the bench takes from a real model: its tokenizer and EOS ids (for
    ``ProcessorContext`` and ``ModelInfo``) and its logits' width; never its weights."""

    name: str
    tokenizer: Any
    vocab_size: int
    eos_token_ids: frozenset[int]


@functools.cache
def load_bench_model(model: str | None = None) -> BenchModel:
    """The tokenizer, logits width and EOS ids of ``model`` (a Hugging Face directory or a
    ``.gguf`` file; ``None``: the embedded default model), found as the engine finds them.
    Loaded once per process. Raises ``BenchError`` when the model cannot be loaded."""
    from freetoken_core.engine.llm_engine import eos_token_ids
    from freetoken_core.models.config import ModelConfig
    from freetoken_core.models.resolve import DEFAULT_MODEL_NAME, resolve_model
    from freetoken_core.tokenizer import load_tokenizer

    try:
        model_dir = resolve_model(model, progress=False)
        config = ModelConfig.from_dir(model_dir)
        tokenizer = load_tokenizer(model_dir)
    except ModelLoadError as exc:
        raise BenchError(f"--model: {exc}") from exc
    return BenchModel(model or DEFAULT_MODEL_NAME, tokenizer, config.vocab_size,
                      eos_token_ids(model_dir, config, tokenizer))


class SamplerStep:
    """One engine sampler step over a fixed batch, to be run again and again.

    ``params`` are validated (``params.fields`` set), one per row; row ``i`` has slot ``i``.
    ``reset()`` (untimed) refreshes the logits from ``base_logits``; ``run()`` (timed) is
    the step, which appends the drawn tokens to the sequences.
    ``stop_checks`` holds each stop hook that some row uses, with those rows.
    """

    def __init__(self, shape: BenchShape, base_logits: torch.Tensor,
                 processors: list[type[LogitsProcessor]], params: list[SamplingParams],
                 ctx: ProcessorContext, stop_hooks: Iterable[StopHook] = (),
                 seed: int = 0) -> None:
        self.device = ctx.device
        self.base_logits = base_logits
        self.logits = base_logits.clone()
        gen = torch.Generator().manual_seed(seed)
        history = torch.randint(0, shape.vocab, (shape.batch, shape.history), generator=gen)
        self.pipeline = ProcessorPipeline(processors, ctx)
        self.seqs = [Sequence(seq_id=slot, request_id=str(slot), token_ids=prompt,
                              num_prompt_tokens=len(prompt), params=p, seed=seed + slot,
                              arrival=slot, max_tokens=1 << 30, slot=slot)
                     for slot, (prompt, p) in enumerate(zip(history.tolist(), params))]
        for seq in self.seqs:
            futures = self.pipeline.prepare_request(seq.request_id, seq.params,
                                                    seq.token_ids, seq.is_chat)
            seq.prepared = {name: future.result() for name, future in futures.items()}
            self.pipeline.add_request(seq.slot, seq)
        self.sampler = Sampler(self.pipeline)
        self.stop_checks: list[tuple[StopHook, list[int]]] = []
        for hook in stop_hooks:
            rows = [i for i, s in enumerate(self.seqs) if hook.plugin in s.params.fields]
            if rows:
                self.stop_checks.append((hook, rows))
        self.last_tokens: list[int] | None = None

    def reset(self) -> None:
        self.logits.copy_(self.base_logits)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run(self) -> list[int]:
        batch = SamplingBatch.from_seqs(self.seqs, self.device)
        tokens = self.sampler(self.logits, batch).token_ids
        for seq, token in zip(self.seqs, tokens):
            seq.token_ids.append(token)
        if self.pipeline:
            self.pipeline.accept_tokens(batch.slot_list, tokens)
        # As EngineCore._plugin_stops: each hook sees only the rows that use its plugin.
        for hook, rows in self.stop_checks:
            views = [StopView(seq.params, seq.num_output_tokens, seq.output_view(),
                              seq.params.fields[hook.plugin])
                     for seq in (self.seqs[i] for i in rows)]
            try:
                hook.check(views, [tokens[i] for i in rows])
            except Exception as exc:
                raise BenchError(f"the plugin {hook.plugin!r} failed in check_stop: "
                                 f"{type(exc).__name__}: {exc}") from exc
        failures = self.pipeline.take_failures()
        if failures:
            raise BenchError(str(next(iter(failures.values()))))
        self.last_tokens = tokens
        return tokens


@dataclass
class PluginBench:
    """The three setups of one ``bench plugin`` run, built and ready to time."""

    name: str
    shape: BenchShape
    model: BenchModel
    plain: SamplerStep
    idle: SamplerStep
    active: SamplerStep
    notes: list[str] = field(default_factory=list)


def model_like_logits(batch: int, vocab: int, seed: int) -> torch.Tensor:
    """Random logits shaped like a language model's next-token distribution.

    Probabilities follow a Zipf law (p ∝ rank^-1.5, tokens in a random order per row, with
    a little noise), so the top-p=0.95 nucleus holds some hundreds of tokens, as it does
    for real models. Plain normal logits would make the nucleus most of the vocabulary,
    and the full-vocabulary sort that then needs would swamp everything measured.
    """
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    logits = -1.5 * ranks.log() + 0.1 * torch.randn(batch, vocab, generator=gen)
    order = torch.rand(batch, vocab, generator=gen).argsort(dim=-1)
    return logits.gather(1, order)


def plugin_bench_params(cls: type[Plugin]) -> dict[str, Any] | None:
    """The ``BENCH_PARAMS`` dict of the module that defines plugin class ``cls`` (request
    fields of a typical request), or ``None`` when it has none."""
    params = getattr(sys.modules[cls.__module__], "BENCH_PARAMS", None)
    return params if isinstance(params, dict) and params else None


def bench_params(name: str, classes: dict[str, type[Plugin]]
                 ) -> tuple[list[str], dict[str, Any], list[str]]:
    """The plugins ``name`` stands for among ``classes`` (the enabled plugins), their
    merged ``BENCH_PARAMS``, and notes."""
    names = sorted(classes) if name == "all" else [name]
    merged: dict[str, Any] = {}
    used: list[str] = []
    notes: list[str] = []
    for plugin in names:
        params = plugin_bench_params(classes[plugin])
        if params is None:
            if name != "all":
                raise BenchError(
                    f"plugin {plugin!r} defines no BENCH_PARAMS (a dict of request fields "
                    f"for a typical request, in the module of its class), so there is "
                    f"nothing to benchmark")
            notes.append(f"skipped {plugin}: no BENCH_PARAMS")
            continue
        merged.update(params)
        used.append(plugin)
    if not used:
        raise BenchError("no installed plugin defines BENCH_PARAMS")
    return used, merged, notes


def build_plugin_bench(name: str, shape: BenchShape, num_steps: int, seed: int = 0,
                       model: str | None = None) -> PluginBench:
    """Build (a), (b), (c) for plugin ``name`` (or ``all``), with the tokenizer and EOS ids
    of ``model`` (``load_bench_model``); see the module docstring.

    Raises ``PluginSelectionError`` for a plugin that is not installed and ``BenchError``
    for one that gives nothing to run or cannot be built for this shape and model.
    """
    manager = PluginManager(plugins="all" if name == "all" else name)
    # An unknown name fails here, listing the installed plugins.
    plugins, fields, notes = bench_params(name, manager.plugin_classes())
    source = load_bench_model(model)
    model_info = shape.model(num_steps + NUM_WARMUP_STEPS, source.eos_token_ids)
    plain = SamplingParams(**BASE_PARAMS)
    active = SamplingParams(**{**BASE_PARAMS, **fields})
    try:
        manager.validate(plain, model_info)
        manager.validate(active, model_info)  # the plugins' typed, normalised fields
    except InvalidRequest as exc:
        raise BenchError(f"BENCH_PARAMS of {', '.join(plugins)} do not fit a vocabulary of "
                         f"{shape.vocab} and history of {shape.history}: {exc}") from exc
    processors = manager.processor_classes()
    stop_hooks = manager.stop_hooks()
    measured = {p.name for p in processors} | {h.plugin for h in stop_hooks}
    unmeasured = [p for p in plugins if p not in active.fields or p not in measured]
    if unmeasured:
        notes.append(f"{', '.join(unmeasured)}: no processor or stop hook of it runs on "
                     f"these fields; (c) measures nothing of it")
    device = torch.device(shape.device)
    ctx = ProcessorContext(shape.batch, model_info, device, source.tokenizer,
                           options=manager.options, hooks=manager.hook)
    base = model_like_logits(shape.batch, shape.vocab, seed).to(device)

    def step(procs: list[type[LogitsProcessor]], params: SamplingParams,
             hooks: list[StopHook]) -> SamplerStep:
        return SamplerStep(shape, base, procs, [params] * shape.batch, ctx, hooks, seed)

    try:
        idle = step(processors, plain, stop_hooks)
    except FreeTokenError:
        raise
    except Exception as exc:  # a processor's __init__ refused this shape or tokenizer
        raise BenchError(
            f"the processors of {', '.join(p.name for p in processors)} cannot be built for "
            f"--vocab {shape.vocab} and the tokenizer of {source.name} ({len(source.tokenizer)}"
            f" tokens): {type(exc).__name__}: {exc}") from exc
    return PluginBench(name, shape, source, plain=step([], plain, []), idle=idle,
                       active=step(processors, active, stop_hooks), notes=notes)


def time_steps(steps: list[SamplerStep], num_steps: int, num_warmup: int = NUM_WARMUP_STEPS
               ) -> list[float]:
    """Median seconds per ``run()`` of each step, round-robin, after ``num_warmup`` rounds."""
    times: list[list[float]] = [[] for _ in steps]
    for round_ in range(num_warmup + num_steps):
        for i, step in enumerate(steps):
            step.reset()
            start = time.perf_counter()
            step.run()
            elapsed = time.perf_counter() - start
            if round_ >= num_warmup:
                times[i].append(elapsed)
    return [statistics.median(t) for t in times]


@dataclass
class BenchResult:
    name: str
    shape: BenchShape
    model: str
    num_steps: int
    ms: dict[str, float]
    notes: list[str]

    def table(self) -> str:
        s = self.shape
        rows = [("(a) plain sampler", self.ms["plain"]),
                (f"(b) {self.name} enabled, no row uses it", self.ms["idle"]),
                (f"(c) {self.name} on every row", self.ms["active"])]
        width = max(len(label) for label, _ in rows) + 2
        title = (f"plugin {self.name}: batch {s.batch}, vocab {s.vocab}, history {s.history}, "
                 f"device {s.device}, tokenizer of {self.model}; median of {self.num_steps} "
                 f"steps after {NUM_WARMUP_STEPS} warm-up")
        lines = [title, f"{'':<{width}}{'ms/step':>10}{'vs (a)':>10}"]
        plain = self.ms["plain"]
        for label, ms in rows:
            lines.append(f"{label:<{width}}{ms:>10.3f}{ms / plain:>9.2f}x")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def run_plugin_bench(name: str, shape: BenchShape, num_steps: int = 20,
                     model: str | None = None) -> BenchResult:
    """Build and time the three setups of ``bench plugin NAME``."""
    if num_steps < 1:
        raise BenchError("--steps must be >= 1")
    bench = build_plugin_bench(name, shape, num_steps, model=model)
    plain, idle, active = time_steps([bench.plain, bench.idle, bench.active], num_steps)
    return BenchResult(name, shape, bench.model.name, num_steps,
                       {"plain": plain * 1e3, "idle": idle * 1e3, "active": active * 1e3},
                       bench.notes)
