"""no_repeat_ngram_size: never repeat an n-gram (prompt included), as transformers does."""

from __future__ import annotations

from typing import Annotated

import msgspec
import torch

from freetoken_core import LogitsProcessor, RequestFields, RequestView

MAX_SIZE = 32
BENCH_PARAMS = {"no_repeat_ngram_size": 3}  # for `freetoken bench plugin no_repeat_ngram`


class NoRepeatNGram(LogitsProcessor):
    """no_repeat_ngram_size: never repeat an n-gram of this many tokens (prompt included)."""

    class Fields(RequestFields):
        no_repeat_ngram_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_SIZE)] | None = None

    reads_history = True  # the engine keeps every slot's tokens in self.history

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.size = torch.zeros(ctx.max_num_slots, dtype=torch.long, device=ctx.device)
        self.sizes: dict[int, int] = {}  # on the host: the longest n-gram in use

    def add_request(self, slot: int, request: RequestView) -> None:
        self.size[slot] = self.sizes[slot] = request.fields.no_repeat_ngram_size

    def remove_request(self, slot: int) -> None:
        self.size[slot] = 0
        del self.sizes[slot]

    def apply(self, logits: torch.Tensor, slots: torch.Tensor) -> None:
        tokens, length = self.history.window(slots)  # [rows, width], [rows]
        n, length = self.size[slots].unsqueeze(1), length.unsqueeze(1)
        at = torch.arange(tokens.shape[1], device=tokens.device)
        # Ban the token at position j when the n - 1 tokens before j end the history too.
        banned = (n > 0) & (at >= n - 1) & (at < length)
        for k in range(1, max(self.sizes.values())):
            last = tokens.gather(1, (length - k).clamp(min=0))
            banned &= (tokens.roll(k, dims=1) == last) | (k >= n)
        bans = torch.zeros(banned.shape, device=logits.device).masked_fill_(banned, -torch.inf)
        logits.scatter_add_(1, tokens, bans)
