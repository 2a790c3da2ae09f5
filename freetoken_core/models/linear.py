"""Linear layers of the native models and the GGUF blocks they compute from: the huge-page
arena the blocks are laid into at load, linears of several block types side by side, the
embedding decoded from blocks, and ``Linear`` itself (GGUF blocks, oneDNN-packed float32, or
``F.linear``). The blocks' layouts are ``block_layout``'s."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from freetoken_core import hugepages
from freetoken_core.errors import ModelLoadError
from freetoken_core.models.block_layout import (
    ACTIVATIONS_INT24,
    ACTIVATIONS_Q8,
    KIND_PARTS,
    computes_natively,
    kernel_blocks,
    kernel_bytes,
    parts_blocks,
    parts_features,
)
from freetoken_core.models.gguf_weights import GGUFWeight


def _can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


# Linears built while this is True compute from their GGUF blocks where they have them, at
# every row count (the native kernel's panels reuse each dequantized block across rows), so
# a row's output never depends on how many rows share its step. False: the float32 oneDNN
# GEMM instead (bench/decode_step.py builds a model each way and compares them).
USE_GGUF_BLOCKS = True

class BlockArena:
    """One buffer in huge pages (``hugepages``) that the linears' kernel-layout blocks are
    laid into as they are built, each on a cache line: a decode step reads all of them, and
    in 4 KiB pages each page was a TLB miss. Sized up front, so that loading never holds the
    blocks twice."""

    ALIGN = 64

    def __init__(self, num_bytes: int) -> None:
        self.buffer = hugepages.zeros((max(num_bytes, 1),), torch.uint8)
        self.offset = 0

    def take(self, shape: tuple[int, int]) -> torch.Tensor:
        """The next ``shape`` uint8 tensor of the buffer."""
        size = shape[0] * shape[1]
        if self.offset + size > self.buffer.numel():
            raise ModelLoadError("the block arena was sized too small; report this")
        view = self.buffer[self.offset:self.offset + size].view(shape)
        self.offset += (size + self.ALIGN - 1) // self.ALIGN * self.ALIGN
        return view

    @classmethod
    def for_weights(cls, weights: dict[str, object]) -> BlockArena | None:
        """An arena for every weight of ``weights`` that the kernels compute from; ``None``
        if there is none."""
        unique = {id(w): w for w in weights.values()}.values()  # a tied head counts once
        # (each weight's room for its alignment, or for a parts header: parts_blocks)
        total = sum(kernel_bytes(w.nbytes, w.qtype) + 4 * cls.ALIGN for w in unique
                    if isinstance(w, GGUFWeight) and computes_natively(w))
        return cls(total) if total and USE_GGUF_BLOCKS else None


def make_linear(parts: Sequence[torch.Tensor | GGUFWeight], bias: torch.Tensor | None = None,
                arena: BlockArena | None = None) -> Linear:
    """One linear computing the weights ``parts`` stacked by rows (a fused q/k/v or
    gate/up): float tensors concatenated; GGUF weights kept as their blocks where the
    kernels compute with their type (several types side by side: one linear each, their
    outputs concatenated), else dequantized to float32."""
    if all(isinstance(p, GGUFWeight) for p in parts) and USE_GGUF_BLOCKS and all(
            computes_natively(p) for p in parts):
        runs: list[list[GGUFWeight]] = []
        for p in parts:
            if runs and runs[-1][0].qtype == p.qtype:
                runs[-1].append(p)
            else:
                runs.append([p])
        if len(runs) == 1:
            linear = Linear(None, bias, blocks=(runs[0][0].qtype, _stacked_rows(runs[0])),
                            in_features=runs[0][0].shape[1], arena=arena)
        else:
            laid_out = [(run[0].qtype, kernel_blocks(_stacked_rows(run), run[0].qtype))
                        for run in runs]
            linear = Linear(None, bias, blocks=(KIND_PARTS, parts_blocks(laid_out, arena)),
                            in_features=runs[0][0].shape[1], laid_out=True)
        for p in parts:
            p.release()
        return linear
    weights = [p.dequantize() if isinstance(p, GGUFWeight) else p for p in parts]
    return Linear(torch.cat(weights) if len(weights) > 1 else weights[0], bias)


def _stacked_rows(parts: list[GGUFWeight]) -> torch.Tensor:
    """The parts' rows of blocks, one after the other, as a uint8 tensor (a view of the
    file's mapping where there is one part: only read, while it is laid out)."""
    rows = parts[0].rows if len(parts) == 1 else np.concatenate([p.rows for p in parts])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.ascontiguousarray(rows))


class Embedding:
    """The token embedding: rows of a float tensor, or of a GGUF weight's blocks decoded
    row by row (the kernels' layout, ``kernel_blocks``; a tied output head's very blocks
    where ``blocks`` hands them over, in the int24 or the 8-bit kernel's layout too once
    the head has switched to it), so no float32 copy of the vocabulary is made, nor a
    second copy of its blocks."""

    def __init__(self, weight: torch.Tensor | GGUFWeight, arena: BlockArena | None = None,
                 blocks: tuple[int, torch.Tensor] | None = None) -> None:
        self.blocks = None
        self.weight = None
        self.vocab_start, self.reduce = 0, None  # shard()
        if isinstance(weight, GGUFWeight) and USE_GGUF_BLOCKS and computes_natively(weight):
            self.num_embeddings, self.embedding_dim = weight.shape
            self.blocks = blocks or (weight.qtype, kernel_blocks(
                _stacked_rows([weight]), weight.qtype, arena))
            weight.release()
            self.dtype, self.device = torch.float32, torch.device("cpu")
            return
        if isinstance(weight, GGUFWeight):
            weight = weight.dequantize()
        self.weight = weight
        self.num_embeddings, self.embedding_dim = weight.shape
        self.dtype, self.device = weight.dtype, weight.device

    def own_blocks(self) -> None:
        """Keep a copy of the blocks of its own (before the buffer they lie in is replaced:
        a view would keep all of that buffer alive)."""
        if self.blocks is not None:
            self.blocks = (self.blocks[0], self.blocks[1].clone())

    def shard(self, start: int, reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Tensor parallelism: this embedding holds the rows of tokens ``start:start +
        num_embeddings``; a token outside them embeds as zeros, and ``reduce`` (the sum over
        the ranks) makes every token's row whole (``sharding``)."""
        self.vocab_start, self.reduce = start, reduce

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        outside = None
        if self.reduce is not None:
            ids = ids - self.vocab_start
            outside = (ids < 0) | (ids >= self.num_embeddings)
            ids = ids.masked_fill(outside, 0)
        if self.blocks is not None:
            qtype, blocks = self.blocks
            op = (torch.ops.freetoken.gguf_int_embedding if qtype & ACTIVATIONS_INT24
                  else torch.ops.freetoken.gguf_q8_embedding if qtype & ACTIVATIONS_Q8
                  else torch.ops.freetoken.gguf_embedding_blocks)
            out = op(ids.reshape(-1).contiguous(), blocks,
                     qtype & ~(ACTIVATIONS_INT24 | ACTIVATIONS_Q8), self.embedding_dim)
        else:
            out = F.embedding(ids, self.weight)
        if outside is None:
            return out
        return self.reduce(out.masked_fill_(outside.reshape(-1, 1), 0))



class Linear:
    """``y = x @ W.T + b`` with the weight laid out for the fastest kernel of the device.

    On CPU in float32 the weight is reordered once into oneDNN's blocked layout, which
    runs the small-batch GEMMs of decoding about twice as fast as the plain layout
    (``bench/`` has the figures); elsewhere it is ``F.linear``. ``blocks`` (ggml type id,
    uint8 rows) are the same weight as a GGUF file stores it (Q4_1 or Q8_0); where given,
    the native kernel computes from them for any number of rows, each row summed in one
    order whatever the others (batch-invariant); they are kept in the kernels' layout
    (``kernel_blocks``).
    """

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None = None,
                 pack: bool = True, blocks: tuple[int, torch.Tensor] | None = None,
                 in_features: int | None = None, arena: BlockArena | None = None,
                 laid_out: bool = False) -> None:
        """``weight`` may be ``None`` where ``blocks`` (with ``in_features``) give the
        weight: the file's rows, laid out here (into ``arena`` where given), or with
        ``laid_out`` already in the kernels' layout."""
        self.bias = bias
        self.blocks = None
        self.packed = False
        self.weight = None
        self.post: Callable[[torch.Tensor], torch.Tensor] | None = None
        """Applied to every output (tensor parallelism's all-reduce or gather:
        ``sharding``)."""
        if weight is not None:
            self.out_features, self.in_features = weight.shape
        elif blocks[0] == KIND_PARTS:
            self.out_features, self.in_features = parts_features(blocks[1]), in_features
        else:
            self.out_features, self.in_features = blocks[1].shape[0], in_features
        if blocks is not None and laid_out:
            self.blocks = blocks
        elif blocks is not None and USE_GGUF_BLOCKS:
            self.blocks = (blocks[0], kernel_blocks(blocks[1], blocks[0], arena))
        if self.blocks is not None:
            # The blocks are the weight: no float32 copy is kept (6.4x the memory for Q4_1).
            return
        if weight is None:
            raise ModelLoadError("a linear without blocks needs its weight")
        if pack and _can_pack(weight):
            self.packed = True
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 16)
        else:
            self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self._compute(x)
        return out if self.post is None else self.post(out)

    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocks is not None:
            out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
            qtype, blocks = self.blocks
            if qtype & ACTIVATIONS_INT24:
                torch.ops.freetoken.gguf_linear_int(x.contiguous(), blocks,
                                                    qtype & ~ACTIVATIONS_INT24, out)
            elif qtype & ACTIVATIONS_Q8:
                torch.ops.freetoken.gguf_linear_q8(x.contiguous(), blocks,
                                                   qtype & ~ACTIVATIONS_Q8, out)
            else:
                torch.ops.freetoken.gguf_linear(x.contiguous(), blocks, qtype, out)
            return out if self.bias is None else out.add_(self.bias)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class HeadLinears:
    """One linear per head over each head's slice of the input: ``x`` [T, heads, K] to [T,
    heads, N], head ``i`` through ``linears[i]``. Where every head's weight is GGUF blocks,
    the heads run in one native call (``gguf_linear_heads``: each on its linear's kernel, the
    same floats as the calls one by one, without a Python call and an operator dispatch a
    head: DeepSeek-V3's GGUF files have two such linears of 128 heads a layer); else one
    call a head. The blocks are read from the linears at each call, as loading may lay
    them out again (``relayout``)."""

    def __init__(self, linears: Sequence[Linear]) -> None:
        self.linears = tuple(linears)
        self.out_features = self.linears[0].out_features
        self.one_call = True
        """False: one call a head even where the blocks allow one call (the tests'
        reference)."""

    def __len__(self) -> int:
        return len(self.linears)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.one_call and all(lin.blocks is not None and lin.bias is None
                                 and lin.post is None for lin in self.linears):
            out = torch.empty(x.shape[0], len(self.linears), self.out_features, dtype=x.dtype,
                              device=x.device)
            torch.ops.freetoken.gguf_linear_heads(
                x.contiguous(), [lin.blocks[1] for lin in self.linears],
                [lin.blocks[0] for lin in self.linears], out)
            return out
        return torch.stack([lin(x[:, i].contiguous()) for i, lin in enumerate(self.linears)],
                           dim=1)
