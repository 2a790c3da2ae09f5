"""freetoken-ban-sequences: an example FreeToken plugin that bans token sequences.

The whole plugin is one class, ``BanSequences``, named by its entry point (see
``pyproject.toml``): its ``Fields`` declare the request field and its type, ``validate``
checks what the type cannot, and the rest is the logits-processor contract of
``freetoken_core.processors``.

Request field ``ban_token_sequences``: a list of token-id sequences, e.g.
``[[42], [7, 8, 9]]``, at most ``MAX_SEQUENCES`` of them, each of 1 to ``MAX_LEN`` ids in
``[0, vocab_size)`` (the type checks all but the upper bound; ``validate`` checks that).
An empty list, or ``null``, asks for nothing and costs nothing. A one-token sequence is
banned everywhere. For a longer one, whenever the row's last ``len(seq) - 1`` tokens
(prompt and generated alike) equal the sequence without its last token, that last token's
logit is set to -inf, so the model can never complete the sequence (the meaning of
transformers' ``NoBadWordsLogitsProcessor``).

The row's tokens come from the engine: ``reads_history = True`` makes the engine keep
every slot's prompt and generated tokens on the device (``self.history``), so the plugin
keeps no copy of them and needs no ``update``. Its own state, preallocated on the device
for S slots (independent of the vocabulary):

- ``prefix`` [S, MAX_SEQUENCES, MAX_LEN - 1] int64: each sequence minus its last token,
  right-aligned, ``PAD`` in front (a ``PAD`` position matches anything);
- ``last`` [S, MAX_SEQUENCES] int64: the token to ban when the prefix matches;
- ``active`` [S, MAX_SEQUENCES] bool: which entries hold a sequence.

That is S × 2,080 bytes with the limits below. ``apply`` takes each row's last
``MAX_LEN - 1`` tokens from the history (``PAD`` before the first), compares every slot's
prefixes with them at once and adds -inf (or 0) at the ``last`` ids with one
``scatter_add_``, touching only ``MAX_SEQUENCES`` logits per row. This example has a torch
path only, which runs on any device, CUDA included; the built-in plugins show how to add a
Triton kernel.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import torch

from freetoken_core import InvalidRequest
from freetoken_core.processors import (
    LogitsProcessor,
    ModelInfo,
    ProcessorContext,
    RequestFields,
    RequestView,
    Stage,
)

FIELD = "ban_token_sequences"
MAX_SEQUENCES = 32
MAX_LEN = 8
PAD = -1

# A typical request, for `freetoken bench plugin ban_sequences` (the bench reads it from
# the module that defines the plugin's class).
BENCH_PARAMS: dict[str, Any] = {FIELD: [[7]] + [[100 + i, 200 + i, 300 + i] for i in range(15)]}

TokenId = Annotated[int, msgspec.Meta(ge=0)]
BannedSequence = Annotated[list[TokenId], msgspec.Meta(min_length=1, max_length=MAX_LEN)]


class BanSequences(LogitsProcessor):
    """ban_token_sequences: never complete a banned token sequence."""

    class Fields(RequestFields):
        ban_token_sequences: Annotated[list[BannedSequence], msgspec.Meta(
            max_length=MAX_SEQUENCES)] | None = None

    stage = Stage.PRE_TEMPERATURE
    reads_history = True  # the engine keeps each slot's tokens in self.history

    def __init__(self, ctx: ProcessorContext) -> None:
        super().__init__(ctx)
        s, n, k = ctx.max_num_slots, MAX_SEQUENCES, MAX_LEN - 1
        self.prefix = torch.full((s, n, k), PAD, dtype=torch.long, device=ctx.device)
        self.last = torch.zeros((s, n), dtype=torch.long, device=ctx.device)
        self.active = torch.zeros((s, n), dtype=torch.bool, device=ctx.device)

    @classmethod
    def uses(cls, fields: Fields) -> bool:
        return bool(fields.ban_token_sequences)

    @classmethod
    def validate(cls, fields: Fields, model: ModelInfo, params: Any) -> Fields:
        for seq in fields.ban_token_sequences or []:
            for t in seq:
                if t >= model.vocab_size:
                    raise InvalidRequest(FIELD, f"{FIELD} token ids must be in "
                                                f"[0, {model.vocab_size}), got {t}")
        return fields

    def add_request(self, slot: int, request: RequestView) -> None:
        k = MAX_LEN - 1
        seqs = request.fields.ban_token_sequences
        prefix = [[PAD] * (k - len(s) + 1) + list(s[:-1]) for s in seqs]
        prefix += [[PAD] * k] * (MAX_SEQUENCES - len(seqs))
        last = [s[-1] for s in seqs] + [0] * (MAX_SEQUENCES - len(seqs))
        # One host-to-device copy per tensor, once per request; never per step.
        self.prefix[slot] = torch.tensor(prefix, dtype=torch.long, device=self.device)
        self.last[slot] = torch.tensor(last, dtype=torch.long, device=self.device)
        self.active[slot] = torch.arange(MAX_SEQUENCES, device=self.device) < len(seqs)

    def remove_request(self, slot: int) -> None:
        self.active[slot] = False

    def apply(self, logits: torch.Tensor, slots: torch.Tensor) -> None:
        tokens, length = self.history.window(slots)  # prompt + generated, [B, width], [B]
        # The last K tokens of each row, PAD before its first token.
        at = length.unsqueeze(1) - (MAX_LEN - 1) + torch.arange(MAX_LEN - 1,
                                                                device=tokens.device)
        seen = torch.where(at >= 0, tokens.gather(1, at.clamp(min=0)), PAD).unsqueeze(1)
        prefix = self.prefix[slots]  # [B, N, K]
        matched = ((prefix == seen) | (prefix == PAD)).all(dim=-1) & self.active[slots]
        # -inf where a sequence would be completed, 0 elsewhere: rows and entries that do
        # not match come out unchanged, and duplicate ids add up the same in any order.
        penalty = torch.zeros(matched.shape, dtype=logits.dtype, device=logits.device)
        logits.scatter_add_(1, self.last[slots], penalty.masked_fill_(matched, float("-inf")))
