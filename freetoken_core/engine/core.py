"""The engine core: requests in, one scheduling step at a time, token updates out.

It runs the scheduler, the model runner and the token-level stop rules (EOS, max_tokens,
context length). Text (detokenization, stop strings) is the caller's business: the
in-process ``LLMEngine`` and, under ``freetoken serve``, the HTTP side.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from freetoken_core.config import EngineLimits
from freetoken_core.engine.model_runner import ModelRunner
from freetoken_core.engine.sampler import TokenLogprobs
from freetoken_core.engine.scheduler import Scheduler
from freetoken_core.engine.sequence import Sequence
from freetoken_core.errors import CONTEXT_LENGTH_EXCEEDED, InvalidRequest
from freetoken_core.processors import StopView
from freetoken_core.sampling_params import SamplingParams

StopChecker = Callable[[list[StopView], list[int]], list[dict[int, int | str] | None]]

_SEED_MASK = (1 << 63) - 1


def choice_seed(seed: int, index: int) -> int:
    """Seed of choice ``index`` of a request seeded with ``seed`` (choice 0 keeps it)."""
    if index == 0:
        return seed & _SEED_MASK
    return (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) & _SEED_MASK


def effective_max_tokens(num_prompt_tokens: int, params: SamplingParams,
                         max_model_len: int) -> int:
    """``params.max_tokens``, or the room left in the context when it is ``None``; raises
    ``InvalidRequest`` (naming ``prompt`` or ``max_tokens``, code
    ``context_length_exceeded`` as OpenAI answers both) when the request cannot fit."""
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
    """What one sequence did in one step: the token it drew and whether it finished."""

    request_id: str
    index: int
    token_id: int
    logprobs: TokenLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int


class EngineCore:
    """Owns the sequences of every live request; ``step()`` advances all of them."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, limits: EngineLimits,
                 check_stop: StopChecker | None = None,
                 stop_fields: frozenset[str] = frozenset()) -> None:
        """``check_stop`` is the plugins' ``freetoken_check_stop`` hook; it runs only for
        the rows whose request uses one of ``stop_fields``."""
        self.runner = runner
        self.scheduler = scheduler
        self.limits = limits
        self._check_stop_hook = check_stop
        self._stop_fields = stop_fields
        self._seqs: dict[str, list[Sequence]] = {}
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    @property
    def num_requests(self) -> int:
        """Requests with at least one sequence not yet finished."""
        return len(self._seqs)

    def max_tokens_for(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The effective max_tokens; raises ``InvalidRequest`` when the request cannot fit."""
        return effective_max_tokens(num_prompt_tokens, params, self.limits.max_model_len)

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        if request_id in self._seqs:
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
                     max_tokens, index=i)
            for i in range(params.n)
        ]
        self._seqs[request_id] = seqs
        for seq in seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Finish every sequence of the request now and free their blocks."""
        for seq in self._seqs.pop(request_id, []):
            self.scheduler.finish(seq, "abort")

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
        batch = self.scheduler.schedule()
        if not batch:
            return []
        result = self.runner.execute(batch)
        self.scheduler.advance(batch)
        for seq, token in zip(result.seqs, result.output.token_ids):
            seq.token_ids.append(token)
        plugin_stops = self._plugin_stops(result.seqs, result.output.token_ids)
        updates = []
        for row, (seq, token, logprobs) in enumerate(zip(
                result.seqs, result.output.token_ids, result.output.logprobs)):
            if row in plugin_stops:
                self.scheduler.finish(seq, "stop", plugin_stops[row])
            else:
                self._check_stop(seq, token)
            updates.append(SeqUpdate(
                seq.request_id, seq.index, token, logprobs,
                seq.finish_reason, seq.stop_reason, seq.num_cached_tokens))
            if seq.is_finished:
                self._forget_if_done(seq.request_id)
        return updates

    def _plugin_stops(self, seqs: list[Sequence], tokens: list[int]) -> dict[int, int | str]:
        if self._check_stop_hook is None:
            return {}
        rows = [i for i, s in enumerate(seqs) if not self._stop_fields.isdisjoint(s.params.extra)]
        if not rows:
            return {}
        views = [StopView.of(seqs[i]) for i in rows]
        stops: dict[int, int | str] = {}
        for result in self._check_stop_hook(views, [tokens[i] for i in rows]):
            for view_row, reason in (result or {}).items():
                stops.setdefault(rows[view_row], reason)
        return stops

    def _check_stop(self, seq: Sequence, token: int) -> None:
        if not seq.params.ignore_eos and token in self.limits.eos_token_ids:
            self.scheduler.finish(seq, "stop")
        elif seq.num_output_tokens >= seq.max_tokens:
            self.scheduler.finish(seq, "length")
