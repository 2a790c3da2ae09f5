"""The logits-processor contract and the pipeline that runs processors in a fixed order.

A processor is batch-level and slot-keyed. The engine gives every running sequence a slot
in ``[0, max_num_slots)`` and owns the mapping from batch rows to slots; a processor keeps
its per-slot state in tensors preallocated on the device and never does row bookkeeping.

Lifecycle, all driven by the engine:

- ``uses(params)`` (class-level): does this request need the processor? Only requests
  that do are added, and a step in which no running request uses a processor does not
  run it at all (no launch, no copy, no Python loop).
- ``validate(params, model)`` (class-level): raise ``InvalidRequest`` naming the field.
- ``add_request(slot, params, prompt_token_ids, output_token_ids)``: build the slot's
  state once. ``output_token_ids`` is empty for a new sequence and holds the tokens drawn
  so far when a preempted sequence comes back.
- ``remove_request(slot)``: forget the slot (it may be reused for another request).
- ``update(slots, sampled)``: fold the step's sampled tokens into the state on the
  device; ``slots`` and ``sampled`` are 1-D long tensors of the rows that drew a token.
  No device-to-host synchronisation.
- ``apply(logits, slots)``: change the float32 ``logits`` [rows, vocab] in place for all
  rows at once; row ``i`` belongs to ``slots[i]``. Rows of slots that do not use the
  processor must come out unchanged.

Pipeline order (``Stage``), fixed here and nowhere else:
logit_bias → min_tokens → penalties (repetition → presence → frequency) → other
pre-temperature processors → [greedy shortcut when every row is greedy] → temperature →
min_p and other post-temperature processors → top-k / top-p → counter-based draw →
logprobs. Processors declared ``argmax_invariant`` are skipped in all-greedy steps.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from freetoken_core.faults import RequestError, plugin_failure

if TYPE_CHECKING:
    from freetoken_core.engine.sequence import Sequence as EngineSequence
    from freetoken_core.sampling_params import SamplingParams

log = logging.getLogger("freetoken.engine")


class Stage(enum.IntEnum):
    """Where a processor runs in the pipeline; lower runs first."""

    LOGIT_BIAS = 10
    MIN_TOKENS = 20
    PENALTIES = 30
    PRE_TEMPERATURE = 40
    POST_TEMPERATURE = 60


@dataclass(frozen=True)
class ModelInfo:
    """What validation and processors may know about the served model."""

    vocab_size: int
    eos_token_ids: frozenset[int]
    max_model_len: int


@dataclass
class StopView:
    """One sequence as ``freetoken_check_stop`` sees it. ``output_token_ids`` is a read-only
    sequence of the generated tokens (the engine passes a view: indexing from the end is
    cheap, slicing copies)."""

    params: SamplingParams
    num_output_tokens: int
    output_token_ids: SequenceABC[int]

    @classmethod
    def of(cls, seq: EngineSequence) -> StopView:
        return cls(seq.params, seq.num_output_tokens, seq.output_view())


@dataclass(frozen=True)
class StopHook:
    """One plugin's ``freetoken_check_stop``: the engine calls ``check(views, token_ids)``
    with the rows whose request uses one of ``fields``; an exception fails exactly those
    rows' requests, naming ``plugin``."""

    plugin: str
    fields: frozenset[str]
    check: Callable[[list[StopView], list[int]], dict[int, int | str] | None]


class LogitsProcessor:
    """Base class of every logits processor; see the module docstring for the contract."""

    name: ClassVar[str] = ""
    stage: ClassVar[Stage] = Stage.PRE_TEMPERATURE
    argmax_invariant: ClassVar[bool] = False
    fields: ClassVar[tuple[str, ...]] = ()
    """Request fields that switch the processor on (``uses`` looks at them by default)."""

    def __init__(self, max_num_slots: int, model: ModelInfo, device: torch.device) -> None:
        self.max_num_slots = max_num_slots
        self.model = model
        self.device = device

    @classmethod
    def uses(cls, params: SamplingParams) -> bool:
        return any(params.extra.get(f) is not None for f in cls.fields)

    @classmethod
    def validate(cls, params: SamplingParams, model: ModelInfo) -> None:
        """Raise ``InvalidRequest`` for a bad value of one of ``fields``."""

    def add_request(self, slot: int, params: SamplingParams, prompt_token_ids: list[int],
                    output_token_ids: list[int]) -> None:
        raise NotImplementedError

    def remove_request(self, slot: int) -> None:
        raise NotImplementedError

    def update(self, slots: torch.Tensor, sampled: torch.Tensor) -> None:
        """Most processors keep no per-step state; the default does nothing."""

    def apply(self, logits: torch.Tensor, slots: torch.Tensor) -> None:
        raise NotImplementedError


def check_processor_class(cls: type) -> None:
    """Reject a registration that breaks the contract, at start-up."""
    if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
        raise TypeError(f"{cls!r} is not a LogitsProcessor subclass")
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if not isinstance(cls.stage, Stage):
        raise TypeError(f"{cls.__name__}.stage must be a freetoken_core.processors.Stage")


class ProcessorPipeline:
    """The engine's processors in pipeline order, with the set of slots each one serves.

    A processor whose method raises fails the requests that use it, never the step:
    ``add_request`` raises ``RequestError`` naming its plugin (the caller fails that
    sequence's request; the slot is left clean); an exception in ``apply`` or ``update``
    marks every slot the processor serves as failed, and the other processors go on.
    ``take_failures()`` hands those slots to the engine after the step.
    """

    def __init__(self, classes: list[type[LogitsProcessor]], max_num_slots: int,
                 model: ModelInfo, device: torch.device,
                 owners: dict[str, str] | None = None) -> None:
        """``owners`` maps a processor's ``name`` to the plugin that registered it (for
        error messages; the processor's own name is used when it is missing)."""
        names = [c.name for c in classes]
        if len(set(names)) != len(names):
            raise ValueError(f"two processors share a name: {sorted(names)}")
        for cls in classes:
            check_processor_class(cls)
        ordered = sorted(classes, key=lambda c: (c.stage, c.name))
        self.processors = [cls(max_num_slots, model, device) for cls in ordered]
        self._slots: list[set[int]] = [set() for _ in self.processors]
        self._owners = owners or {}
        self._failures: dict[int, RequestError] = {}

    def __bool__(self) -> bool:
        return bool(self.processors)

    def _plugin_of(self, proc: LogitsProcessor) -> str:
        return self._owners.get(proc.name, proc.name)

    def add_request(self, slot: int, params: SamplingParams, prompt_token_ids: list[int],
                    output_token_ids: list[int]) -> None:
        """Build ``slot``'s state in every processor the request uses. If one raises, the
        ones already built are removed again and ``RequestError`` names the plugin."""
        for proc, slots in zip(self.processors, self._slots):
            if not type(proc).uses(params):
                continue
            try:
                proc.add_request(slot, params, prompt_token_ids, output_token_ids)
            except Exception as exc:
                self.remove_request(slot)
                raise plugin_failure(self._plugin_of(proc), "add_request", exc) from exc
            slots.add(slot)

    def remove_request(self, slot: int) -> None:
        """Forget ``slot`` everywhere; a processor that raises here is logged and the slot
        is dropped from it all the same (the request is ending anyway)."""
        for proc, slots in zip(self.processors, self._slots):
            if slot in slots:
                slots.discard(slot)
                try:
                    proc.remove_request(slot)
                except Exception as exc:  # a plugin bug; logged, then ignored
                    log.error("processor %s failed in remove_request", proc.name,
                              exc_info=exc)
        self._failures.pop(slot, None)

    def active(self) -> list[LogitsProcessor]:
        return [p for p, slots in zip(self.processors, self._slots) if slots]

    def _fail(self, proc: LogitsProcessor, slots: set[int], stage: str,
              exc: Exception) -> None:
        error = plugin_failure(self._plugin_of(proc), stage, exc)
        for slot in slots:
            self._failures.setdefault(slot, error)

    def apply(self, logits: torch.Tensor, slots: torch.Tensor, *, post_temperature: bool,
              all_greedy: bool) -> None:
        for proc, used in zip(self.processors, self._slots):
            if not used or (proc.stage >= Stage.POST_TEMPERATURE) != post_temperature:
                continue
            if all_greedy and proc.argmax_invariant:
                continue
            try:
                proc.apply(logits, slots)
            except Exception as exc:  # noqa: BLE001 (fails the requests using proc)
                self._fail(proc, used, "apply", exc)

    def update(self, slots: torch.Tensor, sampled: torch.Tensor) -> None:
        for proc, used in zip(self.processors, self._slots):
            if used:
                try:
                    proc.update(slots, sampled)
                except Exception as exc:  # noqa: BLE001 (fails the requests using proc)
                    self._fail(proc, used, "update", exc)

    def names_for(self, slot: int) -> list[str]:
        """The processors serving ``slot`` (for error messages)."""
        return [p.name for p, slots in zip(self.processors, self._slots) if slot in slots]

    def take_failures(self) -> dict[int, RequestError]:
        """Slots whose processor raised since the last call, with the error of each."""
        failures, self._failures = self._failures, {}
        return failures
