"""The engine core: requests in, one scheduling step at a time, token updates out.

It runs the scheduler, the model runner and the token-level stop rules (EOS, max_tokens,
context length). Text (detokenization, stop strings) is the caller's business: the
in-process ``LLMEngine`` and, under ``freetoken serve``, the HTTP side.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

from freetoken_core.config import EngineLimits
from freetoken_core.engine.scheduler import ScheduledBatch, Scheduler
from freetoken_core.engine.sequence import Sequence
from freetoken_core.engine.step_times import StepTimes
from freetoken_core.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    CommunicationError,
    FreeTokenError,
    InvalidRequest,
)
from freetoken_core.faults import RequestError, plugin_failure
from freetoken_core.outputs import INVALID_TOKEN, NO_TOKEN, PromptLogprobs, TokenLogprobs
from freetoken_core.plugins import StopHook
from freetoken_core.processors import StopView
from freetoken_core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from freetoken_core.engine.model_runner import ModelRunner
    from freetoken_core.engine.pipeline import ProcessorPipeline

_MASK_64 = (1 << 64) - 1

log = logging.getLogger("freetoken.engine")


def _as_int64(value: int) -> int:
    value &= _MASK_64
    return value - (1 << 64) if value >= 1 << 63 else value


def choice_seed(seed: int, index: int) -> int:
    """Seed (an int64, as the sampler's tensors hold it) of choice ``index`` of a request
    seeded with ``seed``; choice 0 keeps it, so every int64 seed draws differently."""
    if index == 0:
        return _as_int64(seed)
    return _as_int64(seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9)


def effective_max_tokens(num_prompt_tokens: int, params: SamplingParams,
                         max_model_len: int) -> int:
    """``params.max_tokens``, or the room left in the context when it is ``None``; raises
    ``InvalidRequest`` (naming ``prompt`` or ``max_tokens``, code
    ``context_length_exceeded`` as OpenAI answers both) when the request cannot fit. A
    request that generates nothing (``max_tokens == 0``) may fill the whole context."""
    if params.max_tokens == 0 and num_prompt_tokens <= max_model_len:
        return 0
    if num_prompt_tokens >= max_model_len:
        raise InvalidRequest(
            "prompt", f"the prompt has {num_prompt_tokens} tokens but the model's context "
            f"is {max_model_len} tokens, leaving no room to generate", CONTEXT_LENGTH_EXCEEDED)
    room = max_model_len - num_prompt_tokens
    if params.max_tokens is None:
        return room
    if params.max_tokens > room:
        raise InvalidRequest(
            "max_tokens", f"max_tokens is {params.max_tokens} but the prompt has "
            f"{num_prompt_tokens} tokens and the context is {max_model_len}: at most {room} fit",
            CONTEXT_LENGTH_EXCEEDED)
    return params.max_tokens


@dataclass
class SeqUpdate:
    """What one sequence did in one step: the token it drew and whether it finished.

    ``token_id`` is ``None`` only in the one update of a choice that generates nothing
    (``max_tokens == 0``, finished with ``"length"``). ``prompt_logprobs`` comes once per
    request that asked for them, on the first update of its first choice, which precedes
    the first update of every other choice of the request (see ``Scheduler``)."""

    request_id: str
    index: int
    token_id: int | None
    logprobs: TokenLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int
    prompt_logprobs: PromptLogprobs | None = None


class EngineCore:
    """Owns the sequences of every live request; ``step()`` advances all of them.

    Fault isolation: an exception while admitting a sequence (a processor's
    ``add_request``), in a processor's ``apply`` / ``update``, in a stop hook, or in the
    model step fails only the requests it belongs to: their sequences finish with
    ``finish_reason="error"`` (KV blocks and slots freed) and ``take_failures()`` hands the
    ``RequestError`` of each to the caller. A row whose final logits are not finite fails
    its request the same way instead of emitting a token (an ``InvalidRequest`` naming the
    fields when the processors masked every token: the request's constraints conflict).

    A request whose processors have slow per-request work (``prepare_request``: a grammar
    compile) waits outside the scheduler until it is done; the others step meanwhile.
    """

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, limits: EngineLimits,
                 pipeline: ProcessorPipeline | None = None,
                 stop_hooks: Iterable[StopHook] = ()) -> None:
        """``pipeline`` is the runner's processor pipeline (the scheduler's ``on_admit`` /
        ``on_release`` go to ``admit`` / ``release``); ``stop_hooks`` are the enabled
        plugins' ``freetoken_check_stop`` implementations."""
        self.runner = runner
        self.scheduler = scheduler
        self.limits = limits
        self.pipeline = pipeline
        self._stop_hooks = tuple(stop_hooks)
        self._seqs: dict[str, list[Sequence]] = {}
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._admission_failures: list[tuple[Sequence, FreeTokenError]] = []
        self._failures: list[tuple[str, FreeTokenError]] = []
        self._preparing: dict[str, tuple[list[Sequence], dict[str, Future]]] = {}
        self.step_times = StepTimes()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._preparing)

    @property
    def num_requests(self) -> int:
        """Requests with at least one sequence not yet finished."""
        return len(self._seqs)

    def max_tokens_for(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The effective max_tokens; raises ``InvalidRequest`` when the request cannot fit."""
        return effective_max_tokens(num_prompt_tokens, params, self.limits.max_model_len)

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, is_chat: bool = False) -> None:
        """Queue a validated request (``params.fields`` set); raises ``InvalidRequest`` when
        it cannot fit, ``RequestError`` when a processor's ``prepare_request`` raises."""
        if request_id in self._seqs or request_id in self._preparing:
            raise InvalidRequest("request_id", f"request {request_id!r} is already running")
        if not prompt_token_ids:
            raise InvalidRequest("prompt", "the prompt is empty")
        vocab = self.limits.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidRequest("prompt", f"prompt token ids must be in [0, {vocab})")
        max_tokens = self.max_tokens_for(len(prompt_token_ids), params)
        base_seed = params.seed if params.seed is not None else secrets.randbits(63)
        arrival = next(self._arrivals)
        seqs = [
            Sequence(next(self._seq_ids), request_id, list(prompt_token_ids),
                     len(prompt_token_ids), params, choice_seed(base_seed, i), arrival,
                     max_tokens, index=i, is_chat=is_chat)
            for i in range(params.n)
        ]
        if params.prompt_logprobs is not None:
            seqs[0].prompt_logprobs = PromptLogprobs()  # the choices share the prompt
        futures = (self.pipeline.prepare_request(request_id, params, prompt_token_ids, is_chat)
                   if self.pipeline else {})
        if futures:
            self._preparing[request_id] = (seqs, futures)
            return
        self._schedule(request_id, seqs)

    def _schedule(self, request_id: str, seqs: list[Sequence]) -> None:
        for i, seq in enumerate(seqs):
            try:
                self.scheduler.add(seq)
            except ValueError as exc:  # cannot fit the cache (the length check prevents it)
                for queued in seqs[:i]:
                    self.scheduler.finish(queued, "abort")
                raise InvalidRequest("max_tokens", str(exc)) from None
        self._seqs[request_id] = seqs

    def _admit_prepared(self) -> None:
        """Schedule the requests whose ``prepare_request`` futures are all done; fail those
        where one raised. Waits a moment for one when nothing else can run."""
        if not self._preparing:
            return
        if not self.scheduler.has_unfinished:
            pending = [f for _, futures in self._preparing.values() for f in futures.values()]
            wait(pending, timeout=0.01, return_when=FIRST_COMPLETED)
        for request_id, (seqs, futures) in list(self._preparing.items()):
            if not all(f.done() for f in futures.values()):
                continue
            del self._preparing[request_id]
            prepared = {}
            try:
                for name, future in futures.items():
                    prepared[name] = _result(name, future)
                for seq in seqs:
                    seq.prepared = prepared
                self._schedule(request_id, seqs)
            except FreeTokenError as error:
                self._failures.append((request_id, error))

    def abort_request(self, request_id: str) -> None:
        """Finish every sequence of the request now and free their blocks."""
        preparing = self._preparing.pop(request_id, None)
        if preparing is not None:
            for future in preparing[1].values():
                future.cancel()
        for seq in self._seqs.pop(request_id, []):
            self.scheduler.finish(seq, "abort")

    def fail_request(self, request_id: str, error: FreeTokenError) -> None:
        """End every sequence of the request with ``finish_reason="error"``, free their
        blocks and slots, and queue ``error`` for ``take_failures()`` (once per request)."""
        seqs = self._seqs.pop(request_id, None)
        if seqs is None:
            seqs = (self._preparing.pop(request_id, None) or (None, None))[0]
            if seqs is not None:
                self._failures.append((request_id, error))
            return
        for seq in seqs:
            self.scheduler.finish(seq, "error")
        self._failures.append((request_id, error))

    def fail_all(self, error: RequestError) -> None:
        """Fail every live request (the engine loop's last resort after an unexpected
        exception)."""
        for request_id in [*self._seqs, *self._preparing]:
            self.fail_request(request_id, error)

    def take_failures(self) -> list[tuple[str, FreeTokenError]]:
        """``(request_id, error)`` of the requests failed since the last call."""
        failures, self._failures = self._failures, []
        return failures

    def admit(self, seq: Sequence) -> None:
        """The scheduler's ``on_admit``: build the sequence's processor state. A plugin that
        raises fails the request before the sequence computes anything."""
        if self.pipeline is None:
            return
        try:
            self.pipeline.add_request(seq.slot, seq)
        except FreeTokenError as error:
            self._admission_failures.append((seq, error))

    def release(self, seq: Sequence) -> None:
        """The scheduler's ``on_release``: drop the sequence's processor state."""
        if self.pipeline is not None:
            self.pipeline.remove_request(seq.slot)

    def stop_sequence(self, request_id: str, index: int, stop_reason: int | str | None) -> None:
        """End one choice because of a rule seen outside the core (a stop string)."""
        seqs = self._seqs.get(request_id)
        if seqs is None:
            return
        self.scheduler.finish(seqs[index], "stop", stop_reason)
        self._forget_if_done(request_id)

    def _forget_if_done(self, request_id: str) -> None:
        if all(s.is_finished for s in self._seqs.get(request_id, [])):
            self._seqs.pop(request_id, None)

    def step(self) -> list[SeqUpdate]:
        start = time.perf_counter()
        self._admit_prepared()
        batch = self._live(self.scheduler.schedule())
        if not batch:
            return []
        decode = all(n == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens
                     for seq, n in zip(batch.seqs, batch.num_new_tokens))
        try:
            return self._run(batch)
        finally:
            self.step_times.record(time.perf_counter() - start, decode)

    def _run(self, batch: ScheduledBatch) -> list[SeqUpdate]:
        try:
            result = self.runner.execute(batch)
        except CommunicationError:
            raise  # a broken tensor-parallel group: the engine process ends (process.py)
        except Exception as exc:  # fails this step's requests, not the engine
            log.error("the model step failed", exc_info=exc)
            error = RequestError("model", f"the model step failed: {type(exc).__name__}: {exc}")
            for seq in batch.seqs:
                self.fail_request(seq.request_id, error)
            self._fail_processor_slots()
            return []
        self.scheduler.advance(batch)
        for seq, scored in result.prompt_logprobs:
            if seq.prompt_logprobs is not None:
                seq.prompt_logprobs.extend(scored)
        self._fail_processor_slots()
        for seq, token in zip(result.seqs, result.output.token_ids):
            if token == NO_TOKEN:
                self._fail_no_token(seq)
            elif token == INVALID_TOKEN:
                self._fail_non_finite(seq)
        live = [(seq, token, logprobs) for seq, token, logprobs in zip(
            result.seqs, result.output.token_ids, result.output.logprobs)
            if not seq.is_finished]
        for seq, token, _ in live:
            seq.token_ids.append(token)
        plugin_stops = self._plugin_stops([s for s, _, _ in live], [t for _, t, _ in live])
        ended = (self.pipeline.accept_tokens([s.slot for s, _, _ in live],
                                             [t for _, t, _ in live])
                 if self.pipeline else set())
        self._fail_processor_slots()
        updates = [self._prefilled(seq) for seq in result.prefilled if not seq.is_finished]
        for row, (seq, token, logprobs) in enumerate(live):
            if seq.is_finished:
                continue  # failed by a stop hook or a processor
            if row in plugin_stops:
                self.scheduler.finish(seq, "stop", plugin_stops[row])
            elif seq.slot in ended:
                self.scheduler.finish(seq, "stop")
            else:
                self._check_stop(seq, token)
            updates.append(SeqUpdate(
                seq.request_id, seq.index, token, logprobs,
                seq.finish_reason, seq.stop_reason, seq.num_cached_tokens,
                _hand_off_prompt_logprobs(seq)))
            if seq.is_finished:
                self._forget_if_done(seq.request_id)
        return updates

    def _prefilled(self, seq: Sequence) -> SeqUpdate:
        """End a sequence that generates nothing, now that its prompt is computed."""
        self.scheduler.finish(seq, "length")
        update = SeqUpdate(seq.request_id, seq.index, None, None, seq.finish_reason,
                           seq.stop_reason, seq.num_cached_tokens,
                           _hand_off_prompt_logprobs(seq))
        self._forget_if_done(seq.request_id)
        return update

    def _live(self, batch: ScheduledBatch) -> ScheduledBatch:
        """``batch`` without the sequences whose admission failed (their requests fail)."""
        if not self._admission_failures:
            return batch
        for seq, error in self._admission_failures:
            self.fail_request(seq.request_id, error)
        self._admission_failures = []
        live = ScheduledBatch()
        for seq, num in zip(batch.seqs, batch.num_new_tokens):
            if not seq.is_finished:
                live.add(seq, num)
        live.num_preempted = batch.num_preempted
        return live

    def _fail_processor_slots(self) -> None:
        if self.pipeline is None:
            return
        failures = self.pipeline.take_failures()
        if not failures:
            return
        for seq in list(self.scheduler.running):
            error = failures.get(seq.slot) if seq.slot is not None else None
            if error is not None:
                self.fail_request(seq.request_id, error)

    def _fail_non_finite(self, seq: Sequence) -> None:
        names = self.pipeline.names_for(seq.slot) if self.pipeline and seq.slot is not None \
            else []
        cause = f" (logits processors on this request: {', '.join(names)})" if names else ""
        log.error("request %s: the logits became NaN or infinite%s", seq.request_id, cause)
        self.fail_request(seq.request_id, RequestError(
            "sampler", f"the logits of this request became NaN or infinite{cause}; no token "
                       "was sampled"))

    def _fail_no_token(self, seq: Sequence) -> None:
        """The processors masked every token of ``seq``'s row: a 400 naming their fields."""
        assert self.pipeline is not None and seq.slot is not None  # only processors mask
        self.fail_request(seq.request_id, self.pipeline.conflict_error(
            seq.slot, seq.params, seq.num_output_tokens))

    def _plugin_stops(self, seqs: list[Sequence], tokens: list[int]) -> dict[int, int | str]:
        """``{row: stop_reason}`` from the stop hooks; a hook that raises fails the
        requests of the rows it was given."""
        stops: dict[int, int | str] = {}
        for hook in self._stop_hooks:
            rows = [i for i, s in enumerate(seqs) if hook.plugin in s.params.fields]
            if not rows:
                continue
            try:
                result = hook.check([StopView(seqs[i].params, seqs[i].num_output_tokens,
                                              seqs[i].output_view(),
                                              seqs[i].params.fields[hook.plugin])
                                     for i in rows],
                                    [tokens[i] for i in rows])
            except Exception as exc:  # noqa: BLE001 (a plugin bug fails its requests only)
                error = plugin_failure(hook.plugin, "check_stop", exc)
                for i in rows:
                    self.fail_request(seqs[i].request_id, error)
                continue
            for view_row, reason in (result or {}).items():
                if 0 <= view_row < len(rows):
                    stops.setdefault(rows[view_row], reason)
        return stops

    def _check_stop(self, seq: Sequence, token: int) -> None:
        if not seq.params.ignore_eos and token in self.limits.eos_token_ids:
            self.scheduler.finish(seq, "stop")
        elif seq.num_output_tokens >= seq.max_tokens:
            self.scheduler.finish(seq, "length")


def _hand_off_prompt_logprobs(seq: Sequence) -> PromptLogprobs | None:
    """``seq``'s prompt logprobs once its whole prompt is scored (then it keeps none, so a
    later recompute scores nothing and may use the prefix cache); ``None`` before that and
    for a sequence that collects none."""
    scored = seq.prompt_logprobs
    if scored is None or seq.num_computed_tokens < seq.num_prompt_tokens:
        return None
    seq.prompt_logprobs = None
    return scored


def _result(name: str, future: Future) -> object:
    """A ``prepare_request`` future's result; its exception as a ``FreeTokenError``."""
    try:
        return future.result()
    except FreeTokenError:
        raise
    except Exception as exc:
        raise plugin_failure(name, "prepare_request", exc) from exc
