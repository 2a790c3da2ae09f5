"""The engine's logits processors, in pipeline order, with the slots each one serves.

The contract a processor follows is in ``freetoken_core.processors``; this class drives it.
A request uses a processor when the processor's plugin name is in ``params.fields`` (the
fields were validated, once, by the process that accepted the request). A processor that
no running sequence uses costs nothing in a step: no launch, no copy, no Python loop; the
optional host-side methods (``prepare_step``, ``accept_tokens``) are called only for the
processors that override them.

A processor whose method raises fails the requests that use it, never the step:
``prepare_request`` and ``add_request`` raise ``RequestError`` naming its plugin (the
caller fails that request; the slot is left clean); an exception in ``prepare_step``,
``apply``, ``update`` or ``accept_tokens`` marks every slot the processor serves as
failed, and the other processors go on. ``take_failures()`` hands those slots to the
engine after the step.

When a processor ``reads_history``, the pipeline keeps the ``TokenHistory`` that every
processor gets in its context: a slot is added to it before the processors'
``add_request`` (for a request that uses a reader), removed after their
``remove_request``, and each step's tokens are appended before their ``update``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence as SequenceABC
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from freetoken_core.errors import FreeTokenError, InvalidRequest
from freetoken_core.faults import RequestError, plugin_failure
from freetoken_core.history import TokenHistory
from freetoken_core.processors import (
    LogitsProcessor,
    ProcessorContext,
    RequestView,
    Stage,
    check_plugin_class,
    has_method,
)

if TYPE_CHECKING:
    from freetoken_core.engine.sequence import Sequence
    from freetoken_core.sampling_params import SamplingParams

log = logging.getLogger("freetoken.engine")


class ProcessorPipeline:
    """See the module docstring."""

    def __init__(self, classes: list[type[LogitsProcessor]], ctx: ProcessorContext) -> None:
        names = [c.name for c in classes]
        if len(set(names)) != len(names):
            raise ValueError(f"two processors share a name: {sorted(names)}")
        for cls in classes:
            check_plugin_class(cls)
        ordered = sorted(classes, key=lambda c: (c.stage, c.name))
        # One history for every processor that reads it, only when one does.
        self.history = (TokenHistory(ctx.max_num_slots, ctx.model.max_model_len, ctx.device)
                        if any(c.reads_history for c in ordered) else None)
        if self.history is not None:
            ctx = dataclasses.replace(ctx, history=self.history)
        self.processors = [cls(ctx) for cls in ordered]
        self._readers = {p.name for p in self.processors if p.reads_history}
        self._slots: list[set[int]] = [set() for _ in self.processors]
        self._host_prepare = [has_method(type(p), "prepare_step") for p in self.processors]
        self._host_accept = [has_method(type(p), "accept_tokens") for p in self.processors]
        self._failures: dict[int, RequestError] = {}

    def __bool__(self) -> bool:
        return bool(self.processors)

    # -- per request -------------------------------------------------------------------

    def prepare_request(self, request_id: str, params: SamplingParams,
                        prompt_token_ids: SequenceABC[int], is_chat: bool
                        ) -> dict[str, Future[Any]]:
        """Start each used processor's slow per-request work; the futures by processor
        name (empty when there is none). Raises ``RequestError`` naming the plugin."""
        futures: dict[str, Future[Any]] = {}
        for proc in self.processors:
            if proc.name not in params.fields or not has_method(type(proc), "prepare_request"):
                continue
            view = RequestView(request_id, 0, params.fields[proc.name], params,
                               prompt_token_ids, (), is_chat)
            try:
                future = proc.prepare_request(view)
            except FreeTokenError:
                raise
            except Exception as exc:
                raise plugin_failure(proc.name, "prepare_request", exc) from exc
            if future is not None:
                futures[proc.name] = future
        return futures

    def add_request(self, slot: int, seq: Sequence) -> None:
        """Build ``slot``'s state in every processor ``seq``'s request uses. If one raises,
        the ones already built are removed again and ``RequestError`` names the plugin."""
        fields = seq.params.fields
        prompt = seq.token_ids[:seq.num_prompt_tokens]
        if self.history is not None and not self._readers.isdisjoint(fields):
            self.history.add(slot, prompt, seq.output_token_ids)
        for proc, slots in zip(self.processors, self._slots):
            if proc.name not in fields:
                continue
            view = RequestView(seq.request_id, seq.index, fields[proc.name], seq.params,
                               prompt, seq.output_token_ids, seq.is_chat,
                               seq.prepared.get(proc.name))
            try:
                proc.add_request(slot, view)
            except Exception as exc:
                self.remove_request(slot)
                if isinstance(exc, FreeTokenError):
                    raise
                raise plugin_failure(proc.name, "add_request", exc) from exc
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
        if self.history is not None:
            self.history.remove(slot)
        self._failures.pop(slot, None)

    # -- per step --------------------------------------------------------------------

    def active(self) -> list[LogitsProcessor]:
        return [p for p, slots in zip(self.processors, self._slots) if slots]

    def any_post_temperature(self) -> bool:
        """Whether a processor that runs after temperature has rows now."""
        return any(slots and proc.stage >= Stage.POST_TEMPERATURE
                   for proc, slots in zip(self.processors, self._slots))

    def _fail(self, proc: LogitsProcessor, slots: set[int], stage: str,
              exc: Exception) -> None:
        error = plugin_failure(proc.name, stage, exc)
        for slot in slots:
            self._failures.setdefault(slot, error)

    def prepare_step(self, slots: list[int]) -> None:
        """Host-side work of the processors that have some, before any ``apply``; ``slots``
        is the slot of each sampling row, in row order (rows of other processors included,
        so that a processor can address its rows in ``apply``'s logits)."""
        for proc, used, host in zip(self.processors, self._slots, self._host_prepare):
            if not (used and host):
                continue
            try:
                proc.prepare_step(slots)
            except Exception as exc:  # noqa: BLE001 (fails the requests using proc)
                self._fail(proc, used, "prepare_step", exc)

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
        """Append the drawn tokens to the history, then each used processor's ``update``;
        ``slots`` and ``sampled`` cover every row that drew (rows of slots a processor never
        saw included)."""
        if self.history is not None:
            self.history.append(slots, sampled)
        for proc, used in zip(self.processors, self._slots):
            if used:
                try:
                    proc.update(slots, sampled)
                except Exception as exc:  # noqa: BLE001 (fails the requests using proc)
                    self._fail(proc, used, "update", exc)

    def accept_tokens(self, slots: list[int], token_ids: list[int]) -> set[int]:
        """Hand the step's tokens to the processors with host-side state; the slots whose
        request a processor ends now."""
        finished: set[int] = set()
        for proc, used, host in zip(self.processors, self._slots, self._host_accept):
            if not (used and host):
                continue
            rows = [i for i, s in enumerate(slots) if s in used]
            if not rows:
                continue
            try:
                ended = proc.accept_tokens([slots[i] for i in rows],
                                           [token_ids[i] for i in rows])
                finished.update(s for s in ended or () if s in used)
            except Exception as exc:  # noqa: BLE001 (fails the requests using proc)
                self._fail(proc, used, "accept_tokens", exc)
        return finished

    def names_for(self, slot: int) -> list[str]:
        """The processors serving ``slot`` (for error messages)."""
        return [p.name for p, slots in zip(self.processors, self._slots) if slot in slots]

    def conflict_error(self, slot: int, params: SamplingParams,
                       num_output_tokens: int) -> InvalidRequest:
        """The 400 for a request whose processors on ``slot`` masked every token (a grammar
        that must end now while another processor holds EOS back): it names the fields the
        request set for them, the last as ``param``."""
        sent = [f for name in self.names_for(slot) if name in params.fields
                for f, v in msgspec.structs.asdict(params.fields[name]).items()
                if v is not None]
        listed = " and ".join(sent) or "the request's fields"
        return InvalidRequest(sent[-1] if sent else None,
                              f"{listed} conflict: after {num_output_tokens} generated "
                              "tokens they leave no token to sample")

    def take_failures(self) -> dict[int, RequestError]:
        """Slots whose processor raised since the last call, with the error of each."""
        failures, self._failures = self._failures, {}
        return failures
