"""The min_p plugin: drop the tokens much less likely than the row's most likely one.

Request field: ``min_p``, a number in ``[0, 1]`` (``0`` or absent: off). After temperature
scaling, a token whose probability is below ``min_p`` times the largest probability of its
row is set to ``-inf``; the most likely token (and any token tied with it) always stays.
Same semantics as vLLM's ``min_p`` and Hugging Face's ``MinPLogitsWarper``.

Math: ``p_i < min_p * p_max`` with ``p = softmax(x)`` is ``x_i < x_max + log(min_p)``, so the
processor needs no softmax: one max per row, one compare-and-mask pass. Tokens already at
``-inf`` (e.g. masked by an earlier processor) are left there and do not count.

Processor ``min_p``: stage ``POST_TEMPERATURE`` (it sees the temperature-scaled logits),
``argmax_invariant`` (skipped when every row of a step is greedy). No per-step state, so
``update`` does nothing.

State: one float32 per slot, ``log(min_p)`` of the slot's request, ``-inf`` for a slot
whose request does not use min_p (the neutral value: the threshold is ``-inf`` and nothing
is masked). For ``S`` slots that is ``4 * S`` bytes, whatever the vocabulary ``V``. It is
written once in ``add_request`` and reset to ``-inf`` in ``remove_request``.

Cost per step: two reads of each row and a write of the masked entries, ``O(rows * V)``
(min_p is dense by nature: the threshold depends on the whole row). On CUDA one Triton
launch (``min_p_triton``, one program per row looping over the vocabulary in blocks); on
other devices the torch path (``min_p_torch``). Both touch rows of non-using slots too but
leave them unchanged.
"""

from __future__ import annotations

import functools
import math
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

FIELD = "min_p"
MinPValue = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
"""``[0, 1]``: any such value keeps logits finite, since ``log(min_p)`` is ``-inf`` (off) or
at least ``log(5e-324) = -744.4``, even for a subnormal ``min_p``."""
BENCH_PARAMS: dict[str, Any] = {"min_p": 0.05}
"""A typical request for ``freetoken bench plugin min_p`` and ``bench/bench_min_p.py``."""

_TRITON_BLOCK = 2048


def min_p_torch(logits: torch.Tensor, slots: torch.Tensor, log_min_p: torch.Tensor) -> None:
    """Mask in place the tokens of row ``i`` below ``max + log_min_p[slots[i]]``; any device."""
    threshold = logits.amax(dim=-1, keepdim=True) + log_min_p[slots].unsqueeze(1)
    logits.masked_fill_(logits < threshold, float("-inf"))


@functools.cache
def _min_p_kernel() -> Any:
    """Build the Triton kernel on first use, so importing the plugin never imports triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def min_p_kernel(logits_ptr, row_stride, slots_ptr, log_min_p_ptr, vocab,
                     BLOCK: tl.constexpr):
        row = tl.program_id(0)
        log_min_p = tl.load(log_min_p_ptr + tl.load(slots_ptr + row))
        # A slot that does not use min_p has -inf: nothing to mask, skip both passes.
        if log_min_p > float("-inf"):
            base = logits_ptr + row.to(tl.int64) * row_stride
            offsets = tl.arange(0, BLOCK)
            running = tl.full([BLOCK], float("-inf"), tl.float32)
            for start in range(0, vocab, BLOCK):
                x = tl.load(base + start + offsets, mask=start + offsets < vocab,
                            other=float("-inf"))
                running = tl.maximum(running, x)
            threshold = tl.max(running, axis=0) + log_min_p
            for start in range(0, vocab, BLOCK):
                in_row = start + offsets < vocab
                x = tl.load(base + start + offsets, mask=in_row, other=0.0)
                drop = in_row & (x < threshold)
                tl.store(base + start + offsets, tl.full([BLOCK], float("-inf"), tl.float32),
                         mask=drop)

    return min_p_kernel


def min_p_triton(logits: torch.Tensor, slots: torch.Tensor, log_min_p: torch.Tensor,
                 block: int = _TRITON_BLOCK) -> None:
    """The Triton path of ``min_p_torch``: same arguments, same result, in place.

    Runs on CUDA tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` was set before
    triton was imported (how the tests run it). ``logits`` is float32 [rows, V] with unit
    stride along V; ``block`` is a power of two.
    """
    if logits.shape[0] == 0:
        return
    if logits.stride(1) != 1:
        raise ValueError("min_p_triton needs logits contiguous along the vocabulary")
    _min_p_kernel()[(logits.shape[0],)](logits, logits.stride(0), slots, log_min_p,
                                        logits.shape[1], BLOCK=block, enable_fp_fusion=False)


class MinP(LogitsProcessor):
    """min_p: drop the tokens much less likely than the row's most likely one."""

    class Fields(RequestFields):
        min_p: MinPValue | None = None

    stage = Stage.POST_TEMPERATURE
    argmax_invariant = True

    def __init__(self, ctx: ProcessorContext) -> None:
        super().__init__(ctx)
        self.log_min_p = torch.full((ctx.max_num_slots,), float("-inf"), dtype=torch.float32,
                                    device=ctx.device)

    @classmethod
    def uses(cls, fields: Fields) -> bool:
        return fields.min_p is not None and fields.min_p > 0

    def add_request(self, slot: int, request: RequestView) -> None:
        self.log_min_p[slot] = math.log(request.fields.min_p)

    def remove_request(self, slot: int) -> None:
        self.log_min_p[slot] = float("-inf")

    def apply(self, logits: torch.Tensor, slots: torch.Tensor) -> None:
        if logits.is_cuda:
            min_p_triton(logits, slots, self.log_min_p)
        else:
            min_p_torch(logits, slots, self.log_min_p)
