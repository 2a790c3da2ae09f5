"""A plugin author's kit: drive a logits processor as the engine does, and check it against a
reference across a batched schedule.

``check_processor`` is the one-call test. It runs the processor inside a real
``ProcessorPipeline`` (so the token history, the order of ``add_request`` / ``apply`` /
``update`` and the skipping of unused processors are the engine's own) over a randomized,
seeded schedule of more requests than slots, and at every step compares each row with the
reference:

- **batched steps with mixed rows**: every running sequence is a row, in shuffled order,
  rows of requests with different fields (``requests`` cycles) side by side;
- **rows that do not use it**: every third request sends no field, and its rows must come
  out bit-identical;
- **slot reuse**: finished sequences free their slots to the next waiting request;
- **preemption and resume**: sequences are preempted (``remove_request``) and come back,
  often in another slot, with the tokens they drew so far;
- **rows that skip a step** (a prompt still in prefill): the history bound overshoots.

The logits are random, at temperature 1 (a post-temperature processor sees them as
they are). Tokens are drawn from the *processed* logits (Gumbel-max, seeded), so a processor's bans
are honoured as in generation, and the prompts lean on a few hot tokens so that repeats
(n-grams, repetition rules) happen. The kit asserts that the schedule did cover each case and
that the reference changed some logits (a check of a no-op would prove nothing).

The reference, per request: ``reference(fields)`` with the request's fields (a dict) returns
either a Hugging Face ``LogitsProcessor`` (called as transformers does, on prompt +
output as ``input_ids`` [1, L] and the row's logits [1, V]) or a plain function
``row(prompt, output, logits)`` → the row's expected logits (``prompt`` and ``output``
are lists of ids, ``logits`` a float32 CPU tensor [V] it may change in place).

``Harness`` is the driver underneath, for hand-written tests: ``add`` / ``remove`` /
``apply`` / ``update`` one step at a time, with the history kept as the engine keeps it.
An exception inside the processor surfaces as an ``AssertionError`` naming the method.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from freetoken_core.engine.pipeline import ProcessorPipeline
from freetoken_core.engine.sequence import Sequence as EngineSequence
from freetoken_core.history import TokenHistory
from freetoken_core.plugins import PluginManager
from freetoken_core.processors import LogitsProcessor, ModelInfo, ProcessorContext
from freetoken_core.sampling_params import SamplingParams

RowReference = Callable[[list[int], list[int], torch.Tensor], torch.Tensor]


class Harness:
    """One processor class in a ``ProcessorPipeline`` of its own, driven step by step.

    ``plugin`` is an installed plugin's name (found and validated through its entry point,
    as the server does) or a ``LogitsProcessor`` class with ``name`` set (validated by its
    ``Fields`` and ``validate``). ``processor`` is the instance; ``history`` the token
    history the pipeline keeps (``None`` when the class does not read it).
    """

    def __init__(self, plugin: str | type[LogitsProcessor], *, num_slots: int = 4,
                 vocab: int = 64, max_model_len: int = 256, device: str = "cpu",
                 tokenizer: Any = None, options: Mapping[str, Any] | None = None) -> None:
        self.model = ModelInfo(vocab, frozenset({vocab - 1}), max_model_len)
        self.device = torch.device(device)
        self._manager: PluginManager | None = None
        if isinstance(plugin, str):
            self._manager = PluginManager(plugins=plugin, options=options)
            classes = {c.name: c for c in self._manager.processor_classes()}
            if plugin not in classes:
                raise ValueError(f"{plugin!r} is not a logits processor plugin")
            self.cls = classes[plugin]
        else:
            if not plugin.name:
                raise ValueError(f"{plugin.__name__}.name is empty: set it or pass the "
                                 "installed plugin's name")
            self.cls = plugin
        hooks = self._manager.hook if self._manager is not None else None
        ctx = ProcessorContext(num_slots, self.model, self.device, tokenizer,
                               dict(options or {}), hooks)
        self.pipeline = ProcessorPipeline([self.cls], ctx)
        [self.processor] = self.pipeline.processors
        self.history: TokenHistory | None = self.pipeline.history
        self._seq_ids = 0

    def params(self, fields: Mapping[str, Any] | None) -> SamplingParams:
        """``SamplingParams`` with these plugin fields, validated as the server does (a bad
        value raises ``InvalidRequest``); ``params.fields`` names the plugin when the
        request uses it."""
        params = SamplingParams(**dict(fields or {}))
        if self._manager is not None:
            self._manager.validate(params, self.model)
            return params
        typed = msgspec.convert(params.extra, self.cls.Fields) if self.cls.Fields else None
        params.fields = {}
        if typed is not None and self.cls.uses(typed):
            params.fields[self.cls.name] = self.cls.validate(typed, self.model, params)
        return params

    def add(self, slot: int, fields: Mapping[str, Any] | SamplingParams | None,
            prompt: Sequence[int], output: Sequence[int] = ()) -> bool:
        """Give ``slot`` a sequence (new, or resumed with ``output``) as the scheduler
        does; whether its request uses the processor."""
        params = fields if isinstance(fields, SamplingParams) else self.params(fields)
        seq = EngineSequence(self._seq_ids, str(self._seq_ids), [*prompt, *output],
                             len(prompt), params, seed=0, arrival=self._seq_ids,
                             max_tokens=1 << 20, slot=slot)
        self._seq_ids += 1
        self.pipeline.add_request(slot, seq)
        return self.cls.name in params.fields

    def remove(self, slot: int) -> None:
        """The slot's sequence finished or was preempted."""
        self.pipeline.remove_request(slot)
        self._raise_failures()

    def apply(self, logits: torch.Tensor, slots: torch.Tensor | Sequence[int]) -> None:
        """``prepare_step`` and ``apply`` (both stages, as in a sampling step) in place."""
        slots = self._slots(slots)
        self.pipeline.prepare_step(slots.tolist())
        for post in (False, True):
            self.pipeline.apply(logits, slots, post_temperature=post, all_greedy=False)
        self._raise_failures()

    def update(self, slots: torch.Tensor | Sequence[int],
               sampled: torch.Tensor | Sequence[int]) -> set[int]:
        """The step's drawn tokens: history, ``update``, then ``accept_tokens``; the slots
        whose request the processor ends now."""
        slots = self._slots(slots)
        sampled = torch.as_tensor(sampled, dtype=torch.long).to(self.device)
        self.pipeline.update(slots, sampled)
        ended = self.pipeline.accept_tokens(slots.tolist(), sampled.tolist())
        self._raise_failures()
        return ended

    def _slots(self, slots: torch.Tensor | Sequence[int]) -> torch.Tensor:
        return torch.as_tensor(slots, dtype=torch.long).to(self.device)

    def _raise_failures(self) -> None:
        failures = self.pipeline.take_failures()
        if failures:
            raise AssertionError(str(next(iter(failures.values()))))


def _is_hf_processor(reference: object) -> bool:
    return any(c.__module__.startswith("transformers.") for c in type(reference).__mro__)


def _row_reference(reference: object) -> RowReference:
    if _is_hf_processor(reference):
        hf = reference

        def row(prompt: list[int], output: list[int], logits: torch.Tensor) -> torch.Tensor:
            return hf(torch.tensor([prompt + output]), logits.unsqueeze(0)).squeeze(0)

        return row
    return reference  # type: ignore[return-value]


@dataclass
class _Seq:
    fields: Mapping[str, Any] | None
    params: SamplingParams
    prompt: list[int]
    length: int
    output: list[int] = field(default_factory=list)
    uses: bool = False
    slot: int | None = None
    num_resumes: int = 0


@dataclass
class CheckReport:
    """What ``check_processor`` covered."""

    steps: int = 0
    rows_checked: int = 0
    rows_changed: int = 0
    rows_unused: int = 0
    mixed_steps: int = 0
    slot_reuses: int = 0
    preemptions: int = 0
    resumes_elsewhere: int = 0
    skipped_rows: int = 0


def check_processor(plugin: str | type[LogitsProcessor],
                    requests: Sequence[Mapping[str, Any]],
                    reference: Callable[[dict[str, Any]], Any], *,
                    vocab: int = 48, num_slots: int = 4, num_requests: int = 14,
                    max_prompt: int = 16, max_output: int = 24, seed: int = 0,
                    device: str = "cpu", exact: bool = True, atol: float = 1e-6,
                    tokenizer: Any = None, options: Mapping[str, Any] | None = None
                    ) -> CheckReport:
    """Run the schedule of the module docstring and assert that every row of every step
    equals the reference (``torch.equal`` when ``exact``, else within ``atol``) and that
    rows of requests without the plugin's fields are unchanged. ``requests`` are the plugin
    fields of the using requests (cycled); returns what was covered."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    harness = Harness(plugin, num_slots=num_slots, vocab=vocab,
                      max_model_len=max_prompt + max_output + 1, device=device,
                      tokenizer=tokenizer, options=options)
    hot = rng.sample(range(vocab), min(6, vocab))
    waiting: list[_Seq] = []
    for i in range(num_requests):
        fields = None if i % 3 == 2 else dict(requests[i % len(requests)])
        prompt = [rng.choice(hot) if rng.random() < 0.6 else rng.randrange(vocab)
                  for _ in range(rng.randint(1, max_prompt))]
        params = harness.params(fields)
        waiting.append(_Seq(fields, params, prompt, rng.randint(2, max_output)))
    refs: dict[int, RowReference] = {}
    report, running, used_slots = CheckReport(), {}, set()
    while waiting or running:
        for slot in [s for s in range(num_slots) if s not in running]:
            if not waiting:
                break
            seq = waiting.pop(0)
            report.slot_reuses += slot in used_slots
            report.resumes_elsewhere += seq.num_resumes > 0 and slot != seq.slot
            seq.slot, running[slot] = slot, seq
            used_slots.add(slot)
            seq.uses = harness.add(slot, seq.params, seq.prompt, seq.output)
            if seq.uses and id(seq) not in refs:
                refs[id(seq)] = _row_reference(reference(dict(seq.fields or {})))
        rows = list(running)
        rng.shuffle(rows)
        if len(rows) > 1 and rng.random() < 0.2:
            rows.pop()  # a row that does not draw this step (its prompt still in prefill)
            report.skipped_rows += 1
        raw = torch.randn(len(rows), vocab, generator=gen) * 2
        raw[:, hot] += 2.0
        logits = raw.to(harness.device, copy=True)
        harness.apply(logits, rows)
        got = logits.cpu()
        for i, slot in enumerate(rows):
            seq = running[slot]
            if not seq.uses:
                assert torch.equal(got[i], raw[i]), (
                    f"step {report.steps}: the row of slot {slot}, whose request does not use "
                    f"the processor, changed")
                report.rows_unused += 1
                continue
            expected = refs[id(seq)](list(seq.prompt), list(seq.output), raw[i].clone())
            same = (torch.equal(got[i], expected) if exact
                    else torch.allclose(got[i], expected, atol=atol, rtol=0))
            assert same, (f"step {report.steps}, slot {slot}, fields {seq.fields}, prompt "
                          f"{seq.prompt}, output {seq.output}: processor and reference differ "
                          f"at tokens {(got[i] != expected).nonzero().flatten().tolist()}")
            report.rows_checked += 1
            report.rows_changed += not torch.equal(expected, raw[i])
        report.mixed_steps += len({running[s].uses for s in rows}) == 2
        gumbel = -torch.empty_like(got).exponential_(generator=gen).log()
        drawn = torch.where(torch.isneginf(got).all(dim=1, keepdim=True), raw, got)
        tokens = (drawn + gumbel).argmax(dim=1).tolist()
        ended = harness.update(rows, tokens)
        for slot, token in zip(rows, tokens):
            running[slot].output.append(token)
        report.steps += 1
        for slot in list(running):
            seq = running[slot]
            if len(seq.output) >= seq.length or slot in ended:
                harness.remove(slot)
                del running[slot]
            elif rng.random() < 0.08 or (report.preemptions == 0 and len(seq.output) == 2):
                harness.remove(slot)  # preempted: back to the front of the queue
                del running[slot]
                seq.num_resumes += 1
                report.preemptions += 1
                waiting.insert(rng.randint(0, min(1, len(waiting))), seq)
    _assert_covered(report)
    return report


def _assert_covered(report: CheckReport) -> None:
    missing = [name for name, value in (
        ("rows using the processor", report.rows_checked), ("unused rows", report.rows_unused),
        ("mixed steps", report.mixed_steps), ("slot reuse", report.slot_reuses),
        ("preemption", report.preemptions), ("resume in another slot",
                                             report.resumes_elsewhere)) if not value]
    assert not missing, f"the schedule did not cover: {', '.join(missing)} ({report})"
    assert report.rows_changed, (
        f"the reference never changed a logit in {report.rows_checked} rows: choose fields "
        "that act on this schedule")
