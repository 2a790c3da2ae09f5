"""The logit_bias plugin: add a per-request bias to chosen tokens' logits (OpenAI ``logit_bias``).

Request field (``LogitBias.Fields``): ``logit_bias``, a mapping from token id to bias, of
at most ``MAX_ENTRIES`` (1,024) entries (the type says so; more is a 400). Keys are
integers, or strings of integers as OpenAI's JSON sends them (``{"42": 5}``); each must be
a token id in ``[0, vocab_size)``. Values are finite numbers, clamped to ``[-100, 100]``
(OpenAI's range: ``-100`` all but bans a token, ``+100`` all but forces it); an integer
too large for a float is clamped too. Two keys naming the same token (``"42"`` and ``42``,
``"042"``) are refused. ``validate`` checks what the type cannot (key syntax and range,
finiteness, duplicates) and returns the field as ``{int token id: float bias}``. An empty
mapping is accepted and costs nothing (the request does not use the processor).

Semantics: before everything else in the pipeline (stage ``LOGIT_BIAS``), ``logits[t] +=
bias[t]`` for every listed token ``t``, in float32. Same as Hugging Face's
``SequenceBiasLogitsProcessor`` with single-token sequences ``{(t,): bias}`` and vLLM's
``logit_bias``. Not ``argmax_invariant`` (a bias moves the argmax).

State (sparse: nothing is sized by the vocabulary), preallocated for ``S`` slots:

- ``token_ids``: int64 ``[S, MAX_ENTRIES]``, the slot's token ids, then padding ``0``;
- ``biases``: float32 ``[S, MAX_ENTRIES]``, the biases, then padding ``0.0``;
- ``num_entries``: int32 ``[S]``, how many entries are real.

That is ``S * (12 * MAX_ENTRIES + 4)`` bytes = ``12,292 * S`` bytes whatever the vocabulary
``V`` (3.0 MiB for 256 slots, at ``V = 151,936`` as at any other). A slot's rows are written
once in ``add_request`` and zeroed in ``remove_request``; a slot whose request does not use
logit_bias holds only padding, which adds ``0.0`` to token 0 and so changes nothing.

Cost per step: the torch path (``logit_bias_torch``, any device) is one ``scatter_add_`` of
``[rows, W]`` biases, where ``W`` is the largest number of entries among the slots in use
(tracked on the host, so no device sync); padding adds ``0.0``, which keeps duplicate
indices harmless. On CUDA one Triton launch (``logit_bias_triton``): one program per row
that loads the row's own ``num_entries`` and touches only those tokens (gather, add,
store; the ids of a row are distinct, so there is no race). ``O(rows * entries)``, never
``O(rows * V)``.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Annotated, Any

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

FIELD = "logit_bias"
MAX_ENTRIES = 1024
"""Most entries one request's ``logit_bias`` may hold; more is a 400."""
BIAS_LIMIT = 100.0
"""Biases are clamped to ``[-BIAS_LIMIT, BIAS_LIMIT]``."""
Biases = Annotated[dict[int | str, int | float], msgspec.Meta(max_length=MAX_ENTRIES)]
"""As sent: keys are token ids or strings of them (JSON object keys are strings); values
are numbers, integers kept apart so that one too large for a float is clamped, not
refused."""
BENCH_PARAMS: dict[str, Any] = {
    FIELD: {10 + 31 * i: (5.0 if i % 2 else -5.0) for i in range(20)}}
"""A typical request (20 biased tokens, ids < 642 so that the tiny test model takes it too)."""

_TRITON_BLOCK = 64
_INT_KEY = re.compile(r"-?[0-9]{1,19}")

tl: Any = None
"""``triton.language``, bound by ``_kernel()`` on first use: importing the plugin never
imports triton, and the kernel below finds ``tl`` among its module's globals as Triton
(compiler and interpreter alike) expects."""


# -- validation ------------------------------------------------------------------------------

def _token_id(key: int | str, vocab_size: int) -> int:
    if isinstance(key, str) and not _INT_KEY.fullmatch(key):
        raise InvalidRequest(FIELD, f"logit_bias keys must be token ids (integers or strings "
                                    f"of integers), got {key!r}")
    token = int(key)
    if not 0 <= token < vocab_size:
        raise InvalidRequest(FIELD, f"logit_bias key {key!r} is not a token id in "
                                    f"[0, {vocab_size})")
    return token


def _bias(token: int, value: float) -> float:
    if isinstance(value, int):  # an int may be too large for a float: clamp first
        return float(min(max(value, -100), 100))
    if not math.isfinite(value):
        raise InvalidRequest(FIELD, f"the logit_bias of token {token} must be finite, "
                                    f"got {value!r}")
    return min(max(value, -BIAS_LIMIT), BIAS_LIMIT)


def check_logit_bias(value: dict[int | str, float], vocab_size: int) -> dict[int, float]:
    """Return ``value`` (typed as ``Biases``) as ``{token id: clamped bias}``, or raise
    ``InvalidRequest``."""
    biases: dict[int, float] = {}
    for key, bias in value.items():
        token = _token_id(key, vocab_size)
        if token in biases:
            raise InvalidRequest(FIELD, f"logit_bias names token {token} twice")
        biases[token] = _bias(token, bias)
    return biases


# -- the two paths -------------------------------------------------------------------------

def logit_bias_torch(logits: torch.Tensor, slots: torch.Tensor, token_ids: torch.Tensor,
                     biases: torch.Tensor, width: int) -> None:
    """Add in place the first ``width`` biases of slot ``slots[i]`` to row ``i``; any device.

    Entries past a slot's own count must be padding (token 0, bias 0.0)."""
    if width == 0 or logits.shape[0] == 0:
        return
    logits.scatter_add_(1, token_ids[slots, :width], biases[slots, :width])


def _logit_bias_kernel(logits_ptr, row_stride, slots_ptr, token_ids_ptr, biases_ptr,
                       num_entries_ptr, state_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    count = tl.load(num_entries_ptr + slot)
    base = logits_ptr + row * row_stride
    for start in range(0, count, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        listed = offsets < count
        tokens = tl.load(token_ids_ptr + slot * state_stride + offsets, mask=listed, other=0)
        bias = tl.load(biases_ptr + slot * state_stride + offsets, mask=listed, other=0.0)
        x = tl.load(base + tokens, mask=listed, other=0.0)
        tl.store(base + tokens, x + bias, mask=listed)


@functools.cache
def _kernel() -> Any:
    """JIT the kernel on first use (importing triton only then)."""
    global tl
    import triton
    import triton.language as tl

    return triton.jit(_logit_bias_kernel)


def logit_bias_triton(logits: torch.Tensor, slots: torch.Tensor, token_ids: torch.Tensor,
                      biases: torch.Tensor, num_entries: torch.Tensor,
                      block: int = _TRITON_BLOCK) -> None:
    """The Triton path: same result as ``logit_bias_torch``, in place.

    Runs on CUDA tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` was set before
    triton was imported (how the tests run it). ``logits`` is float32 ``[rows, V]`` with
    unit stride along ``V``; ``token_ids`` and ``biases`` share their strides; ``block`` is
    a power of two. Row ``i`` reads only the first ``num_entries[slots[i]]`` entries.
    """
    if logits.shape[0] == 0:
        return
    if logits.stride(1) != 1 or token_ids.stride() != biases.stride():
        raise ValueError("logit_bias_triton needs unit stride along the vocabulary and "
                         "token_ids / biases of one layout")
    _kernel()[(logits.shape[0],)](logits, logits.stride(0), slots, token_ids, biases,
                                  num_entries, token_ids.stride(0), BLOCK=block,
                                  enable_fp_fusion=False)


# -- the processor ---------------------------------------------------------------------------

class LogitBias(LogitsProcessor):
    """logit_bias: add a per-request bias to chosen tokens' logits (OpenAI ``logit_bias``)."""

    class Fields(RequestFields):
        logit_bias: Biases | None = None

    stage = Stage.BIAS
    argmax_invariant = False

    def __init__(self, ctx: ProcessorContext) -> None:
        super().__init__(ctx)
        shape = (ctx.max_num_slots, MAX_ENTRIES)
        self.token_ids = torch.zeros(shape, dtype=torch.long, device=ctx.device)
        self.biases = torch.zeros(shape, dtype=torch.float32, device=ctx.device)
        self.num_entries = torch.zeros(ctx.max_num_slots, dtype=torch.int32, device=ctx.device)
        self._widths = SlotWidths()  # host copy of num_entries for the slots in use

    @property
    def width(self) -> int:
        """Largest entry count among the slots in use: the torch path's ``W``."""
        return self._widths.width

    @classmethod
    def uses(cls, fields: Fields) -> bool:
        return bool(fields.logit_bias)

    @classmethod
    def validate(cls, fields: Fields, model: ModelInfo, params: Any) -> Fields:
        return cls.Fields(logit_bias=check_logit_bias(fields.logit_bias or {},
                                                      model.vocab_size))

    def add_request(self, slot: int, request: RequestView) -> None:
        entries = request.fields.logit_bias
        count = len(entries)
        self.remove_request(slot)
        self.token_ids[slot, :count] = torch.tensor(list(entries), dtype=torch.long)
        self.biases[slot, :count] = torch.tensor(list(entries.values()), dtype=torch.float32)
        self.num_entries[slot] = count
        self._widths.set(slot, count)

    def remove_request(self, slot: int) -> None:
        self.token_ids[slot].zero_()
        self.biases[slot].zero_()
        self.num_entries[slot] = 0
        self._widths.remove(slot)

    def apply(self, logits: torch.Tensor, slots: torch.Tensor) -> None:
        if logits.is_cuda:
            self.apply_triton(logits, slots)
        else:
            self.apply_torch(logits, slots)

    def apply_torch(self, logits: torch.Tensor, slots: torch.Tensor) -> None:
        logit_bias_torch(logits, slots, self.token_ids, self.biases, self.width)

    def apply_triton(self, logits: torch.Tensor, slots: torch.Tensor) -> None:
        logit_bias_triton(logits, slots, self.token_ids, self.biases, self.num_entries)
