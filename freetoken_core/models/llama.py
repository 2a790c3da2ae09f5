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

import dataclasses
import functools
from typing import Any

import torch
import torch.nn.functional as F

from freetoken_core.errors import ModelLoadError
from freetoken_core.kernels import cpu_kernels_available
from freetoken_core.models.apertus import XIELU
from freetoken_core.models.attention import AttentionMetadata, paged_attention
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.layers import (
    RotaryEmbedding,
    add_rms_norm,
    apply_rope,
    rms_norm,
    silu_and_mul,
)
from freetoken_core.models.linear import BlockArena, Embedding, make_linear
from freetoken_core.models.moe import SparseMoE
from freetoken_core.models.relayout import BlockLayouts
from freetoken_core.models.sharding import Shard, all_reduce, gather_logits, shard_weights

# Weights by Hugging Face name: float tensors, or GGUFWeight blocks (gguf_weights).
Weights = dict[str, Any]


class DecoderLayer:
    """Transformer block ``index``; its weights come from ``weights`` under
    ``model.layers.{index}.``."""

    moe_class: type[SparseMoE] = SparseMoE  # (a subclass's experts: llama4.py)

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
            self.moe = self.moe_class(cfg, weights, prefix, native, arena)
            self.gate_up_proj = self.down_proj = None
            mlp_linears = self.moe.linears
        else:
            # (biases where the checkpoint has them: ERNIE 4.5's use_bias; no gate where the
            # MLP is not gated: Arcee's up projection alone)
            parts = ("gate", "up") if cfg.gated_mlp else ("up",)
            gate_up_bias = [weights.pop(f"{prefix}mlp.{p}_proj.bias", None) for p in parts]
            self.gate_up_proj = make_linear(
                [w(f"mlp.{p}_proj.weight") for p in parts],
                None if gate_up_bias[0] is None else torch.cat(gate_up_bias), arena)
            self.down_proj = make_linear([w("mlp.down_proj.weight")],
                                         weights.pop(prefix + "mlp.down_proj.bias", None), arena)
            mlp_linears = (self.gate_up_proj, self.down_proj)
        # (Apertus's xIELU: its four scalars a layer, apertus.py)
        self.xielu = XIELU(weights, prefix + "mlp.act_fn.") if cfg.hidden_act == "xielu" else None
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
        self.softcap = cfg.attn_logit_softcap or 0.0  # the scores' (Gemma 2); 0: none
        self.residual_multiplier = cfg.residual_multiplier
        self.gated, self.act = cfg.gated_mlp, cfg.hidden_act
        self.norm_after_rope = cfg.qk_norm_after_rope
        # The whole block in one native call (the same kernels in the same order, so the
        # same results) where it covers the layer: every linear from GGUF blocks, no bias,
        # no q/k norm, Llama's score scale, no sinks or softcap, no residual multiplier and a
        # dense SwiGLU MLP (the model takes it away from a layer with a sliding window).
        self.linears = (self.qkv_proj, self.o_proj, *mlp_linears)
        self.one_call = None
        if native and self.q_norm is None and all(lin.bias is None for lin in self.linears) and (
                self.scale is None and self.sinks is None and self.moe is None
                and not self.softcap and self.gated) and (
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
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        if (self.one_call is not None and meta.decode_block_tables is not None
                and meta.query_scales is None):
            return torch.ops.freetoken.llama_layer(
                x, residual, self.input_norm, self.post_attn_norm, self.eps, *self.one_call,
                cos, sin, kv_cache, meta.slot_mapping, meta.decode_block_tables,
                meta.decode_context_lens, meta.block_size, d ** -0.5, h, kvh, d)
        if residual is None:
            residual = x
            x = rms_norm(x, self.input_norm, self.eps, self.native)
        else:
            x, residual = add_rms_norm(x, residual, self.input_norm, self.eps, self.native)
        x = self.self_attention(x, cos, sin, kv_cache, meta)
        if self.residual_multiplier != 1.0:
            x = x * self.residual_multiplier
        x, residual = add_rms_norm(x, residual, self.post_attn_norm, self.eps, self.native)
        out = self.mlp(x)
        if self.residual_multiplier != 1.0:
            out = out * self.residual_multiplier
        return out, residual

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP of the normed hidden states ``x``: the experts, SwiGLU, or (not gated)
        ``down(act(up(x)))`` with transformers' ``relu2`` (Arcee's: relu squared),
        ``xielu`` (Apertus's) or ``gelu_pytorch_tanh`` (StarCoder2's)."""
        if self.moe is not None:
            return self.moe(x)
        if self.gated:
            return self.down_proj(silu_and_mul(self.gate_up_proj(x), self.native))
        up = self.gate_up_proj(x)
        if self.xielu is not None:
            return self.down_proj(self.xielu(up))
        if self.act == "relu2":
            return self.down_proj(torch.square(torch.relu(up)))
        return self.down_proj(F.gelu(up, approximate="tanh"))  # (StarCoder2's)

    def self_attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The attention of the normed hidden states ``x`` (q/k/v, q/k norms, rotation,
        paged attention, which writes the step's keys and values into ``kv_cache``), through
        the o projection."""
        n, h, kvh, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        qk, v = qkv.split([(h + kvh) * d, kvh * d], dim=-1)
        qk = qk.view(n, h + kvh, d)
        if self.q_norm is not None and not self.norm_after_rope:
            qk = self.normed_qk(qk)
        # One rotation for queries and keys together: they share positions.
        qk = apply_rope(qk, cos, sin, self.native)
        if self.q_norm is not None and self.norm_after_rope:  # (Hunyuan's)
            qk = self.normed_qk(qk)
        # Rotated keys and values side by side, as the cache stores them.
        kv = torch.cat([qk[:, h:], v.view(n, kvh, d)], dim=1).view(n, 2, kvh, d)
        q = qk[:, :h]
        if meta.query_scales is not None:  # (Llama 4's attention temperature)
            q = (q * meta.query_scales[:, None, None]).to(q.dtype)
        return self.o_proj(paged_attention(q, kv, kv_cache, meta, self.scale, self.sinks,
                                           self.softcap))

    def normed_qk(self, qk: torch.Tensor) -> torch.Tensor:
        """The queries and keys ``[T, heads + kv heads, head_dim]`` RMSNormed: over all heads
        at once where the norms are that wide (OLMo 2), else per head (Qwen3)."""
        n, h, kvh, d = qk.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.q_norm.numel() != d:  # (a token's h x d queries one row)
            return torch.cat([
                rms_norm(qk[:, :h].reshape(n, h * d).contiguous(), self.q_norm, self.eps,
                         self.native).view(n, h, d),
                rms_norm(qk[:, h:].reshape(n, kvh * d).contiguous(), self.k_norm, self.eps,
                         self.native).view(n, kvh, d)], dim=1)
        return torch.cat([  # (each head's d values a row)
            rms_norm(qk[:, :h].reshape(n * h, d).contiguous(), self.q_norm, self.eps,
                     self.native).view(n, h, d),
            rms_norm(qk[:, h:].reshape(n * kvh, d).contiguous(), self.k_norm, self.eps,
                     self.native).view(n, kvh, d)], dim=1)


class LlamaForCausalLM(BlockLayouts):
    """The whole model: ``forward`` gives hidden states, ``compute_logits`` float32 logits;
    its blocks' layouts (``pack_blocks``, ``use_int24_activations``, ...) are
    ``relayout.BlockLayouts``'."""

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
        arena = self.set_embeddings(cfg, weights)
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
        self.set_sliding_rope(None, max_positions)  # (one rope: Gemma 3's and OLMo 3's two)
        leftover = [k for k in weights if "rotary_emb" not in k]
        if leftover:
            raise ValueError(f"unused weights in checkpoint: {leftover[:5]}")
        if arena is None:
            self.pack_blocks()
        if shard is not None:
            self.join_ranks(shard, vocab_range[0])
        self.set_all_layers_args()

    def set_embeddings(self, cfg: ModelConfig, weights: Weights) -> BlockArena | None:
        """The embedding and the head (one copy of the blocks where they are tied), popped
        from ``weights``, and ``native``: whether the model runs the native CPU kernels
        (attention's decode path too) or the torch operators. Returns the arena every
        linear's GGUF blocks are laid into (None for float weights)."""
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
        self.native = (self.embedding.device.type == "cpu"
                       and self.embedding.dtype in (torch.float32, torch.bfloat16)
                       and cpu_kernels_available())
        return arena

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

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] of a flat step; writes the step's KV into the cache."""
        x = self.embedding(input_ids)
        if self.config.embedding_multiplier != 1.0:
            x = x * self.config.embedding_multiplier
        cos, sin = self.rotary.tables(positions)
        meta = self.with_query_scales(meta, positions)
        # Every block in one native call (what the loop below runs, block by block), unless
        # a block has left the one-call path (tests switch blocks to the Python path).
        if (meta.decode_block_tables is not None and self.all_layers_args is not None
                and meta.query_scales is None
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

    def set_sliding_rope(self, theta: float | None, max_positions: int) -> None:
        """The sliding-window layers' rope (Gemma 3's local base, OLMo 3's unscaled one):
        tables of base ``theta`` without scaling, or the global layers' where ``theta`` is
        ``None`` or would give the same tables; ``forward_layers`` picks each layer's. (A
        sliding layer keeps it where its window is as long as the context.)"""
        cfg = self.config
        self.is_sliding = [w is not None for w in cfg.layer_windows or (None,) * cfg.num_layers]
        self.local_rotary = self.rotary
        if theta is not None and (theta != cfg.rope_theta or cfg.rope_scaling is not None):
            self.local_rotary = RotaryEmbedding(cfg.head_dim, max_positions, theta, None,
                                                self.embedding.dtype, self.embedding.device)

    def forward_layers(self, x: torch.Tensor, positions: torch.Tensor,
                       kv_caches: torch.Tensor, meta: AttentionMetadata
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(output, residual)`` of the blocks in order, block by block, each with its
        window's metadata and its rope (``set_sliding_rope``'s for the sliding layers; none
        where ``no_rope_layers`` says so: the identity rotation, cos 1 and sin 0, which
        leaves every float as it is)."""
        ropes = {False: self.rotary.tables(positions)}
        ropes[True] = (ropes[False] if self.local_rotary is self.rotary
                       else self.local_rotary.tables(positions))
        rotates = self.config.no_rope_layers or (1,) * len(self.layers)
        cos = ropes[False][0]  # (the identity only for a step of a model with NoPE layers)
        identity = (torch.ones_like(cos), torch.zeros_like(cos)) if 0 in rotates else None
        metas = {window: meta.with_window(window) for window in set(self.windows)}
        residual = None
        for layer, sliding, rotated, window, cache in zip(
                self.layers, self.is_sliding, rotates, self.windows, kv_caches):
            rope = ropes[sliding] if rotated else identity
            x, residual = layer(x, residual, *rope, cache, metas[window])
        return x, residual

    def with_query_scales(self, meta: AttentionMetadata, positions: torch.Tensor
                          ) -> AttentionMetadata:
        """``meta`` with Llama 4's attention temperature where the config has one and a
        token of the step is past its length (transformers' ``get_llama_4_attn_scale``: the
        rotated query times ``1 + beta ln(1 + floor(position / length))``, in float32);
        below the length every multiplier is 1 and ``meta`` is returned as it is."""
        beta, length = (self.config.attention_temperature_beta,
                        self.config.attention_temperature_length)
        if not beta or positions.numel() == 0 or int(positions.max()) < length:
            return meta
        scales = 1 + beta * torch.log(1 + torch.floor(positions / length))
        return dataclasses.replace(meta, query_scales=scales.to(self.embedding.dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        return logits
