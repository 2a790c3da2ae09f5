"""The GGUF blocks as the native kernels read them: the float32 kernel's layout (widened Q4_1
scales, interleaved features), the 8-bit-activation kernel's and the int24 kernel's layouts
made from it, linears of several block types side by side (a header and their parts), and
the type-id bits that say which kernel a linear's blocks are for. ``linear`` builds the
layers from them."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from freetoken_core import hugepages
from freetoken_core.models.gguf_weights import GGUF_TYPES, GGUFWeight

if TYPE_CHECKING:
    from freetoken_core.models.linear import BlockArena

# ggml type id -> bytes per block of 32 weights in the file, for Q4_1 and Q8_0, the types
# the integer and 8-bit-activation kernels compute with too (int_linear.cpp, q8_linear.cpp).
GGUF_BLOCK_TYPES: dict[int, int] = {3: 20, 8: 34}  # Q4_1, Q8_0

# ggml type id -> (weights, bytes) of a unit of the kernels' layout as the file stores it,
# for every type the float32 linear kernel computes with (gguf_linear.cpp, gguf_types.h):
# the file's blocks, and for F32 / F16 / BF16 runs of 32 values.
NATIVE_UNITS: dict[int, tuple[int, int]] = {
    qtype: (32, 32 * size) if block == 1 else (block, size)
    for qtype, (_, block, size) in GGUF_TYPES.items()
}


# Set on a linear's ggml type id: the native kernel quantizes the activations to 8 bits per
# block of 32 (per 256 for the K-quants) and multiplies in integers (gguf_linear_q8; opt-in,
# `--activations q8`).
ACTIVATIONS_Q8 = 1 << 8

# The ggml types gguf_linear_q8 computes with (q8_linear.cpp): Q4_0, Q4_1, Q5_0, Q8_0, Q4_K,
# Q6_K, and Q5_K where the kernels have AVX2 (``q8_linear_supports``), by name for messages.
Q8_ACTIVATION_TYPES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K",
                       14: "Q6_K"}

# Set on a linear's ggml type id: the blocks are in the integer kernel's layout
# (``int_blocks``), and gguf_linear_int computes from them: the activations in 24-bit fixed
# point per block of 32, exact integer dot products (``--activations int24``; the default
# where the CPU has AVX-512 VNNI).
ACTIVATIONS_INT24 = 1 << 9


# gguf_linear's type id of a linear of parts of different block types (ops.h kParts): a
# fused q/k/v whose v has another type than q and k, as Q4_K_M files have it.
KIND_PARTS = 1 << 10


def parts_blocks(parts: list[tuple[int, torch.Tensor]], arena: BlockArena | None = None
                 ) -> torch.Tensor:
    """uint8 ``[1, bytes]``: the kernel-layout blocks of ``parts`` ((type, blocks) each, in
    output order) behind a header of int64 values that gguf_linear reads: KIND_PARTS, the
    part count, then per part its type, features, row bytes and the byte offset of its
    blocks (each on a cache line)."""
    offsets, end = _parts_offsets([blocks.numel() for _, blocks in parts])
    out = (arena.take((1, end)) if arena is not None
           else torch.zeros((1, end), dtype=torch.uint8))
    values = [KIND_PARTS, len(parts)]
    for (qtype, blocks), offset in zip(parts, offsets):
        values += [qtype, blocks.shape[0], blocks.shape[1], offset]
        out[0, offset:offset + blocks.numel()] = blocks.reshape(-1)
    out[0, :8 * len(values)] = torch.tensor(values, dtype=torch.int64).view(torch.uint8)
    return out


def _parts_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """A ``parts_blocks`` buffer of parts of ``sizes`` bytes: each part's offset, and the
    buffer's bytes."""
    offsets, end = [], (16 + 32 * len(sizes) + 63) // 64 * 64
    for size in sizes:
        offsets.append(end)
        end = (end + size + 63) // 64 * 64
    return offsets, end


def parts_rows(blocks: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """A ``parts_blocks`` buffer's parts: (type, its blocks ``[features, row bytes]``, a view
    of the buffer) each, in order."""
    count = int(blocks[0, :16].view(torch.int64)[1])
    values = blocks[0, :16 + 32 * count].view(torch.int64).tolist()
    parts = []
    for p in range(count):
        part_type, n, row_bytes, offset = values[2 + 4 * p:6 + 4 * p]
        parts.append((part_type, blocks[0, offset:offset + n * row_bytes].view(n, row_bytes)))
    return parts


def parts_types(blocks: torch.Tensor) -> list[int]:
    """The ggml types of a ``parts_blocks`` buffer's parts, in order."""
    return [t for t, _ in parts_rows(blocks)]


def parts_features(blocks: torch.Tensor) -> int:
    """The output features of a ``parts_blocks`` buffer: its parts' added up."""
    count = int(blocks[0, :16].view(torch.int64)[1])
    values = blocks[0, :16 + 32 * count].view(torch.int64)
    return int(sum(values[2 + 4 * p + 1] for p in range(count)))


# Features per group of the native kernels' block layout (gguf_blocks.h kGroup).
KERNEL_GROUP = 4

# Bytes of one unit of weights in the native kernels' layout (gguf_blocks.h block_bytes):
# Q4_1's two float16 scales widened to float32 (4 + 4 + 16 nibble bytes, where the file has
# 2 + 2 + 16), every other type as in the file (NATIVE_UNITS).
KERNEL_BLOCK_BYTES = {qtype: size for qtype, (_, size) in NATIVE_UNITS.items()} | {3: 24}


def _recast_scales(blocks: torch.Tensor, block_bytes: int, scale_bytes: int,
                   source: torch.dtype, target: torch.dtype) -> torch.Tensor:
    """Each ``block_bytes``-byte block's leading ``scale_bytes`` (its scales, of ``source``)
    rewritten as ``target``, block by block in place of each: the rest of the block as it
    was, the blocks in the order they were (interleaved or not)."""
    n = blocks.shape[0]
    split = blocks.reshape(n, -1, block_bytes)
    scales = split[:, :, :scale_bytes].contiguous().view(source).to(target)
    return torch.cat([scales.view(torch.uint8), split[:, :, scale_bytes:]], dim=2).reshape(n, -1)


def widen_scales(rows: torch.Tensor, qtype: int) -> torch.Tensor:
    """Q4_1 blocks with d and m as float32 (the same values: every float16 is a float32),
    ``[out, in / 32 * 24]``; Q8_0 rows as they are. The kernels then broadcast each scale
    with one load instead of converting and shuffling it: one row of the 30 layers' linears
    on the Zen 3 reference 8 % faster on two threads and 14 % on one (paired), for 20 % more
    bytes of weights (gguf_blocks.h)."""
    if qtype != 3:
        return rows
    return _recast_scales(rows, GGUF_BLOCK_TYPES[qtype], 4, torch.float16, torch.float32)


def narrow_scales(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """``widen_scales`` undone (Q4_1 scales back to float16, exactly: they were float16
    values), in either layout. The 8-bit-activation kernel reads the file's 20-byte Q4_1
    blocks."""
    if qtype != 3:
        return blocks
    return _recast_scales(blocks, KERNEL_BLOCK_BYTES[qtype], 8, torch.float32, torch.float16)


def q8_blocks(blocks: torch.Tensor, qtype: int, out: torch.Tensor | None = None
              ) -> torch.Tensor:
    """Kernel-layout blocks (``kernel_blocks``, or a ``parts_blocks`` buffer) in the layout
    the 8-bit-activation kernel reads (gguf_linear_q8): Q4_1 with the file's float16 scales
    (``narrow_scales``), Q4_K with its scales and mins unpacked to a byte each (148 bytes a
    super-block instead of 144), every other type as it is; where the kernels have AVX2
    (with or without AVX-512 VNNI), every type in groups of 16 features side by side, four
    weights of a feature a 32-bit lane (q8_linear.cpp's lanes layout; the same bytes a block
    as above, Q5_K 180 a super-block). ``out``: where to write them (``q8_shape``'s shape,
    uint8, contiguous), as ``int_blocks``'s."""
    ops = torch.ops.freetoken
    return _lay_out(blocks, qtype, out,
                    lambda rows, t: ops.gguf_q8_blocks(narrow_scales(rows, t), t),
                    lambda rows, t, into: ops.gguf_q8_blocks_into(narrow_scales(rows, t), t,
                                                                  into))


def q8_shape(qtype: int, blocks: torch.Tensor, in_features: int) -> tuple[int, int]:
    """The shape ``q8_blocks`` gives these kernel blocks of a linear of ``in_features`` (the
    kernel's bytes a feature, ``gguf_q8_row_bytes``)."""
    return _laid_shape(qtype, blocks, lambda t: torch.ops.freetoken.gguf_q8_row_bytes(
        t, in_features))


def _lay_out(blocks: torch.Tensor, qtype: int, out: torch.Tensor | None,
             lay: Callable[[torch.Tensor, int], torch.Tensor],
             lay_into: Callable[[torch.Tensor, int, torch.Tensor], object]) -> torch.Tensor:
    """Kernel blocks (or a ``parts_blocks`` buffer of them) in another layout: ``lay(rows,
    type)`` returns one type's, ``lay_into(rows, type, out)`` writes them into ``out``. A
    linear of parts is laid part by part into a new parts buffer (copied into ``out``, if
    given, and its pages given back at once)."""
    if qtype == KIND_PARTS:
        laid = parts_blocks([(t, lay(rows, t)) for t, rows in parts_rows(blocks)])
        if out is None:
            return laid
        out.copy_(laid)
        hugepages.release(laid)
        return out
    if out is None:
        return lay(blocks, qtype)
    lay_into(blocks, qtype, out)
    return out


def _laid_shape(qtype: int, blocks: torch.Tensor,
                row_bytes: Callable[[int], int]) -> tuple[int, int]:
    """The shape ``_lay_out`` gives these blocks, a type's bytes a feature ``row_bytes``."""
    if qtype == KIND_PARTS:
        return 1, _parts_offsets([rows.shape[0] * int(row_bytes(t))
                                  for t, rows in parts_rows(blocks)])[1]
    return blocks.shape[0], int(row_bytes(qtype))


def interleave_blocks(rows: torch.Tensor, block_bytes: int,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of ``block_bytes``-byte blocks in the native kernels' layout (a copy).

    ``rows``: uint8 ``[out, num blocks * block_bytes]``, one row of blocks per output
    feature. The result has the same shape and bytes, with the features in groups of
    ``KERNEL_GROUP`` (the last group what is left) and each group's blocks interleaved by
    block index: block ``b`` of the group's feature ``i`` at ``(b * group size + i) *
    block_bytes`` from the group's start. The kernels read a group's features side by side,
    so they read its bytes in address order (gguf_blocks.h).
    """
    n, row_bytes = rows.shape
    num_blocks = row_bytes // block_bytes
    if out is None:
        out = torch.empty((n, row_bytes), dtype=torch.uint8)
    full = n - n % KERNEL_GROUP
    for start, stop in ((0, full), (full, n)):
        size = min(KERNEL_GROUP, stop - start)
        if size == 0:
            continue
        groups = (stop - start) // size
        out[start:stop].view(groups, num_blocks, size, block_bytes).copy_(
            rows[start:stop].reshape(groups, size, num_blocks, block_bytes).transpose(1, 2))
    return out


def kernel_blocks(rows: torch.Tensor, qtype: int, arena: BlockArena | None = None
                  ) -> torch.Tensor:
    """A weight's GGUF blocks (``[out, in / 32 * block bytes]`` uint8, as the file stores
    them) as the native kernels read them: scales widened (``widen_scales``), then
    interleaved (``interleave_blocks``), into ``arena`` where given."""
    wide = widen_scales(rows, qtype)
    out = None if arena is None else arena.take(tuple(wide.shape))
    return interleave_blocks(wide, KERNEL_BLOCK_BYTES[qtype], out)


def kernel_bytes(rows_bytes: int, qtype: int) -> int:
    """Bytes of a weight's kernel-layout blocks, for ``rows_bytes`` bytes in the file."""
    return rows_bytes // NATIVE_UNITS[qtype][1] * KERNEL_BLOCK_BYTES[qtype]


def computes_natively(weight: GGUFWeight) -> bool:
    """Whether the native linear kernel computes with ``weight``'s blocks: a type it has and
    rows of whole units (F16 rows of a width that is not a multiple of 32 do not)."""
    return weight.qtype in NATIVE_UNITS and weight.shape[1] % NATIVE_UNITS[weight.qtype][0] == 0


# The ggml types the integer kernel computes with (int_linear.cpp), by name for messages.
INT24_TYPES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K", 11: "Q3_K",
               12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 20: "IQ4_NL", 23: "IQ4_XS", 39: "MXFP4"}


def int_blocks(blocks: torch.Tensor, qtype: int, out: torch.Tensor | None = None
               ) -> torch.Tensor:
    """Kernel blocks (``kernel_blocks``, or a ``parts_blocks`` buffer of them) in the integer
    kernel's layout (int_linear.cpp: the output features in groups of 16, four weights of a
    feature per 32-bit lane; bits a weight against the file's: Q4_0 and IQ4_NL 5 for 4.5,
    Q4_1 5 as the file, Q5_0 6 for 5.5, Q5_1 6 as the file, Q8_0 9 for 8.5, Q2_K 2.625 as
    the file, Q3_K 3.625 for 3.4375, Q4_K 4.625 for 4.5, Q5_K 5.625 for 5.5, Q6_K 6.625 for
    6.5625, IQ4_XS 4.375 for 4.25, MXFP4 4.25 as the file). ``out``: where to write them
    (``int_shape``'s shape, uint8, contiguous), e.g. their place in the model's arena, so
    that no temporary of the new layout is made (a linear of parts still makes one, given
    back at once)."""
    return _lay_out(blocks, qtype, out, torch.ops.freetoken.gguf_int_blocks,
                    torch.ops.freetoken.gguf_int_blocks_into)


def int_shape(qtype: int, blocks: torch.Tensor, in_features: int) -> tuple[int, int]:
    """The shape ``int_blocks`` gives these kernel blocks of a linear of ``in_features``
    (the kernel's bytes a feature, ``gguf_int_row_bytes``)."""
    return _laid_shape(qtype, blocks, lambda t: torch.ops.freetoken.gguf_int_row_bytes(
        t, in_features))


def int_computes(qtype: int, blocks: torch.Tensor, out_features: int) -> bool:
    """Whether the integer kernel computes a linear of these kernel blocks: its types (every
    part's, for a linear of parts) and output features in whole groups of 16 (each part's)."""
    if qtype == KIND_PARTS:
        return all(t in INT24_TYPES and rows.shape[0] % 16 == 0
                   for t, rows in parts_rows(blocks))
    return qtype in INT24_TYPES and out_features % 16 == 0


def int_linear_available() -> bool:
    """Whether the native kernels were built with the integer kernel (AVX-512 VNNI)."""
    return bool(torch.ops.freetoken.int_linear_available())
