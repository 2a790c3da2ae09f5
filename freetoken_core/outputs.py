"""What generation returns, in the shape vLLM users know."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

INVALID_TOKEN = -1
"""The token a sampler row gives when its final logits had no finite maximum (a NaN or
``+inf`` among them): the row drew nothing, and its request fails."""
NO_TOKEN = -2
"""The token a sampler row gives when the processors left it no token at all (every logit
``-inf``: the request's constraints conflict)."""


@dataclass
class TokenLogprobs:
    """Log-probability of the sampled token and the ``len(top)`` most likely tokens."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class PromptLogprobs:
    """A prompt's logprobs as the engine computes them, in columns: entry ``i`` is for prompt
    token ``i + 1`` given the tokens before it (the first prompt token has none). Each entry
    holds that token's log-probability, its rank in the vocabulary (1 is the most likely;
    tokens tied with it do not push it down), and the ``N`` most likely tokens at that
    position (``SamplingParams.prompt_logprobs``), most likely first, with their
    log-probabilities. Log-probabilities are of the model's raw distribution, in float32.
    """

    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.logprobs)

    def extend(self, other: PromptLogprobs) -> None:
        """Append ``other``'s entries (those of the next prompt positions)."""
        self.logprobs.extend(other.logprobs)
        self.ranks.extend(other.ranks)
        self.top_ids.extend(other.top_ids)
        self.top_logprobs.extend(other.top_logprobs)


@dataclass
class Logprob:
    """One token's log-probability at one prompt position, as vLLM's ``Logprob``: its
    ``rank`` in the vocabulary (1 is the most likely) and its text decoded alone."""

    logprob: float
    rank: int
    decoded_token: str


def prompt_logprob_dicts(prompt_token_ids: list[int], entries: PromptLogprobs,
                         decode: Callable[[int], str], num_top: int | None = None
                         ) -> list[dict[int, Logprob] | None]:
    """``entries`` in vLLM's shape: ``None`` for the first prompt token, then per prompt token
    a dict holding that token and the ``num_top`` (default: all computed) most likely
    tokens at its position, by token id; ``decode`` gives a token's text."""
    out: list[dict[int, Logprob] | None] = [None]
    for token, logprob, rank, ids, values in zip(
            prompt_token_ids[1:], entries.logprobs, entries.ranks, entries.top_ids,
            entries.top_logprobs):
        entry = {token: Logprob(logprob, rank, decode(token))}
        for top_rank, (top_id, value) in enumerate(zip(ids[:num_top], values[:num_top]), 1):
            entry.setdefault(top_id, Logprob(value, top_rank, decode(top_id)))
        out.append(entry)
    return out


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
    inside the engine (its unfinished choices then have ``finish_reason="error"``).
    ``prompt_logprobs`` (when ``SamplingParams.prompt_logprobs`` asked for them, once the
    prompt is computed) is in vLLM's shape: see ``prompt_logprob_dicts``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    num_cached_tokens: int
    outputs: list[CompletionOutput]
    error: str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)
