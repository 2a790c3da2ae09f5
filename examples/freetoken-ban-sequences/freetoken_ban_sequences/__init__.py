"""freetoken-ban-sequences: an example FreeToken plugin that bans token sequences.

Request field ``ban_token_sequences``: a list of token-id sequences, e.g.
``[[42], [7, 8, 9]]``, at most ``MAX_SEQUENCES`` of them, each of 1 to ``MAX_LEN`` ids in
``[0, vocab_size)``. A one-token sequence is banned everywhere. For a longer one, whenever
the row's last ``len(seq) - 1`` tokens (prompt and generated alike) equal the sequence
without its last token, that last token's logit is set to -inf, so the model can never
complete the sequence (the meaning of transformers' ``NoBadWordsLogitsProcessor``).

State, preallocated on the device for S slots (independent of the vocabulary):

- ``prefix`` [S, MAX_SEQUENCES, MAX_LEN - 1] int64: each sequence minus its last token,
  right-aligned, ``PAD`` in front (a ``PAD`` position matches anything);
- ``last`` [S, MAX_SEQUENCES] int64: the token to ban when the prefix matches;
- ``active`` [S, MAX_SEQUENCES] bool: which entries hold a sequence;
- ``history`` [S, MAX_LEN - 1] int64: the row's last tokens, ``PAD`` before the first.

That is S × 2,136 bytes with the limits below. ``apply`` compares every slot's prefixes
with its history at once and adds -inf (or 0) at the ``last`` ids with one
``scatter_add_``, touching only ``MAX_SEQUENCES`` logits per row. This example has a torch
path only, which runs on any device, CUDA included; the built-in plugins show how to add a
Triton kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from freetoken_core import InvalidRequest, hookimpl
from freetoken_core.processors import LogitsProcessor, ModelInfo, Stage

FIELD = "ban_token_sequences"
MAX_SEQUENCES = 32
MAX_LEN = 8
PAD = -1

# A typical request, for `freetoken bench plugin ban_sequences`.
BENCH_PARAMS = {FIELD: [[7]] + [[100 + i, 200 + i, 300 + i] for i in range(15)]}


def check_sequences(value: Any, model: ModelInfo) -> list[list[int]]:
    """The field's value as a list of lists of ints, or ``InvalidRequest`` naming it."""

    def fail(message: str) -> InvalidRequest:
        return InvalidRequest(FIELD, f"{FIELD} {message}")

    if not isinstance(value, (list, tuple)):
        raise fail("must be a list of token-id lists")
    if len(value) > MAX_SEQUENCES:
        raise fail(f"holds at most {MAX_SEQUENCES} sequences")
    for seq in value:
        if not isinstance(seq, (list, tuple)) or not 1 <= len(seq) <= MAX_LEN:
            raise fail(f"entries must be lists of 1 to {MAX_LEN} token ids")
        for t in seq:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < model.vocab_size:
                raise fail(f"token ids must be integers in [0, {model.vocab_size}), got {t!r}")
    return [list(seq) for seq in value]


class BanSequences(LogitsProcessor):
    """Sets the last token of a banned sequence to -inf when its prefix was just produced."""

    name = "ban_sequences"
    stage = Stage.PRE_TEMPERATURE
    fields = (FIELD,)

    def __init__(self, max_num_slots: int, model: ModelInfo, device: torch.device) -> None:
        super().__init__(max_num_slots, model, device)
        s, n, k = max_num_slots, MAX_SEQUENCES, MAX_LEN - 1
        self.prefix = torch.full((s, n, k), PAD, dtype=torch.long, device=device)
        self.last = torch.zeros((s, n), dtype=torch.long, device=device)
        self.active = torch.zeros((s, n), dtype=torch.bool, device=device)
        self.history = torch.full((s, k), PAD, dtype=torch.long, device=device)

    @classmethod
    def uses(cls, params: Any) -> bool:
        return bool(params.extra.get(FIELD))

    @classmethod
    def validate(cls, params: Any, model: ModelInfo) -> None:
        check_sequences(params.extra.get(FIELD, []), model)

    def add_request(self, slot: int, params: Any, prompt_token_ids: list[int],
                    output_token_ids: list[int]) -> None:
        k = MAX_LEN - 1
        seqs = params.extra[FIELD]
        prefix = [[PAD] * (k - len(s) + 1) + list(s[:-1]) for s in seqs]
        prefix += [[PAD] * k] * (MAX_SEQUENCES - len(seqs))
        last = [s[-1] for s in seqs] + [0] * (MAX_SEQUENCES - len(seqs))
        seen = (list(prompt_token_ids[-k:]) + list(output_token_ids))[-k:]
        # One host-to-device copy per tensor, once per request; never per step.
        self.prefix[slot] = torch.tensor(prefix, dtype=torch.long, device=self.device)
        self.last[slot] = torch.tensor(last, dtype=torch.long, device=self.device)
        self.active[slot] = torch.arange(MAX_SEQUENCES, device=self.device) < len(seqs)
        self.history[slot] = torch.tensor([PAD] * (k - len(seen)) + seen, dtype=torch.long,
                                          device=self.device)

    def remove_request(self, slot: int) -> None:
        self.active[slot] = False

    def update(self, slots: torch.Tensor, sampled: torch.Tensor) -> None:
        # Shift each row's window left by one and append its new token, on the device.
        shifted = torch.cat([self.history[slots, 1:], sampled.unsqueeze(1)], dim=1)
        self.history[slots] = shifted

    def apply(self, logits: torch.Tensor, slots: torch.Tensor) -> None:
        prefix = self.prefix[slots]  # [B, N, K]
        seen = self.history[slots].unsqueeze(1)  # [B, 1, K]
        matched = ((prefix == seen) | (prefix == PAD)).all(dim=-1) & self.active[slots]
        # -inf where a sequence would be completed, 0 elsewhere: rows and entries that do
        # not match come out unchanged, and duplicate ids add up the same in any order.
        penalty = torch.zeros(matched.shape, dtype=logits.dtype, device=logits.device)
        logits.scatter_add_(1, self.last[slots], penalty.masked_fill_(matched, float("-inf")))


@hookimpl
def freetoken_request_fields() -> list[str]:
    return [FIELD]


@hookimpl
def freetoken_register_processors(register: Callable[[type[LogitsProcessor]], None]) -> None:
    register(BanSequences)


@hookimpl
def freetoken_validate_request(request: Any, model: ModelInfo) -> None:
    value = request.extra.get(FIELD)
    if value is not None:
        request.extra[FIELD] = check_sequences(value, model)
