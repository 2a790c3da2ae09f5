"""What generation returns, in the shape vLLM users know."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    """Log-probability of the sampled token and the ``len(top)`` most likely tokens."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class CompletionOutput:
    """One choice: its text so far, token ids, and (when finished) why it stopped.

    ``stop_reason`` is the stop string or token id that ended it (``None`` for EOS or
    length). ``logprobs`` has one entry per token when the request asked for them.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state: its prompt, the number of prompt tokens served from the prefix
    cache, and one ``CompletionOutput`` per choice. ``error`` says why the request failed
    inside the engine (its unfinished choices then have ``finish_reason="error"``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    num_cached_tokens: int
    outputs: list[CompletionOutput]
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)
