"""One HTTP request's run through the engine: every prompt × ``n`` choices, detokenized,
stop strings matched and logprobs gathered here in the server process."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from freetoken_core.engine.client import EngineClient
from freetoken_core.engine.output_processor import ChoiceText, StopMatcher
from freetoken_core.outputs import PromptLogprobs
from freetoken_core.sampling_params import SamplingParams
from freetoken_core.server.protocol import PromptTokensDetails, Usage

LogprobEntry = tuple[int, float | None, list[tuple[int, float]] | None]
"""``(token_id, logprob, [(alternative_id, logprob), ...])`` of one token; ``logprob`` and
the alternatives are ``None`` only for the first token of an echoed prompt."""


@dataclass
class ChoiceDelta:
    """New text of one choice; ``finish_reason`` is set exactly once per choice.
    ``logprobs`` holds the entries of the tokens that arrived since the choice's previous
    delta (``None`` when the request did not ask for logprobs)."""

    index: int
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[LogprobEntry] | None = None


@dataclass
class _Choice:
    text: ChoiceText
    num_tokens: int = 0
    num_sent: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[LogprobEntry] = field(default_factory=list)
    num_logprobs_sent: int = 0
    token_ids: list[int] = field(default_factory=list)


@dataclass
class Generation:
    """One HTTP request's run: every prompt × ``n`` choices, submitted together.

    Choice ``index`` is ``prompt_index * n + choice``. Iterate ``deltas()`` once; when it
    ends normally every choice has its finish reason and ``usage()`` is final. However it
    ends (finished, failed, or closed because the client went away), ``on_done(self)``
    runs once, with ``error`` set if the engine raised.

    It is the ``output`` that ``freetoken_decorate_response`` receives: plugins read
    ``tokenizer``, ``prompts``, ``params`` and ``token_ids(index)``, and may keep
    per-request state in ``plugin_state`` under their own name.
    """

    client: EngineClient
    tokenizer: Any
    prompts: list[list[int]]
    params: SamplingParams
    on_done: Callable[[Generation], None] | None = None
    is_chat: bool = False
    """The prompts came from the chat route (processors may treat chat answers apart)."""
    matcher: StopMatcher | None = None
    """The automaton over ``params.stop`` (built here when not given; the server builds it
    in a worker thread, since a large stop set takes a while)."""
    request_id: str = field(default_factory=lambda: secrets.token_hex(12))
    started: float = field(default_factory=time.monotonic)
    error: BaseException | None = None
    plugin_state: dict[str, Any] = field(default_factory=dict)
    _choices: list[list[_Choice]] = field(init=False)
    _num_cached: list[int] = field(init=False)
    _prompt_logprobs: list[PromptLogprobs | None] = field(init=False)

    def __post_init__(self) -> None:
        if self.matcher is None:
            self.matcher = StopMatcher(self.params.stop)
        matcher = self.matcher  # one automaton for every choice
        self._choices = [[_Choice(ChoiceText(self.tokenizer, ids, self.params, matcher))
                          for _ in range(self.params.n)] for ids in self.prompts]
        self._num_cached = [0] * len(self.prompts)
        self._prompt_logprobs = [None] * len(self.prompts)

    def _engine_id(self, prompt_index: int) -> str:
        return f"{self.request_id}-{prompt_index}"

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Text deltas as tokens arrive; stops the engine's choice when a stop string hits.
        With logprobs every token yields a delta (its text may be empty while a stop
        string could still start there)."""
        index_of = {self._engine_id(i): i for i in range(len(self.prompts))}
        num_open = len(self.prompts) * self.params.n
        wants_logprobs = self.params.logprobs is not None
        updates = self.client.generate(
            [(self._engine_id(i), ids) for i, ids in enumerate(self.prompts)], self.params,
            self.is_chat)
        try:
            async for update in updates:
                p = index_of[update.request_id]
                if update.prompt_logprobs is not None:
                    self._prompt_logprobs[p] = update.prompt_logprobs
                choice = self._choices[p][update.index]
                if choice.finish_reason is not None:
                    continue  # a token drawn before the engine saw our stop_sequence
                self._num_cached[p] = max(self._num_cached[p], update.num_cached_tokens)
                matched = None
                if update.token_id is not None:  # None: the choice generates nothing
                    choice.num_tokens += 1
                    choice.token_ids.append(update.token_id)
                    if wants_logprobs and update.logprob is not None:
                        choice.logprobs.append((update.token_id, update.logprob,
                                                [tuple(t) for t in update.top_logprobs or []]))
                    matched = choice.text.add(update.token_id,
                                              update.finish_reason is not None)
                if matched is not None:
                    choice.finish_reason, choice.stop_reason = "stop", matched
                    if update.finish_reason is None:
                        self.client.stop_sequence(update.request_id, update.index, matched)
                elif update.finish_reason is not None:
                    choice.finish_reason = update.finish_reason
                    choice.stop_reason = update.stop_reason
                new_text = choice.text.released[choice.num_sent:]
                choice.num_sent = len(choice.text.released)
                new_logprobs = choice.logprobs[choice.num_logprobs_sent:]
                choice.num_logprobs_sent = len(choice.logprobs)
                if choice.finish_reason is not None:
                    num_open -= 1
                if new_text or new_logprobs or choice.finish_reason is not None:
                    yield ChoiceDelta(p * self.params.n + update.index, new_text,
                                      choice.finish_reason, choice.stop_reason,
                                      new_logprobs if wants_logprobs else None)
                if num_open == 0:
                    break
        except Exception as exc:
            self.error = exc
            raise
        finally:
            try:
                await updates.aclose()
            finally:
                if self.on_done is not None:
                    self.on_done(self)

    def prompt_logprobs(self, prompt_index: int) -> PromptLogprobs | None:
        """The engine's logprobs of prompt ``prompt_index`` when ``params.prompt_logprobs``
        asked for them: set by the first update of the prompt's first choice, so before any
        delta of any of the prompt's choices is yielded."""
        return self._prompt_logprobs[prompt_index]

    def token_ids(self, index: int) -> list[int]:
        """The tokens choice ``index`` generated so far (the caller must not change them)."""
        return self._choices[index // self.params.n][index % self.params.n].token_ids

    def texts(self) -> list[str]:
        return [c.text.released for choices in self._choices for c in choices]

    def logprobs(self) -> list[list[LogprobEntry] | None]:
        """Every choice's entries, or ``None`` each when logprobs were not asked for."""
        wants = self.params.logprobs is not None
        return [c.logprobs if wants else None for choices in self._choices for c in choices]

    def finishes(self) -> list[tuple[str | None, int | str | None]]:
        return [(c.finish_reason, c.stop_reason) for choices in self._choices for c in choices]

    def usage(self, cls: type[Usage] = Usage) -> Usage:
        """Prompts counted once each (not per choice); completions summed over choices;
        ``cls`` is the server's ``Usage`` type (plugin fields included)."""
        num_prompt = sum(len(ids) for ids in self.prompts)
        num_completion = sum(c.num_tokens for choices in self._choices for c in choices)
        return cls(num_prompt, num_completion, num_prompt + num_completion,
                     PromptTokensDetails(sum(self._num_cached)))
