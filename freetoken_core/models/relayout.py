"""The model's GGUF blocks in the layouts its kernels read (``LlamaForCausalLM`` takes
these methods from ``BlockLayouts``): every linear's blocks packed into one huge-page
buffer, and switched to the int24 kernel's layout (the exact default with AVX-512 VNNI) or
the q8 kernels' (``--activations q8``), one linear at a time, the old blocks' pages given
back as each new layout is written; the AMX tiles checked against VNNI on the model's own
linears.

The methods read the model's ``layers`` (each with ``linears`` and ``one_call``),
``lm_head``, ``embedding`` and ``native``, and call its ``set_all_layers_args``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from freetoken_core import hugepages
from freetoken_core.errors import ModelLoadError
from freetoken_core.models.block_layout import (
    ACTIVATIONS_INT24,
    ACTIVATIONS_Q8,
    KIND_PARTS,
    Q8_ACTIVATION_TYPES,
    int_blocks,
    int_computes,
    int_linear_available,
    int_shape,
    parts_types,
    q8_blocks,
    q8_shape,
)
from freetoken_core.models.gguf_weights import GGUF_TYPES

# A linear's blocks in another layout (pack_blocks): the new type id, shape, and a function
# writing them into the tensor it is given.
Relayout = tuple[int, tuple[int, ...], Callable[[torch.Tensor], object]]


class BlockLayouts:
    """The block-layout methods of ``LlamaForCausalLM`` (module docstring)."""

    layers: list[Any]
    lm_head: Any
    embedding: Any
    native: bool
    all_layers_args: Any
    set_all_layers_args: Callable[[], None]

    def pack_blocks(self, relayout: Callable[[Any], Relayout | None] | None = None) -> None:
        """Every linear's GGUF blocks moved into one buffer in huge pages (``hugepages``):
        a decode step reads all of them, and in 4 KiB pages each page was a TLB miss.

        ``relayout``: for a linear whose blocks change layout on the way
        (``use_int24_activations``, ``use_q8_activations``), its new type id, the new
        blocks' shape and a function writing them into a tensor, or None. Each new layout
        is written straight into its place in the buffer (no temporary: ``LLM`` on
        bench/gguf_memory.py's 3B shape loads in 4.9-5.4 s instead of 5.7 on the Zen 5
        VM), and the pages of the old blocks are given back at once (they share their
        buffer with the others, so dropping them would not), so that the model's blocks
        are never held twice: a 1B model's load peaked at the blocks twice over, ~600 MiB
        past tests/test_gguf_memory.py's bound, without it."""
        linears = [lin for layer in self.layers for lin in layer.linears] + [self.lm_head]
        linears = [lin for lin in linears if lin.blocks is not None]
        if not linears:
            return
        plans = [relayout(lin) if relayout is not None else None for lin in linears]
        shapes = [tuple(lin.blocks[1].shape) if plan is None else plan[1]
                  for lin, plan in zip(linears, plans)]
        # The views of the blocks that llama_layers' arguments hold (made again below, and by
        # set_all_layers_args) would keep every old buffer alive until the end: with them
        # dropped, each linear's old blocks go as its new ones are laid.
        self.all_layers_args = None
        for layer in self.layers:
            if layer.one_call is not None:
                layer.one_call = []
        align = 64  # each linear's blocks start on a cache line
        sizes = [(math.prod(shape) + align - 1) // align * align for shape in shapes]
        arena = hugepages.zeros((sum(sizes),), torch.uint8)
        offset = 0
        for lin, plan, shape, size in zip(linears, plans, shapes, sizes):
            qtype, blocks = lin.blocks
            packed = arena[offset:offset + math.prod(shape)].view(shape)
            if plan is None:
                packed.copy_(blocks)
            else:
                qtype, _, make = plan
                make(packed)
                hugepages.release(blocks)
            lin.blocks = (qtype, packed)
            offset += size
        del plans
        for layer in self.layers:
            if layer.one_call is not None:
                layer.set_one_call_blocks()

    def use_int24_activations(self) -> bool:
        """Switch the linears to the integer kernel (``--activations int24``, the default
        where the CPU has AVX-512 VNNI): activations in 24-bit fixed point per block of 32,
        exact integer dot products (int_linear.cpp); as exact as the float32 kernel, and on
        AMX tiles from a few rows where the CPU has them. The linears of its types
        (``INT24_TYPES``: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
        IQ4_NL, IQ4_XS, MXFP4; a linear of parts where every part has one) switch; the
        others (F32, F16, BF16, the IQ1/IQ2/IQ3 i-quants), and those whose outputs are not
        in whole groups of 16, keep the float32 kernel. False (nothing changed) where the native kernels lack it or no linear
        switches."""
        linears = [lin for layer in self.layers for lin in layer.linears] + [self.lm_head]
        linears = [lin for lin in linears if lin.blocks is not None
                   and int_computes(*lin.blocks, lin.out_features)]
        if not linears or not self.native or not int_linear_available():
            return False
        self.switch_layout(linears, ACTIVATIONS_INT24, int_shape, int_blocks)
        return True

    def switch_layout(self, linears: list[Any], flag: int,
                      shape: Callable[[int, torch.Tensor, int], tuple[int, int]],
                      lay: Callable[[torch.Tensor, int, torch.Tensor], torch.Tensor]) -> None:
        """``linears`` to another kernel's layout (``use_int24_activations``,
        ``use_q8_activations``): their type ids get ``flag``, and ``pack_blocks`` writes each
        one's new blocks (``shape(type, blocks, in_features)``, laid by ``lay(blocks, type,
        out)``) into their place in a new buffer. A tied embedding then reads the head's
        blocks in their new layout (gguf_int_embedding, gguf_q8_embedding); another keeps a
        copy of its own, as pack_blocks gives the old blocks' pages back."""
        tied = self.embedding.blocks is not None and self.embedding.blocks is self.lm_head.blocks
        if not tied:
            self.embedding.own_blocks()
        switching = {id(lin) for lin in linears}

        def relayout(lin: Any) -> Relayout | None:
            if id(lin) not in switching:
                return None
            qtype, blocks = lin.blocks
            return (qtype | flag, shape(qtype, blocks, lin.in_features),
                    lambda out: lay(blocks, qtype, out))

        self.pack_blocks(relayout)
        if tied:
            self.embedding.blocks = self.lm_head.blocks
        self.set_all_layers_args()

    def check_amx_tiles(self) -> str | None:
        """Where the int24 kernel computes on AMX tiles (from 8 rows): one linear of each
        type (a linear of parts: of each mix) computes 16 random rows on the tiles and on
        VNNI, which give the same floats by construction (int_linear.cpp); where they do not
        on this machine, the tiles are turned off for the process (``gguf_int_amx_allow``)
        and what disagreed is returned, else None. A few milliseconds at load, only on CPUs
        with AMX (kernels/__init__.py has already checked in a child process that the tiles
        run here at all)."""
        ops = torch.ops.freetoken
        if not self.native or not int_linear_available() or not list(ops.gguf_int_amx_types()):
            return None
        smallest: dict[object, Any] = {}
        for lin in [lin for layer in self.layers for lin in layer.linears] + [self.lm_head]:
            if lin.blocks is None or not lin.blocks[0] & ACTIVATIONS_INT24:
                continue
            qtype, blocks = lin.blocks[0] & ~ACTIVATIONS_INT24, lin.blocks[1]
            key = tuple(parts_types(blocks)) if qtype == KIND_PARTS else qtype
            size = lin.in_features * lin.out_features
            if key not in smallest or size < smallest[key][0]:
                smallest[key] = (size, lin, qtype, blocks)
        gen = torch.Generator().manual_seed(0)
        for key, (_, lin, qtype, blocks) in smallest.items():
            x = torch.randn(16, lin.in_features, generator=gen)
            tiles, vnni = (torch.empty(16, lin.out_features) for _ in range(2))
            ops.gguf_linear_int(x, blocks, qtype, tiles, 0)
            ops.gguf_linear_int(x, blocks, qtype, vnni, 2)
            if not torch.equal(tiles, vnni):
                ops.gguf_int_amx_allow(False)
                names = "+".join(GGUF_TYPES[t][0] for t in (key if isinstance(key, tuple)
                                                            else (key,)))
                return (f"a {lin.out_features}x{lin.in_features} {names} linear's floats on "
                        "the AMX tiles differ from VNNI's")
        return None

    def use_q8_activations(self) -> list[str]:
        """Switch the linears whose GGUF blocks have an 8-bit kernel (Q4_0, Q4_1, Q5_0, Q8_0,
        Q4_K, Q5_K (AVX2), Q6_K; a linear of parts where every part has) to 8-bit activations
        (``--activations q8``): llama.cpp's arithmetic, not exact. The others keep the
        float32 kernel; their descriptions are returned (empty when every linear
        switched). Needs at least one such linear: a GGUF model, float32, on CPU with the
        native kernels."""
        linears = [lin for layer in self.layers for lin in layer.linears] + [self.lm_head]
        if any(lin.blocks is not None and lin.blocks[0] & ACTIVATIONS_INT24 for lin in linears):
            raise ModelLoadError("--activations q8: the linears already use the int24 kernel")

        def types(lin: Any) -> list[int]:
            qtype, blocks = lin.blocks
            return parts_types(blocks) if qtype == KIND_PARTS else [qtype]

        def switches(lin: Any) -> bool:
            # (Q4_1 inside a linear of parts has the float32 kernel's widened scales.)
            return lin.blocks is not None and all(
                t in Q8_ACTIVATION_TYPES and torch.ops.freetoken.q8_linear_supports(t)
                and not (t == 3 and lin.blocks[0] == KIND_PARTS)
                for t in types(lin))

        chosen = [lin for lin in linears if switches(lin)]
        if not chosen:
            raise ModelLoadError(
                "--activations q8 needs linears as GGUF blocks of "
                f"{'/'.join(Q8_ACTIVATION_TYPES.values())}: a GGUF model of those types, "
                "dtype float32, on CPU with the native kernels "
                f"(here: native={self.native}, dtype={self.embedding.dtype}, GGUF blocks "
                f"for {sum(lin.blocks is not None for lin in linears)} of {len(linears)} "
                "linears)")
        kept = []
        for lin in linears:
            if lin.blocks is None:
                kept.append("a float linear")
            elif not switches(lin):
                names = "+".join(GGUF_TYPES[t][0] if t in GGUF_TYPES else str(t)
                                 for t in types(lin))
                kept.append(f"{lin.out_features}x{lin.in_features} {names}")
        self.switch_layout(chosen, ACTIVATIONS_Q8, q8_shape, q8_blocks)
        return kept
