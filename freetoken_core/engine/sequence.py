"""One sequence (one choice of one request) as the scheduler and the runner see it."""

from __future__ import annotations

import enum
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from freetoken_core.outputs import PromptLogprobs
from freetoken_core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from freetoken_core.engine.block_manager import BlockKey


class TokenSlice(SequenceABC):
    """A read-only view of ``tokens[start:]`` that copies nothing until sliced."""

    __slots__ = ("_start", "_tokens")

    def __init__(self, tokens: list[int], start: int) -> None:
        self._tokens = tokens
        self._start = start

    def __len__(self) -> int:
        return len(self._tokens) - self._start

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return self._tokens[self._start:][index]
        return self._tokens[self._start + range(len(self))[index]]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Token state of one generation.

    ``token_ids`` holds prompt + generated tokens. ``num_computed_tokens`` counts the leading
    tokens whose KV is in the cache; the scheduler advances it after each step. A preempted
    sequence drops its blocks and sets it back to 0 (recompute). ``block_table`` lists the KV
    blocks in order and ``block_keys`` the prefix-cache keys of the content of its leading
    full blocks (a key may name another block holding the same tokens); both are owned by
    the block manager. ``params.cache_salt`` keys the prefix cache apart for this request.

    ``prompt_logprobs`` collects the prompt's logprobs while the prompt is computed, on the
    first choice of a request that asked for them (``None`` otherwise, and once the engine
    handed them on). Its length is the number of prompt positions already scored, so a
    recompute after preemption scores only the rest, and the prefix cache never serves a
    position still to be scored (``num_cacheable_tokens``).
    """

    seq_id: int
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    arrival: int
    max_tokens: int
    index: int = 0
    slot: int | None = None
    """Row of the per-sequence state of logits processors, held while running."""
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_keys: list[BlockKey] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    is_chat: bool = False
    """The prompt came from the chat route (processors may treat chat answers apart)."""
    prepared: dict[str, Any] = field(default_factory=dict)
    """Results of the processors' ``prepare_request``, by processor name."""
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def output_view(self) -> TokenSlice:
        """The generated tokens without a copy (a stop hook reads them every step)."""
        return TokenSlice(self.token_ids, self.num_prompt_tokens)

    @property
    def num_cacheable_tokens(self) -> int:
        """Leading tokens the prefix cache may serve: never the last one (it is computed to
        sample the next token), nor a prompt position whose logprob is still to be scored
        (its hidden state is needed)."""
        if self.prompt_logprobs is None:
            return self.num_tokens - 1
        return min(self.num_tokens - 1, len(self.prompt_logprobs))

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
