"""Native Llama-family causal LM (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2; with
mixture-of-experts MLPs, ``moe.py``: Qwen3-MoE, Qwen2-MoE, Mixtral, and gpt-oss, whose
blocks add attention sinks, biases on every projection and alternating sliding-window
layers).

Grouped-query attention with RoPE over the paged KV cache, RMSNorm, SwiGLU. q/k/v and
gate/up projections are fused into one GEMM each. Weights are plain tensors, the model is
inference-only and is called under ``torch.inference_mode()`` by the model runner.

As in vLLM, each block passes on its output and the residual stream separately, so that
the skip connection's add and the next RMSNorm are one step. On CPU the element-wise
steps (RMSNorm, add + RMSNorm, RoPE, SiLU-and-mul) run as fused native kernels where they
could be built (``freetoken_core/kernels``), else as torch operators.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from freetoken_core import hugepages
from freetoken_core.errors import ModelLoadError
from freetoken_core.kernels import cpu_kernels_available
from freetoken_core.models.attention import AttentionMetadata, paged_attention
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
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.gguf_weights import GGUF_TYPES
from freetoken_core.models.layers import (
    RotaryEmbedding,
    add_rms_norm,
    apply_rope,
    rms_norm,
    silu_and_mul,
)
from freetoken_core.models.linear import BlockArena, Embedding, make_linear
from freetoken_core.models.moe import SparseMoE
from freetoken_core.models.sharding import Shard, all_reduce, gather_logits, shard_weights

# Weights by Hugging Face name: float tensors, or GGUFWeight blocks (gguf_weights).
Weights = dict[str, Any]
# A linear's blocks in another layout (pack_blocks): the new type id, shape, and a function
# writing them into the tensor it is given.
Relayout = tuple[int, tuple[int, ...], Callable[[torch.Tensor], object]]


class DecoderLayer:
    """Transformer block ``index``; its weights come from ``weights`` under
    ``model.layers.{index}.``."""

    def __init__(self, cfg: ModelConfig, weights: Weights, index: int, native: bool,
                 arena: BlockArena | None = None) -> None:
        prefix = f"model.layers.{index}."

        def w(name: str) -> Any:
            return weights.pop(prefix + name)

        attn = "self_attn."
        bias = None
        if cfg.attention_bias:
            bias = torch.cat([w(attn + f"{p}_proj.bias") for p in "qkv"])
        self.qkv_proj = make_linear([w(attn + f"{p}_proj.weight") for p in "qkv"], bias, arena)
        # (Llama's attention_bias and gpt-oss's give the o projection one too; Qwen2's not.)
        o_bias = weights.pop(prefix + attn + "o_proj.bias", None)
        self.o_proj = make_linear([w(attn + "o_proj.weight")], o_bias, arena)
        self.sinks = None
        if cfg.attention_sinks:
            self.sinks = w(attn + "sinks").float().contiguous()
            if tuple(self.sinks.shape) != (cfg.num_heads,):
                raise ModelLoadError(f"{prefix}{attn}sinks has shape {list(self.sinks.shape)}; "
                                     f"expected [{cfg.num_heads}] (one per attention head)")
        self.moe = None
        if cfg.is_moe_layer(index):
            self.moe = SparseMoE(cfg, weights, prefix, native, arena)
            self.gate_up_proj = self.down_proj = None
            mlp_linears = self.moe.linears
        else:
            self.gate_up_proj = make_linear(
                [w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")], arena=arena)
            self.down_proj = make_linear([w("mlp.down_proj.weight")], arena=arena)
            mlp_linears = (self.gate_up_proj, self.down_proj)
        self.input_norm = w("input_layernorm.weight")
        self.post_attn_norm = w("post_attention_layernorm.weight")
        self.q_norm = w(attn + "q_norm.weight") if cfg.qk_norm else None
        self.k_norm = w(attn + "k_norm.weight") if cfg.qk_norm else None
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.native = native
        self.scale = cfg.query_scale  # None: head_dim ** -0.5
        self.residual_multiplier = cfg.residual_multiplier
        # The whole block in one native call (the same kernels in the same order, so the
        # same results) where it covers the layer: every linear from GGUF blocks, no bias,
        # no q/k norm, Llama's score scale, no sinks, no residual multiplier and a dense
        # MLP (the model takes it away from a layer with a sliding window).
        self.linears = (self.qkv_proj, self.o_proj, *mlp_linears)
        self.one_call = None
        if native and bias is None and o_bias is None and self.q_norm is None and (
                self.scale is None and self.sinks is None and self.moe is None) and (
                self.residual_multiplier == 1.0) and all(
                lin.blocks is not None for lin in self.linears):
            self.set_one_call_blocks()

    def set_one_call_blocks(self) -> None:
        """llama_layer's arguments for the linears: (blocks, type id) of each, in order."""
        self.one_call = [x for lin in self.linears for x in (lin.blocks[1], lin.blocks[0])]

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                 sin: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(output, residual)``: the hidden state is their sum. The first block gets
        ``residual=None`` and the embeddings as ``x``."""
        n, h, kvh, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.one_call is not None and meta.decode_block_tables is not None:
            return torch.ops.freetoken.llama_layer(
                x, residual, self.input_norm, self.post_attn_norm, self.eps, *self.one_call,
                cos, sin, kv_cache, meta.slot_mapping, meta.decode_block_tables,
                meta.decode_context_lens, meta.block_size, d ** -0.5, h, kvh, d)
        if residual is None:
            residual = x
            x = rms_norm(x, self.input_norm, self.eps, self.native)
        else:
            x, residual = add_rms_norm(x, residual, self.input_norm, self.eps, self.native)
        qkv = self.qkv_proj(x)
        qk, v = qkv.split([(h + kvh) * d, kvh * d], dim=-1)
        qk = qk.view(n, h + kvh, d)
        if self.q_norm is not None:  # per head (Qwen3): each head's d values a row
            qk = torch.cat([
                rms_norm(qk[:, :h].reshape(n * h, d).contiguous(), self.q_norm, self.eps,
                         self.native).view(n, h, d),
                rms_norm(qk[:, h:].reshape(n * kvh, d).contiguous(), self.k_norm, self.eps,
                         self.native).view(n, kvh, d)], dim=1)
        # One rotation for queries and keys together: they share positions.
        qk = apply_rope(qk, cos, sin, self.native)
        # Rotated keys and values side by side, as the cache stores them.
        kv = torch.cat([qk[:, h:], v.view(n, kvh, d)], dim=1).view(n, 2, kvh, d)
        x = self.o_proj(paged_attention(qk[:, :h], kv, kv_cache, meta, self.scale,
                                        self.sinks))
        if self.residual_multiplier != 1.0:
            x = x * self.residual_multiplier
        x, residual = add_rms_norm(x, residual, self.post_attn_norm, self.eps, self.native)
        if self.moe is not None:
            out = self.moe(x)
        else:
            out = self.down_proj(silu_and_mul(self.gate_up_proj(x), self.native))
        if self.residual_multiplier != 1.0:
            out = out * self.residual_multiplier
        return out, residual


class LlamaForCausalLM:
    """The whole model: ``forward`` gives hidden states, ``compute_logits`` float32 logits."""

    layer_class: type[DecoderLayer] = DecoderLayer  # a subclass's blocks (gemma3.py)

    def __init__(self, cfg: ModelConfig, weights: Weights, max_positions: int,
                 shard: Shard | None = None) -> None:
        """``weights`` by Hugging Face name: float tensors (a safetensors checkpoint), or
        ``GGUFWeight`` blocks for 2-d weights (a GGUF file read in place; the loader hands
        them over only in float32 on CPU with the native kernels), which the linears keep
        as blocks. Consumed: the dict is empty afterwards. ``shard``: this rank's part of a
        tensor-parallel model (``sharding``; ``forward`` then runs in step with the other
        ranks and ``compute_logits`` gives the whole vocabulary on rank 0 only)."""
        self.config = cfg
        layer_cfg, vocab_range = cfg, (0, cfg.vocab_size)
        if shard is not None and cfg.num_experts:
            raise ModelLoadError(
                f"tensor parallelism of a mixture-of-experts model ({cfg.architecture}) is "
                "not supported; serve it on one rank (data parallelism replicates it)")
        if shard is not None:
            layer_cfg, vocab_range = shard_weights(cfg, weights, shard)
        self.num_kv_heads = layer_cfg.num_kv_heads
        """KV heads of this rank's blocks (its KV cache's)."""
        embed = weights.pop("model.embed_tokens.weight")
        head = weights.pop("lm_head.weight", None)
        if head is None or cfg.tie_word_embeddings:
            head = embed
        arena = BlockArena.for_weights({**weights, "lm_head.weight": head, "embed": embed})
        self.lm_head = make_linear([head], arena=arena)
        if head is embed and self.lm_head.blocks is not None:
            self.embedding = Embedding(embed, blocks=self.lm_head.blocks)  # tied: one copy
        else:
            self.embedding = Embedding(embed, arena)
        # The native CPU kernels (attention's decode path too) or the torch operators.
        self.native = (self.embedding.device.type == "cpu"
                       and self.embedding.dtype in (torch.float32, torch.bfloat16)
                       and cpu_kernels_available())
        self.layers = [self.layer_class(layer_cfg, weights, i, self.native, arena)
                       for i in range(cfg.num_layers)]
        # Each layer's sliding window (``with_window``), None where it has none or where it
        # is as long as the context (it limits nothing); the one-call kernel attends to
        # every key, so a layer with a window leaves it.
        self.windows = [w if w is not None and w < max_positions else None
                        for w in (cfg.layer_windows or (None,) * cfg.num_layers)]
        for layer, window in zip(self.layers, self.windows):
            if window is not None:
                layer.one_call = None
        self.norm = weights.pop("model.norm.weight")
        self.uses_gguf_blocks = arena is not None
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta,
                                      cfg.rope_scaling, self.embedding.dtype,
                                      self.embedding.device)
        leftover = [k for k in weights if "rotary_emb" not in k]
        if leftover:
            raise ValueError(f"unused weights in checkpoint: {leftover[:5]}")
        if arena is None:
            self.pack_blocks()
        if shard is not None:
            self.join_ranks(shard, vocab_range[0])
        self.set_all_layers_args()

    def join_ranks(self, shard: Shard, vocab_start: int) -> None:
        """Tensor parallelism's communication (``sharding``): the o and down projections'
        partial sums and the embedding's rows all-reduced, the head's logits gathered on
        rank 0. The blocks leave the one-call native path, which has no room for them."""
        reduce = functools.partial(all_reduce, shard)
        for layer in self.layers:
            layer.one_call = None
            layer.o_proj.post = layer.down_proj.post = reduce
        self.embedding.shard(vocab_start, reduce)
        self.lm_head.post = functools.partial(gather_logits, shard,
                                              vocab_size=self.config.vocab_size)

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

    def set_all_layers_args(self) -> None:
        """llama_layers' per-layer arguments (norms, linears' blocks and type ids) and
        shapes, built once: a decode step passes them as they are (and the experts'
        arguments of their native call, ``SparseMoE.set_native_args``)."""
        self.all_layers_args = None
        for layer in self.layers:
            if layer.moe is not None:
                layer.moe.set_native_args()
        if all(layer.one_call is not None for layer in self.layers):
            first = self.layers[0]
            self.all_layers_args = (
                [layer.input_norm for layer in self.layers],
                [layer.post_attn_norm for layer in self.layers], first.eps,
                [b for layer in self.layers for b in layer.one_call[0::2]],
                [t for layer in self.layers for t in layer.one_call[1::2]])
            self.all_layers_shape = (first.head_dim ** -0.5, first.num_heads,
                                     first.num_kv_heads, first.head_dim)

    def use_int24_activations(self) -> bool:
        """Switch the linears to the integer kernel (``--activations int24``, the default
        where the CPU has AVX-512 VNNI): activations in 24-bit fixed point per block of 32,
        exact integer dot products (int_linear.cpp); as exact as the float32 kernel, and on
        AMX tiles from a few rows where the CPU has them. The linears of its types
        (``INT24_TYPES``: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
        IQ4_NL, IQ4_XS, MXFP4; a linear of parts where every part has one) switch; the
        others (F32, F16, BF16), and those whose outputs are not in whole groups of 16, keep
        the float32 kernel. False (nothing changed) where the native kernels lack it or no linear
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

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] of a flat step; writes the step's KV into the cache."""
        x = self.embedding(input_ids)
        if self.config.embedding_multiplier != 1.0:
            x = x * self.config.embedding_multiplier
        cos, sin = self.rotary.tables(positions)
        # Every block in one native call (what the loop below runs, block by block), unless
        # a block has left the one-call path (tests switch blocks to the Python path).
        if (meta.decode_block_tables is not None and self.all_layers_args is not None
                and all(layer.one_call is not None for layer in self.layers)):
            x, residual = torch.ops.freetoken.llama_layers(
                x, *self.all_layers_args, cos, sin, kv_caches, meta.slot_mapping,
                meta.decode_block_tables, meta.decode_context_lens, meta.block_size,
                *self.all_layers_shape)
            return add_rms_norm(x, residual, self.norm, self.config.rms_norm_eps,
                                self.native)[0]
        residual = None
        metas = {window: meta.with_window(window) for window in set(self.windows)}
        for layer, window, cache in zip(self.layers, self.windows, kv_caches):
            x, residual = layer(x, residual, cos, sin, cache, metas[window])
        return add_rms_norm(x, residual, self.norm, self.config.rms_norm_eps, self.native)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        return logits
