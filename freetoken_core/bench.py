"""What a plugin costs the sampler step: ``freetoken bench plugin NAME``.

One run measures, on the same model-like random float32 logits [batch, vocab] (see
``model_like_logits``; temperature 0.8,
top_p 0.95, ``history`` prompt tokens per row), the median time of one engine sampler step
in three setups:

(a) plain: a ``ProcessorPipeline`` with no processors;
(b) idle: the plugin enabled, no row using it (must cost nothing: the pipeline skips it);
(c) active: every row uses the plugin, with the request fields of the plugin module's
    ``BENCH_PARAMS`` dict; its processors get each row's history through ``add_request``
    and fold each step's tokens in ``update`` (the sampler calls it, as in the engine).

A step is what the engine does per decode step for these rows: the sampler (processors,
temperature, top-p, seeded draw, ``update``) plus, for plugins with a
``freetoken_check_stop`` hook, that hook over the rows that use the plugin's fields.
Refreshing the logits and appending the drawn tokens to the sequences happen between
timed steps. The three setups run round-robin so that drift hits them alike.

``NAME`` may be ``all``: every installed plugin at once, ``BENCH_PARAMS`` merged (plugins
without ``BENCH_PARAMS`` are skipped with a note). ``bench/bench_<plugin>.py`` use the
same ``SamplerStep`` under pytest-benchmark.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

import torch

from freetoken_core.engine.sampler import Sampler, SamplingBatch
from freetoken_core.engine.sequence import Sequence
from freetoken_core.errors import FreeTokenError, InvalidRequest
from freetoken_core.hookspecs import ENTRY_POINT_GROUP
from freetoken_core.plugins import PluginManager
from freetoken_core.processors import LogitsProcessor, ModelInfo, ProcessorPipeline, StopView
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

    def model(self, num_steps: int) -> ModelInfo:
        return ModelInfo(self.vocab, EOS_TOKEN_IDS,
                         self.history + max(MAX_TOKENS, num_steps + 16))


StopHook = Callable[[list[StopView], list[int]], list[Any]]


class SamplerStep:
    """One engine sampler step over a fixed batch, to be run again and again.

    ``reset()`` (untimed) refreshes the logits from ``base_logits`` and appends the tokens
    drawn by the previous ``run()`` to the sequences; ``run()`` (timed) is the step.
    """

    def __init__(self, shape: BenchShape, base_logits: torch.Tensor,
                 processors: list[type[LogitsProcessor]], params: list[SamplingParams],
                 model: ModelInfo, check_stop: StopHook | None = None,
                 stop_fields: frozenset[str] = frozenset(), seed: int = 0) -> None:
        device = torch.device(shape.device)
        self.device = device
        self.base_logits = base_logits
        self.logits = base_logits.clone()
        gen = torch.Generator().manual_seed(seed)
        history = torch.randint(0, shape.vocab, (shape.batch, shape.history), generator=gen)
        self.pipeline = ProcessorPipeline(processors, shape.batch, model, device)
        self.seqs = []
        for slot, (prompt, p) in enumerate(zip(history.tolist(), params)):
            self.seqs.append(Sequence(seq_id=slot, request_id=str(slot), token_ids=prompt,
                                      num_prompt_tokens=len(prompt), params=p, seed=seed + slot,
                                      arrival=slot, max_tokens=1 << 30, slot=slot))
            self.pipeline.add_request(slot, p, prompt, [])
        self.sampler = Sampler(self.pipeline)
        self.check_stop = check_stop
        self.stop_rows = [i for i, s in enumerate(self.seqs)
                          if not stop_fields.isdisjoint(s.params.extra)]
        self.last_tokens: list[int] | None = None

    def reset(self) -> None:
        if self.last_tokens is not None:
            for seq, token in zip(self.seqs, self.last_tokens):
                seq.token_ids.append(token)
        self.logits.copy_(self.base_logits)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run(self) -> list[int]:
        batch = SamplingBatch.from_seqs(self.seqs, self.device)
        tokens = self.sampler(self.logits, batch).token_ids
        if self.check_stop is not None and self.stop_rows:
            # As EngineCore._plugin_stops: only the rows whose request uses a stop field.
            views = [StopView.of(self.seqs[i]) for i in self.stop_rows]
            self.check_stop(views, [tokens[i] for i in self.stop_rows])
        self.last_tokens = tokens
        return tokens


@dataclass
class PluginBench:
    """The three setups of one ``bench plugin`` run, built and ready to time."""

    name: str
    shape: BenchShape
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


def bench_params(name: str) -> tuple[list[str], dict[str, Any], list[str]]:
    """The plugins ``name`` stands for, their merged ``BENCH_PARAMS``, and notes."""
    modules = {ep.name: ep.load() for ep in entry_points(group=ENTRY_POINT_GROUP)}
    names = sorted(modules) if name == "all" else [name]
    merged: dict[str, Any] = {}
    used: list[str] = []
    notes: list[str] = []
    for plugin in names:
        params = getattr(modules[plugin], "BENCH_PARAMS", None)
        if not isinstance(params, dict) or not params:
            if name != "all":
                raise BenchError(
                    f"plugin {plugin!r} defines no BENCH_PARAMS (a dict of request fields "
                    f"for a typical request), so there is nothing to benchmark")
            notes.append(f"skipped {plugin}: no BENCH_PARAMS")
            continue
        merged.update(params)
        used.append(plugin)
    if not used:
        raise BenchError("no installed plugin defines BENCH_PARAMS")
    return used, merged, notes


def build_plugin_bench(name: str, shape: BenchShape, num_steps: int, seed: int = 0
                       ) -> PluginBench:
    """Build (a), (b), (c) for plugin ``name`` (or ``all``); see the module docstring.

    Raises ``PluginSelectionError`` for a plugin that is not installed and ``BenchError``
    for one that gives nothing to run.
    """
    manager = PluginManager(plugins="all" if name == "all" else name)
    manager.enabled  # noqa: B018 (an unknown name fails here, listing installed plugins)
    plugins, fields, notes = bench_params(name)
    model = shape.model(num_steps + NUM_WARMUP_STEPS)
    plain = SamplingParams(**BASE_PARAMS)
    active = SamplingParams(**{**BASE_PARAMS, **fields})
    try:
        manager.validate(active, model)  # also lets plugins normalise their values
    except InvalidRequest as exc:
        raise BenchError(f"BENCH_PARAMS of {', '.join(plugins)} do not fit a vocabulary of "
                         f"{shape.vocab} and history of {shape.history}: {exc}") from exc
    processors = manager.processor_classes()
    hook = manager.pm.hook.freetoken_check_stop
    stop_fields = frozenset(manager.stop_fields())

    def check_stop(views: list[StopView], tokens: list[int]) -> list[Any]:
        return hook(sequences=views, token_ids=tokens)

    if not any(p.uses(active) for p in processors) and not stop_fields & set(fields):
        notes.append(f"{', '.join(plugins)}: no processor or stop hook uses {sorted(fields)}; "
                     "(c) measures nothing of it")
    base = model_like_logits(shape.batch, shape.vocab, seed).to(shape.device)
    rows = shape.batch

    def step(procs: list[type[LogitsProcessor]], params: SamplingParams,
             stop: bool) -> SamplerStep:
        return SamplerStep(shape, base, procs, [params] * rows, model,
                           check_stop if stop and stop_fields else None,
                           stop_fields, seed)

    return PluginBench(name, shape, plain=step([], plain, stop=False),
                       idle=step(processors, plain, stop=True),
                       active=step(processors, active, stop=True), notes=notes)


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
                 f"device {s.device}; median of {self.num_steps} steps after "
                 f"{NUM_WARMUP_STEPS} warm-up")
        lines = [title, f"{'':<{width}}{'ms/step':>10}{'vs (a)':>10}"]
        plain = self.ms["plain"]
        for label, ms in rows:
            lines.append(f"{label:<{width}}{ms:>10.3f}{ms / plain:>9.2f}x")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def run_plugin_bench(name: str, shape: BenchShape, num_steps: int = 20) -> BenchResult:
    """Build and time the three setups of ``bench plugin NAME``."""
    if num_steps < 1:
        raise BenchError("--steps must be >= 1")
    bench = build_plugin_bench(name, shape, num_steps)
    plain, idle, active = time_steps([bench.plain, bench.idle, bench.active], num_steps)
    return BenchResult(name, shape, num_steps,
                       {"plain": plain * 1e3, "idle": idle * 1e3, "active": active * 1e3},
                       bench.notes)
