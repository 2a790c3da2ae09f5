"""The min_tokens plugin: no stop token until a sequence has generated ``min_tokens`` tokens.

Request field (``MinTokens.Fields``): ``min_tokens``, an integer ``>= 0`` (the type says
so) and ``<= max_tokens`` (when ``max_tokens`` is set); ``0`` or absent: off, and free.
``validate`` stores a ``min_tokens`` beyond the context as ``max_model_len`` (same effect: a
sequence never generates more; it keeps the value inside int64 for the engine) and, given
the request's core parameters, refuses a ``min_tokens`` above ``max_tokens`` and a positive
``min_tokens`` whose held-back ids would be the whole vocabulary (every logit ``-inf``:
nothing to draw).

While a sequence has generated fewer than ``min_tokens`` tokens, the logits of its stop
tokens are set to ``-inf``: the model's EOS ids (``ModelInfo.eos_token_ids``; not with
``ignore_eos``, where EOS stops nothing) and the request's ``stop_token_ids`` (the
stop_tokens plugin's validated field, read from ``params.fields["stop_tokens"]`` when the
request uses that plugin). The first token that may be a stop token is therefore token
number ``min_tokens + 1``. Same semantics as vLLM's ``min_tokens`` and Hugging Face's
``MinNewTokensLengthLogitsProcessor(prompt_length, min_new_tokens, stop ids)``. Stop strings
are not token ids and are not held back. Stage ``MIN_TOKENS`` (after logit_bias, so a
``+100`` bias on EOS cannot beat it); not ``argmax_invariant``.

State (sparse: nothing is sized by the vocabulary), preallocated for ``S`` slots:

- ``num_generated``: int64 ``[S]``, tokens the slot's sequence has generated: set from
  ``len(output_token_ids)`` in ``add_request`` (a preempted sequence resumes its count),
  incremented on the device in ``update``;
- ``min_tokens``: int64 ``[S]``, the request's ``min_tokens`` (``0`` for a free slot, which
  therefore never masks);
- ``mask_ids``: int64 ``[S, K]``, the slot's distinct stop ids, padded by repeating its
  first id (so that a gather-then-scatter writes every duplicate with one value);
- ``num_mask_ids``: int32 ``[S]``, how many of them are real.

That is ``S * (20 + 8 * K)`` bytes whatever the vocabulary ``V``. ``K`` starts at 16 and
grows (to the next power of two, in ``add_request``, on the host; the table is reallocated,
which a captured CUDA graph would have to follow) when a request brings more EOS + stop
ids: 37,888 bytes for 256 slots at ``K = 16`` (at ``V = 151,936`` as at any other), about
4 MiB at the most the stop_tokens plugin allows (1,024 stop ids + EOS: ``K = 2,048``).

Cost per step: the torch path (``min_tokens_torch``, any device) gathers the ``[rows, W]``
listed logits (``W``: the most ids among the slots in use, tracked on the host), replaces
them by ``-inf`` on the rows still under their minimum, and scatters them back. On CUDA
one Triton launch (``min_tokens_triton``): one program per row that stores ``-inf`` at its
own ids only while the row is under its minimum, and does nothing otherwise. ``update`` is
one ``index_add_`` on ``num_generated``. ``O(rows * ids)``, never ``O(rows * V)``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from freetoken_core.errors import InvalidRequest
from freetoken_core.lazy import lazy_import
from freetoken_core.processors import (
    LogitsProcessor,
    ModelInfo,
    ProcessorContext,
    RequestFields,
    RequestView,
    Stage,
)
from freetoken_plugins._slot_widths import SlotWidths

torch = lazy_import("torch")  # (the HTTP process loads this module but needs no torch)

if TYPE_CHECKING:
    from freetoken_core.sampling_params import SamplingParams

FIELD = "min_tokens"
STOP_TOKENS = "stop_tokens"
STOP_IDS_FIELD = "stop_token_ids"
"""The stop_tokens plugin and its field; its ids are held back too."""
BENCH_PARAMS: dict[str, Any] = {FIELD: 1000}
"""A typical request; it needs ``max_tokens >= 1000`` beside it (the bench harness's base
request has 4,096), as ``min_tokens`` may not exceed ``max_tokens``."""

_INITIAL_IDS = 16
_TRITON_BLOCK = 16

tl: Any = None
"""``triton.language``, bound by ``_kernel()`` on first use: importing the plugin never
imports triton, and the kernel below finds ``tl`` among its module's globals as Triton
(compiler and interpreter alike) expects."""


def check_against_request(value: int, params: SamplingParams, model: ModelInfo) -> None:
    """Raise ``InvalidRequest`` naming ``min_tokens`` when ``value`` exceeds ``max_tokens``,
    or when it is positive and would hold back every token of the vocabulary."""
    if params.max_tokens is not None and value > params.max_tokens:
        raise InvalidRequest(FIELD, f"min_tokens ({value}) must not exceed max_tokens "
                                    f"({params.max_tokens})")
    stop_ids = params.extra.get(STOP_IDS_FIELD) or ()
    if value and isinstance(stop_ids, (list, tuple)):
        # The stop_tokens plugin checks the ids themselves; count only valid ones here.
        held = set() if params.ignore_eos else set(model.eos_token_ids)
        held.update(t for t in stop_ids if isinstance(t, int) and 0 <= t < model.vocab_size)
        if len(held) >= model.vocab_size:
            raise InvalidRequest(FIELD, "min_tokens would hold back every token of the "
                                        "vocabulary (EOS and stop_token_ids)")


def stop_ids_of(params: SamplingParams, eos_token_ids: frozenset[int]) -> list[int]:
    """The distinct token ids a validated request's ``min_tokens`` holds back, sorted."""
    ids = set() if params.ignore_eos else set(eos_token_ids)
    stop_fields = params.fields.get(STOP_TOKENS)
    ids.update(getattr(stop_fields, STOP_IDS_FIELD, None) or ())
    return sorted(ids)


# -- the two paths -------------------------------------------------------------------------

def min_tokens_torch(logits: torch.Tensor, slots: torch.Tensor, mask_ids: torch.Tensor,
                     num_generated: torch.Tensor, min_tokens: torch.Tensor, width: int) -> None:
    """Set to ``-inf`` in place the first ``width`` ``mask_ids`` of slot ``slots[i]`` in row
    ``i`` when ``num_generated < min_tokens`` for that slot; any device.

    Entries past a slot's own count must repeat one of its ids (or be 0 on a slot whose
    ``min_tokens`` is 0)."""
    if width == 0 or logits.shape[0] == 0:
        return
    ids = mask_ids[slots, :width]
    under = (num_generated[slots] < min_tokens[slots]).unsqueeze(1)
    logits.scatter_(1, ids, logits.gather(1, ids).masked_fill(under, float("-inf")))


def _min_tokens_kernel(logits_ptr, row_stride, slots_ptr, mask_ids_ptr, num_mask_ids_ptr,
                       num_generated_ptr, min_tokens_ptr, state_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    under = tl.load(num_generated_ptr + slot) < tl.load(min_tokens_ptr + slot)
    count = tl.where(under, tl.load(num_mask_ids_ptr + slot), 0)
    base = logits_ptr + row * row_stride
    for start in range(0, count, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        listed = offsets < count
        tokens = tl.load(mask_ids_ptr + slot * state_stride + offsets, mask=listed, other=0)
        tl.store(base + tokens, tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty),
                 mask=listed)


@functools.cache
def _kernel() -> Any:
    """JIT the kernel on first use (importing triton only then)."""
    global tl
    import triton
    import triton.language as tl

    return triton.jit(_min_tokens_kernel)


def min_tokens_triton(logits: torch.Tensor, slots: torch.Tensor, mask_ids: torch.Tensor,
                      num_mask_ids: torch.Tensor, num_generated: torch.Tensor,
                      min_tokens: torch.Tensor, block: int = _TRITON_BLOCK) -> None:
    """The Triton path: same result as ``min_tokens_torch``, in place.

    Runs on CUDA tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` was set before
    triton was imported (how the tests run it). ``logits`` is ``[rows, V]`` with unit stride
    along ``V``; ``block`` is a power of two. Row ``i`` reads only the first
    ``num_mask_ids[slots[i]]`` ids, and only while its slot is under its minimum.
    """
    if logits.shape[0] == 0:
        return
    if logits.stride(1) != 1:
        raise ValueError("min_tokens_triton needs logits contiguous along the vocabulary")
    _kernel()[(logits.shape[0],)](logits, logits.stride(0), slots, mask_ids, num_mask_ids,
                                  num_generated, min_tokens, mask_ids.stride(0), BLOCK=block,
                                  enable_fp_fusion=False)


# -- the processor ---------------------------------------------------------------------------

class MinTokens(LogitsProcessor):
    """min_tokens: no stop token until a sequence has generated min_tokens tokens."""

    class Fields(RequestFields):
        min_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None

    stage = Stage.HOLD
    argmax_invariant = False

    def __init__(self, ctx: ProcessorContext) -> None:
        super().__init__(ctx)
        max_num_slots, device = ctx.max_num_slots, ctx.device
        self.num_generated = torch.zeros(max_num_slots, dtype=torch.long, device=device)
        self.min_tokens = torch.zeros(max_num_slots, dtype=torch.long, device=device)
        self.num_mask_ids = torch.zeros(max_num_slots, dtype=torch.int32, device=device)
        self.mask_ids = torch.zeros((max_num_slots, _INITIAL_IDS), dtype=torch.long,
                                    device=device)
        self._widths = SlotWidths()  # host copy of num_mask_ids for the slots in use

    @property
    def width(self) -> int:
        """Most ids among the slots in use: the torch path's ``W``."""
        return self._widths.width

    @classmethod
    def uses(cls, fields: Fields) -> bool:
        return bool(fields.min_tokens)

    @classmethod
    def validate(cls, fields: Fields, model: ModelInfo, params: SamplingParams) -> Fields:
        """Refuse what ``max_tokens``, ``ignore_eos`` and ``stop_token_ids`` forbid
        (``check_against_request``), then clamp ``min_tokens`` to the context."""
        value = fields.min_tokens or 0
        check_against_request(value, params, model)
        return cls.Fields(min_tokens=min(value, model.max_model_len))

    def _grow(self, needed: int) -> None:
        capacity = 1 << (needed - 1).bit_length()
        grown = torch.zeros((self.max_num_slots, capacity), dtype=torch.long,
                            device=self.device)
        grown[:, :self.mask_ids.shape[1]] = self.mask_ids
        # Keep the "repeat the first id" padding of the rows already in use.
        grown[:, self.mask_ids.shape[1]:] = self.mask_ids[:, :1]
        self.mask_ids = grown

    def add_request(self, slot: int, request: RequestView) -> None:
        ids = stop_ids_of(request.params, self.model.eos_token_ids)
        count = len(ids)
        if count > self.mask_ids.shape[1]:
            self._grow(count)
        if ids:
            padded = ids + ids[:1] * (self.mask_ids.shape[1] - count)
            self.mask_ids[slot] = torch.tensor(padded, dtype=torch.long)
        else:
            self.mask_ids[slot] = 0
        self.num_mask_ids[slot] = count
        # A sequence never generates more than the context holds; clamping there keeps
        # a huge min_tokens inside int64 without changing what it does.
        self.min_tokens[slot] = min(request.fields.min_tokens, self.model.max_model_len)
        self.num_generated[slot] = len(request.output_token_ids)
        self._widths.set(slot, count)

    def remove_request(self, slot: int) -> None:
        self.min_tokens[slot] = 0
        self.num_mask_ids[slot] = 0
        self.mask_ids[slot] = 0
        self._widths.remove(slot)

    def update(self, slots: torch.Tensor, sampled: torch.Tensor) -> None:
        self.num_generated.index_add_(0, slots, torch.ones_like(slots))

    def apply(self, logits: torch.Tensor, slots: torch.Tensor) -> None:
        if logits.is_cuda:
            self.apply_triton(logits, slots)
        else:
            self.apply_torch(logits, slots)

    def apply_torch(self, logits: torch.Tensor, slots: torch.Tensor) -> None:
        min_tokens_torch(logits, slots, self.mask_ids, self.num_generated, self.min_tokens,
                         self.width)

    def apply_triton(self, logits: torch.Tensor, slots: torch.Tensor) -> None:
        min_tokens_triton(logits, slots, self.mask_ids, self.num_mask_ids, self.num_generated,
                          self.min_tokens)
