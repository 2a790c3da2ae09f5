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

State, per slot (``S`` slots, vocabulary ``V``, ``K = min(V, max_model_len)``): the slot's
*distinct* tokens of prompt + output, in a preallocated list, with the number of times
each was generated:

==============  ========================  ================================================
tensor          shape, dtype              holds
==============  ========================  ================================================
``token_ids``   [S, K] int32              distinct token ids; entries ``[0, n)`` are valid
``counts``      [S, K] int16 or int32     output count of each entry (0: prompt only);
                                          int16 when ``max_model_len <= 32768``
``num_tokens``  [S] int32                 ``n``, the length of the list
``is_active``   [S] bool                  the slot's request uses the processor
``penalties``   [S, 3] float32            repetition, presence, frequency (neutral 1, 0, 0)
==============  ========================  ================================================

Size: ``S * K * (4 + c) + 17 * S`` bytes, ``c`` = 2 (int16 counts) or 4. At 256 slots and
V = 151,936 with max_model_len 32,768 (the default KV-cache cap): K = 32,768, int16
counts, 48 MiB + 4.3 KiB. It grows linearly with ``max_model_len`` (8 bytes an entry
above 32,768: 128 MiB at 65,536, 256 MiB at 131,072 for 256 slots) and never exceeds
``8 * S * V`` bytes; lower ``max_num_seqs`` or ``max_model_len`` to bound it.

``add_request`` builds a slot's list once (``torch.unique`` of prompt + output on the host,
one copy to the device) and ``remove_request`` resets the slot to neutral (``n = 0``).
``update`` folds each sampled token in on the device: a token already in the list gets its
count bumped, a new one is appended with count 1. ``apply`` touches only the listed tokens
of each row: gather the logits at the row's token ids, penalise, scatter back. It never
reads or writes the other ``V - n`` entries, so it costs ``O(rows * distinct tokens)``.

No device→host sync: the host keeps an upper bound on every slot's ``n`` (its length at
``add_request`` plus the number of ``update`` calls since), and the torch path and the
Triton grid only cover that many entries. On CUDA ``apply`` and ``update`` are one Triton
launch each (``penalties_apply_triton``, ``penalties_update_triton``); elsewhere the torch
path (``penalties_apply_torch``, ``penalties_update_torch``). The Triton functions also run
on CPU tensors under ``TRITON_INTERPRET=1`` (how the tests check them).

Limits: a slot holds at most ``K`` distinct tokens, which the engine guarantees (a sequence
never exceeds ``max_model_len`` tokens, nor ``V`` distinct ones). Two rows of one call
must not share a slot (the engine never does that).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Annotated, Any

import msgspec
import torch

from freetoken_core.processors import (
    LogitsProcessor,
    ProcessorContext,
    RequestFields,
    RequestView,
    Stage,
)

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
                          counts: torch.Tensor, num_tokens: torch.Tensor,
                          penalties: torch.Tensor, width: int) -> None:
    """Penalise ``logits`` [rows, V] in place; row ``i`` uses slot ``slots[i]``; any device.

    ``width`` bounds every slot's ``num_tokens``; only the first ``width`` list entries
    are read.
    """
    if width == 0 or logits.shape[0] == 0:
        return
    tok = token_ids[slots, :width].long()
    cnt = counts[slots, :width]
    n = num_tokens[slots].unsqueeze(1)
    valid = torch.arange(width, device=logits.device) < n
    # Past the end of its list a row repeats its entry 0 (same token, same count, hence the
    # same new value), so the scatter writes every touched token one well-defined value.
    tok = torch.where(valid, tok, tok[:, :1])
    cnt = torch.where(valid, cnt, cnt[:, :1]).float()
    # A row with an empty list (a slot that does not use the processor) must not change its
    # stale entry 0: neutral penalties leave every value bit-identical.
    neutral = torch.tensor([NEUTRAL[f] for f in FIELDS], device=logits.device)
    pen = torch.where(n > 0, penalties[slots], neutral)
    x = penalize(logits.gather(1, tok), cnt, pen[:, 0:1], pen[:, 1:2], pen[:, 2:3])
    logits.scatter_(1, tok, x)


def penalties_update_torch(slots: torch.Tensor, sampled: torch.Tensor, token_ids: torch.Tensor,
                           counts: torch.Tensor, num_tokens: torch.Tensor,
                           is_active: torch.Tensor, width: int) -> None:
    """Fold ``sampled[i]`` into slot ``slots[i]``'s list, for active slots; any device."""
    capacity = token_ids.shape[1]
    act = is_active[slots]
    token = sampled.to(torch.int32)
    n = num_tokens[slots]
    tok = token_ids[slots, :width]
    hit = (tok == token.unsqueeze(1)) & (torch.arange(width, device=tok.device) < n.unsqueeze(1))
    hit &= act.unsqueeze(1)
    if width:
        counts[slots, :width] += hit.to(counts.dtype)
    new = act & ~hit.any(dim=1)
    pos = n.clamp(max=capacity - 1).long()
    token_ids[slots, pos] = torch.where(new, token, token_ids[slots, pos])
    counts[slots, pos] = torch.where(new, torch.ones_like(counts[slots, pos]), counts[slots, pos])
    num_tokens[slots] = torch.where(new, (n + 1).clamp(max=capacity), n)


# -- Triton path ------------------------------------------------------------------------

@functools.cache
def _kernels() -> tuple[Any, Any]:
    """Build the Triton kernels on first use, so importing the plugin never imports triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def penalties_apply_kernel(logits_ptr, row_stride, slots_ptr, token_ids_ptr, counts_ptr,
                               num_tokens_ptr, penalties_ptr, capacity, BLOCK: tl.constexpr):
        # One program per (row, block of the row's list); blocks past the list do nothing.
        row = tl.program_id(0)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        n = tl.load(num_tokens_ptr + slot)
        start = tl.program_id(1) * BLOCK
        if start < n:
            offsets = start + tl.arange(0, BLOCK)
            in_list = offsets < n
            entry = slot * capacity + offsets
            tok = tl.load(token_ids_ptr + entry, mask=in_list, other=0)
            cnt = tl.load(counts_ptr + entry, mask=in_list, other=0).to(tl.float32)
            repetition = tl.load(penalties_ptr + slot * 3)
            presence = tl.load(penalties_ptr + slot * 3 + 1)
            frequency = tl.load(penalties_ptr + slot * 3 + 2)
            ptrs = logits_ptr + row.to(tl.int64) * row_stride + tok
            x = tl.load(ptrs, mask=in_list, other=0.0)
            # div_rn: IEEE division, as torch's, not the fast approximate one.
            x = tl.where(x < 0, x * repetition, tl.math.div_rn(x, repetition))
            x = x - tl.where(cnt > 0, presence, 0.0)
            x = x - frequency * cnt
            tl.store(ptrs, x, mask=in_list)

    @triton.jit
    def penalties_update_kernel(slots_ptr, sampled_ptr, token_ids_ptr, counts_ptr,
                                num_tokens_ptr, is_active_ptr, capacity, BLOCK: tl.constexpr):
        # One program per row: scan the slot's list for the token, bump or append.
        row = tl.program_id(0)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        if tl.load(is_active_ptr + slot).to(tl.int32) != 0:
            token = tl.load(sampled_ptr + row).to(tl.int32)
            n = tl.load(num_tokens_ptr + slot)
            base = slot * capacity
            num_hits = 0
            for start in range(0, n, BLOCK):
                offsets = start + tl.arange(0, BLOCK)
                in_list = offsets < n
                tok = tl.load(token_ids_ptr + base + offsets, mask=in_list, other=-1)
                hit = in_list & (tok == token)
                cnt = tl.load(counts_ptr + base + offsets, mask=hit, other=0)
                tl.store(counts_ptr + base + offsets, cnt + 1, mask=hit)
                num_hits += tl.sum(hit.to(tl.int32), axis=0)
            if num_hits == 0:
                pos = tl.minimum(n, capacity - 1)
                tl.store(token_ids_ptr + base + pos, token)
                tl.store(counts_ptr + base + pos, tl.full([], 1, tl.int32))
                tl.store(num_tokens_ptr + slot, tl.minimum(n + 1, capacity))

    return penalties_apply_kernel, penalties_update_kernel


def penalties_apply_triton(logits: torch.Tensor, slots: torch.Tensor, token_ids: torch.Tensor,
                           counts: torch.Tensor, num_tokens: torch.Tensor,
                           penalties: torch.Tensor, width: int,
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
    _kernels()[0][grid](logits, logits.stride(0), slots, token_ids, counts, num_tokens,
                        penalties, token_ids.shape[1], BLOCK=block, enable_fp_fusion=False)


def penalties_update_triton(slots: torch.Tensor, sampled: torch.Tensor,
                            token_ids: torch.Tensor, counts: torch.Tensor,
                            num_tokens: torch.Tensor, is_active: torch.Tensor, width: int,
                            block: int = _UPDATE_BLOCK) -> None:
    """The Triton path of ``penalties_update_torch``: same arguments, same result."""
    if slots.shape[0] == 0:
        return
    _kernels()[1][(slots.shape[0],)](slots, sampled, token_ids, counts, num_tokens, is_active,
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

    def __init__(self, ctx: ProcessorContext) -> None:
        super().__init__(ctx)
        max_num_slots, model, device = ctx.max_num_slots, ctx.model, ctx.device
        self.capacity = max(1, min(model.vocab_size, model.max_model_len))
        # A count never exceeds max_model_len - 1 (the prompt is never empty).
        count_dtype = torch.int16 if model.max_model_len <= 1 << 15 else torch.int32
        shape = (max_num_slots, self.capacity)
        self.token_ids = torch.zeros(shape, dtype=torch.int32, device=device)
        self.counts = torch.zeros(shape, dtype=count_dtype, device=device)
        self.num_tokens = torch.zeros(max_num_slots, dtype=torch.int32, device=device)
        self.is_active = torch.zeros(max_num_slots, dtype=torch.bool, device=device)
        self._neutral = torch.tensor([NEUTRAL[f] for f in FIELDS], dtype=torch.float32)
        self.penalties = self._neutral.to(device).repeat(max_num_slots, 1)
        # Host-side upper bound on every active slot's num_tokens, kept without reading the
        # device: slot s has at most (its n at add_request) + (updates since) entries, that
        # is _offsets[s] + _num_updates.
        self._num_updates = 0
        self._offsets: dict[int, int] = {}
        self._max_offset = 0

    @property
    def state_bytes(self) -> int:
        """Device memory held by the state, in bytes."""
        tensors = (self.token_ids, self.counts, self.num_tokens, self.is_active, self.penalties)
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def width(self) -> int:
        """An upper bound on the list length of every slot (0 when no slot is active)."""
        if not self._offsets:
            return 0
        return max(0, min(self.capacity, self._max_offset + self._num_updates))

    @classmethod
    def uses(cls, fields: Fields) -> bool:
        return any(getattr(fields, f) not in (None, NEUTRAL[f]) for f in FIELDS)

    def add_request(self, slot: int, request: RequestView) -> None:
        prompt_token_ids = request.prompt_token_ids
        ids = torch.tensor(list(prompt_token_ids) + list(request.output_token_ids),
                           dtype=torch.long)
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < self.model.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.model.vocab_size})")
        unique, inverse = torch.unique(ids, return_inverse=True)
        counts = torch.bincount(inverse[len(prompt_token_ids):], minlength=unique.numel())
        n = unique.numel()
        if n > self.capacity:
            raise ValueError(f"{n} distinct tokens exceed the capacity {self.capacity}")
        self.token_ids[slot, :n] = unique.to(self.device, torch.int32)
        self.counts[slot, :n] = counts.to(self.device, self.counts.dtype)
        self.num_tokens[slot] = n
        self.is_active[slot] = True
        fields = request.fields
        values = [NEUTRAL[f] if getattr(fields, f) is None else getattr(fields, f)
                  for f in FIELDS]
        self.penalties[slot] = torch.tensor(values, dtype=torch.float32).to(self.device)
        self._offsets[slot] = n - self._num_updates
        self._max_offset = max(self._offsets.values())

    def remove_request(self, slot: int) -> None:
        self.num_tokens[slot] = 0
        self.is_active[slot] = False
        self.penalties[slot] = self._neutral.to(self.device)
        self._offsets.pop(slot, None)
        self._max_offset = max(self._offsets.values(), default=0)

    def _state(self) -> dict[str, torch.Tensor]:
        return {"token_ids": self.token_ids, "counts": self.counts,
                "num_tokens": self.num_tokens}

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
        self._fold(penalties_update_torch, slots, sampled)

    def update_triton(self, slots: torch.Tensor, sampled: torch.Tensor,
                      block: int = _UPDATE_BLOCK) -> None:
        self._fold(functools.partial(penalties_update_triton, block=block), slots, sampled)

    def _fold(self, path: Callable[..., None], slots: torch.Tensor,
              sampled: torch.Tensor) -> None:
        if self._offsets:
            path(slots, sampled, **self._state(), is_active=self.is_active, width=self.width)
        self._num_updates += 1
