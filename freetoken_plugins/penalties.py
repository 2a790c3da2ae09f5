"""The penalties plugin: repetition (Hugging Face / CTRL), presence and frequency (OpenAI).

Request fields (``Penalties.Fields``, typed and bounded, so that the server refuses any
other value with a 400 naming the field; absent or neutral: off):

- ``repetition_penalty``: a number in ``[MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY]``
  = ``[0.01, 100]``, neutral ``1.0``. Over the prompt **and** the generated tokens, each
  distinct token once: a logit ``x < 0`` becomes ``x * r``, any other ``x / r``. Same as
  vLLM and Hugging Face's ``RepetitionPenaltyLogitsProcessor``. The bounds keep logits
  finite: a penalty scales a logit by at most 100 (vLLM's "> 0" lets ``r = 1e-39`` turn
  every logit into ``inf`` and the softmax into NaN).
- ``presence_penalty``: a number in ``[-2, 2]``, neutral ``0``. Over the generated tokens
  only: ``presence_penalty`` is subtracted once from every token generated at least once.
- ``frequency_penalty``: a number in ``[-2, 2]``, neutral ``0``. Over the generated tokens
  only: ``frequency_penalty * count`` is subtracted, ``count`` being how many times the
  token was generated.

Processor ``penalties``: stage ``PENALTIES``, not argmax-invariant; it applies the three in
the order repetition → presence → frequency, in float32:
``x = x * r if x < 0 else x / r; x -= p if count > 0 else 0; x -= f * count``.

State: the prompt and generated tokens are the engine's token history
(``ProcessorContext.history``, ``freetoken_core.history``: ``token_ids`` [S, L] int32 with
``lengths``, ``L`` = ``max_model_len``), which the processor reads (``reads_history``) and
never copies. Its own state, per slot (``S`` slots), is aligned with the history's
positions:

==============  ========================  ================================================
tensor          shape, dtype              holds
==============  ========================  ================================================
``counts``      [S, L] int16 or int32     at a token's first position in the history, how
                                          many times it was generated (0: prompt only);
                                          ``-1`` at every later position of the same token
                                          and past the slot's length;
                                          int16 when ``max_model_len <= 32768``
``is_active``   [S] bool                  the slot's request uses the processor
``penalties``   [S, 3] float32            repetition, presence, frequency (neutral 1, 0, 0)
==============  ========================  ================================================

Size: ``S * L * c + 13 * S`` bytes, ``c`` = 2 (int16 counts) or 4, beside the shared
history's ``4 * S * L``. At 256 slots and max_model_len 32,768 (the default KV-cache cap):
16 MiB (+ 32 MiB of history; the copy this plugin used to keep held 48 MiB). It grows
linearly with ``max_model_len``; lower ``max_num_seqs`` or ``max_model_len`` to bound it.

``add_request`` builds a slot's counts once (``torch.unique`` of prompt + output on the
host, one copy to the device) and ``remove_request`` marks the slot inactive. ``update``
runs after the engine appended the drawn token to the history: it looks the token up among
the slot's earlier first positions; found, that count goes up and the new position gets
``-1``; not found, the new position is a first one with count 1. ``apply`` touches only
the tokens of the row's history: gather the logits at its first positions, penalise,
scatter back (later positions are redirected to position 0, which is always a first one,
so every written token gets one well-defined value). It never reads or writes the other
entries of the vocabulary, so it costs ``O(rows * history length)``.

No device→host sync: the history's host-side ``width`` bounds every slot's length, and the
torch path and the Triton grid only cover that many positions. On CUDA ``apply`` and
``update`` are one Triton launch each (``penalties_apply_triton``,
``penalties_update_triton``); elsewhere the torch path (``penalties_apply_torch``,
``penalties_update_torch``). The Triton functions also run on CPU tensors under
``TRITON_INTERPRET=1`` (how the tests check them).

Limits: two rows of one call must not share a slot (the engine never does that).
"""

from __future__ import annotations

import functools
from typing import Annotated, Any

import msgspec

from freetoken_core.lazy import lazy_import
from freetoken_core.processors import (
    LogitsProcessor,
    ProcessorContext,
    RequestFields,
    RequestView,
    Stage,
)

torch = lazy_import("torch")  # (the HTTP process loads this module but needs no torch)

REPETITION = "repetition_penalty"
PRESENCE = "presence_penalty"
FREQUENCY = "frequency_penalty"
FIELDS = (REPETITION, PRESENCE, FREQUENCY)
"""In the order the penalties apply, which is also the column order of ``penalties``."""
NEUTRAL = {REPETITION: 1.0, PRESENCE: 0.0, FREQUENCY: 0.0}
MIN_REPETITION_PENALTY = 0.01
"""Smallest ``repetition_penalty``: ``x / r`` multiplies a logit by at most 100."""
MAX_REPETITION_PENALTY = 100.0
"""Largest ``repetition_penalty``: ``x * r`` multiplies a logit by at most 100. With a
temperature of at least ``GREEDY_TEMPERATURE`` (1e-5) a logit is scaled by at most 1e7 in
all, so model logits below 1e30 in magnitude stay finite in float32 (real ones are < 1e4)."""
PENALTY_LIMIT = 2.0
"""``presence_penalty`` and ``frequency_penalty`` lie in ``[-PENALTY_LIMIT, PENALTY_LIMIT]``
(OpenAI's range); ``frequency * count`` is then at most ``2 * max_model_len``."""
RepetitionPenalty = Annotated[float, msgspec.Meta(ge=MIN_REPETITION_PENALTY,
                                                  le=MAX_REPETITION_PENALTY)]
"""A finite number in ``[0.01, 100]`` (NaN and infinities fail the bounds); 1 is off."""
AdditivePenalty = Annotated[float, msgspec.Meta(ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)]
"""A finite number in ``[-2, 2]`` (NaN and infinities fail the bounds); 0 is off."""

BENCH_PARAMS: dict[str, Any] = {REPETITION: 1.2, PRESENCE: 0.5, FREQUENCY: 0.5}
"""A request that switches the processor on, for ``bench/bench_penalties.py``."""

_APPLY_BLOCK = 256
_UPDATE_BLOCK = 1024


# -- the math, shared by the torch path and the tests' references ----------------------

def penalize(x: torch.Tensor, counts: torch.Tensor, repetition: torch.Tensor,
             presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """Penalised logits ``x`` of tokens generated ``counts`` times (float32, broadcast)."""
    x = torch.where(x < 0, x * repetition, x / repetition)
    x = x - torch.where(counts > 0, presence, torch.zeros_like(presence))
    return x - frequency * counts


# -- torch path -------------------------------------------------------------------------

def penalties_apply_torch(logits: torch.Tensor, slots: torch.Tensor, token_ids: torch.Tensor,
                          lengths: torch.Tensor, counts: torch.Tensor,
                          is_active: torch.Tensor, penalties: torch.Tensor,
                          width: int) -> None:
    """Penalise ``logits`` [rows, V] in place; row ``i`` uses slot ``slots[i]``; any device.

    ``token_ids`` / ``lengths`` are the history's; ``width`` bounds every active slot's
    length: only the first ``width`` positions are read. ``lengths`` and ``is_active`` are
    not needed here (an active slot's counts are ``-1`` from its length on, and an inactive
    slot's penalties are neutral); the Triton path uses them to skip work.
    """
    if width == 0 or logits.shape[0] == 0:
        return
    tok = token_ids[slots, :width].long()
    cnt = counts[slots, :width]
    first = cnt >= 0
    # A later position of a token, or one past the end, repeats the row's position 0 (a
    # first one: same token, same count, hence the same new value), so the scatter writes
    # every touched token one well-defined value. A row of an inactive slot (stale entries)
    # has neutral penalties, which leave every value bit-identical.
    tok = torch.where(first, tok, tok[:, :1])
    cnt = torch.where(first, cnt, cnt[:, :1]).float()
    pen = penalties[slots]
    x = penalize(logits.gather(1, tok), cnt, pen[:, 0:1], pen[:, 1:2], pen[:, 2:3])
    logits.scatter_(1, tok, x)


def penalties_update_torch(slots: torch.Tensor, sampled: torch.Tensor, token_ids: torch.Tensor,
                           lengths: torch.Tensor, counts: torch.Tensor,
                           is_active: torch.Tensor, width: int) -> None:
    """Count ``sampled[i]``, which the history already ends with, in slot ``slots[i]``; any
    device. The new position's count was ``-1`` (past the length), so the look-up among the
    first positions skips it. Rows of inactive slots change only stale counts, which
    ``add_request`` rewrites whole; ``is_active`` is for the Triton path, which skips them."""
    if width == 0 or slots.shape[0] == 0:
        return
    cnt = counts[slots, :width]
    hit = (token_ids[slots, :width] == sampled.to(torch.int32).unsqueeze(1)) & (cnt >= 0)
    counts[slots, :width] = cnt + hit.to(counts.dtype)
    last = (lengths[slots] - 1).clamp(min=0)
    counts[slots, last] = torch.where(hit.any(dim=1), -1, 1).to(counts.dtype)


# -- Triton path ------------------------------------------------------------------------

@functools.cache
def _kernels() -> tuple[Any, Any]:
    """Build the Triton kernels on first use, so importing the plugin never imports triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def penalties_apply_kernel(logits_ptr, row_stride, slots_ptr, token_ids_ptr, lengths_ptr,
                               counts_ptr, is_active_ptr, penalties_ptr, capacity,
                               BLOCK: tl.constexpr):
        # One program per (row, block of the row's history); blocks past it do nothing.
        row = tl.program_id(0)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        n = tl.load(lengths_ptr + slot) * tl.load(is_active_ptr + slot).to(tl.int64)
        start = tl.program_id(1) * BLOCK
        if start < n:
            offsets = start + tl.arange(0, BLOCK)
            entry = slot * capacity + offsets
            cnt = tl.load(counts_ptr + entry, mask=offsets < n, other=-1)
            first = (offsets < n) & (cnt >= 0)
            tok = tl.load(token_ids_ptr + entry, mask=first, other=0)
            cnt = cnt.to(tl.float32)
            repetition = tl.load(penalties_ptr + slot * 3)
            presence = tl.load(penalties_ptr + slot * 3 + 1)
            frequency = tl.load(penalties_ptr + slot * 3 + 2)
            ptrs = logits_ptr + row.to(tl.int64) * row_stride + tok
            x = tl.load(ptrs, mask=first, other=0.0)
            # div_rn: IEEE division, as torch's, not the fast approximate one.
            x = tl.where(x < 0, x * repetition, tl.math.div_rn(x, repetition))
            x = x - tl.where(cnt > 0, presence, 0.0)
            x = x - frequency * cnt
            tl.store(ptrs, x, mask=first)

    @triton.jit
    def penalties_update_kernel(slots_ptr, sampled_ptr, token_ids_ptr, lengths_ptr,
                                counts_ptr, is_active_ptr, capacity, BLOCK: tl.constexpr):
        # One program per row: look the token up among the earlier first positions.
        row = tl.program_id(0)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        if tl.load(is_active_ptr + slot).to(tl.int32) != 0:
            token = tl.load(sampled_ptr + row).to(tl.int32)
            last = tl.maximum(tl.load(lengths_ptr + slot) - 1, 0)
            base = slot * capacity
            num_hits = 0
            for start in range(0, last, BLOCK):
                offsets = start + tl.arange(0, BLOCK)
                earlier = offsets < last
                tok = tl.load(token_ids_ptr + base + offsets, mask=earlier, other=-1)
                cnt = tl.load(counts_ptr + base + offsets, mask=earlier, other=-1)
                hit = earlier & (tok == token) & (cnt >= 0)
                tl.store(counts_ptr + base + offsets, cnt + 1, mask=hit)
                num_hits += tl.sum(hit.to(tl.int32), axis=0)
            new = tl.where(num_hits > 0, -1, 1)
            tl.store(counts_ptr + base + last, new)

    return penalties_apply_kernel, penalties_update_kernel


def penalties_apply_triton(logits: torch.Tensor, slots: torch.Tensor, token_ids: torch.Tensor,
                           lengths: torch.Tensor, counts: torch.Tensor,
                           is_active: torch.Tensor, penalties: torch.Tensor, width: int,
                           block: int = _APPLY_BLOCK) -> None:
    """The Triton path of ``penalties_apply_torch``: same arguments, same result.

    Runs on CUDA tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` was set before
    triton was imported. ``logits`` must be contiguous along the vocabulary, the state
    tensors contiguous; ``block`` is a power of two.
    """
    if width == 0 or logits.shape[0] == 0:
        return
    if logits.stride(1) != 1:
        raise ValueError("penalties_apply_triton needs logits contiguous along the vocabulary")
    grid = (logits.shape[0], -(-width // block))
    # No FP contraction: ``x - frequency * cnt`` as one FMA would round once, torch rounds
    # the product and the difference apart; without it the result is torch's, bit for bit.
    _kernels()[0][grid](logits, logits.stride(0), slots, token_ids, lengths, counts,
                        is_active, penalties, token_ids.shape[1], BLOCK=block,
                        enable_fp_fusion=False)


def penalties_update_triton(slots: torch.Tensor, sampled: torch.Tensor,
                            token_ids: torch.Tensor, lengths: torch.Tensor,
                            counts: torch.Tensor, is_active: torch.Tensor, width: int,
                            block: int = _UPDATE_BLOCK) -> None:
    """The Triton path of ``penalties_update_torch``: same arguments, same result."""
    if slots.shape[0] == 0:
        return
    _kernels()[1][(slots.shape[0],)](slots, sampled, token_ids, lengths, counts, is_active,
                                     token_ids.shape[1], BLOCK=block, enable_fp_fusion=False)


# -- the processor ------------------------------------------------------------------------

class Penalties(LogitsProcessor):
    """penalties: repetition (Hugging Face / CTRL), presence and frequency (OpenAI)."""

    class Fields(RequestFields):
        repetition_penalty: RepetitionPenalty | None = None
        presence_penalty: AdditivePenalty | None = None
        frequency_penalty: AdditivePenalty | None = None

    stage = Stage.PENALTY
    argmax_invariant = False
    reads_history = True

    def __init__(self, ctx: ProcessorContext) -> None:
        super().__init__(ctx)
        max_num_slots, model, device = ctx.max_num_slots, ctx.model, ctx.device
        self.capacity = self.history.capacity
        # A count never exceeds max_model_len - 1 (the prompt is never empty).
        count_dtype = torch.int16 if model.max_model_len <= 1 << 15 else torch.int32
        self.counts = torch.zeros((max_num_slots, self.capacity), dtype=count_dtype,
                                  device=device)
        self.is_active = torch.zeros(max_num_slots, dtype=torch.bool, device=device)
        self._neutral = torch.tensor([NEUTRAL[f] for f in FIELDS], dtype=torch.float32)
        self.penalties = self._neutral.to(device).repeat(max_num_slots, 1)

    @property
    def state_bytes(self) -> int:
        """Device memory held by the processor's own state (the history aside), in bytes."""
        tensors = (self.counts, self.is_active, self.penalties)
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def width(self) -> int:
        """An upper bound on the history length of every active slot."""
        return self.history.width

    @classmethod
    def uses(cls, fields: Fields) -> bool:
        return any(getattr(fields, f) not in (None, NEUTRAL[f]) for f in FIELDS)

    def add_request(self, slot: int, request: RequestView) -> None:
        num_prompt = len(request.prompt_token_ids)
        ids = torch.tensor(list(request.prompt_token_ids) + list(request.output_token_ids),
                           dtype=torch.long)
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < self.model.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.model.vocab_size})")
        if ids.numel() > self.capacity:
            raise ValueError(f"{ids.numel()} tokens exceed the capacity {self.capacity}")
        unique, inverse = torch.unique(ids, return_inverse=True)
        generated = torch.bincount(inverse[num_prompt:], minlength=unique.numel())
        positions = torch.arange(ids.numel())
        first = torch.full((unique.numel(),), ids.numel()).scatter_reduce_(
            0, inverse, positions, "amin")
        # -1 past the length too: the update's look-up and apply skip those positions.
        counts = torch.full((self.capacity,), -1, dtype=torch.long)
        counts[first] = generated
        self.counts[slot] = counts.to(self.device, self.counts.dtype)
        self.is_active[slot] = True
        fields = request.fields
        values = [NEUTRAL[f] if getattr(fields, f) is None else getattr(fields, f)
                  for f in FIELDS]
        self.penalties[slot] = torch.tensor(values, dtype=torch.float32).to(self.device)

    def remove_request(self, slot: int) -> None:
        self.is_active[slot] = False
        self.penalties[slot] = self._neutral.to(self.device)

    def _state(self) -> dict[str, torch.Tensor]:
        return {"token_ids": self.history.token_ids, "lengths": self.history.lengths,
                "counts": self.counts, "is_active": self.is_active}

    def apply(self, logits: torch.Tensor, slots: torch.Tensor) -> None:
        path = self.apply_triton if logits.is_cuda else self.apply_torch
        path(logits, slots)

    def apply_torch(self, logits: torch.Tensor, slots: torch.Tensor) -> None:
        penalties_apply_torch(logits, slots, **self._state(), penalties=self.penalties,
                              width=self.width)

    def apply_triton(self, logits: torch.Tensor, slots: torch.Tensor) -> None:
        penalties_apply_triton(logits, slots, **self._state(), penalties=self.penalties,
                               width=self.width)

    def update(self, slots: torch.Tensor, sampled: torch.Tensor) -> None:
        path = self.update_triton if sampled.is_cuda else self.update_torch
        path(slots, sampled)

    def update_torch(self, slots: torch.Tensor, sampled: torch.Tensor) -> None:
        penalties_update_torch(slots, sampled, **self._state(), width=self.width)

    def update_triton(self, slots: torch.Tensor, sampled: torch.Tensor,
                      block: int = _UPDATE_BLOCK) -> None:
        penalties_update_triton(slots, sampled, **self._state(), width=self.width,
                                block=block)
