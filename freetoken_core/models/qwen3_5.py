"""Native Qwen3.5 causal LM, text only (transformers' ``Qwen3_5ForCausalLM``, and the language
model of ``Qwen3_5ForConditionalGeneration``: Qwen3.5 0.8B-27B; with ``Qwen3_5Moe*``'s
experts in every layer's MLP: 35B-A3B to 397B-A17B), computed as transformers computes it
(config keys: ``config_qwen3_5.py``):

- every layer ``x + mixer(norm(x))`` then ``x + mlp(norm(x))`` (SwiGLU), RMSNorm
  ``x * (1 + w)`` in float32 (Gemma's), the final norm too;
- three layers in four mix tokens by Gated DeltaNet (``gated_deltanet``: a recurrent state
  per sequence, kept in its scheduler slot), every fourth by attention over the paged KV
  cache: q/k RMSNormed per head (``1 + w``), RoPE on the first quarter of each head (NEOX
  pairs within it), and the output times the sigmoid of a gate the q projection gives beside
  each head's query, before the o projection;
- untied embeddings unless the config ties them.

Only the attention layers have keys and values (``kv_layout``: the cache has a layer for
each of them alone). The recurrent states make a prefix-cache hit useless (the engine turns
the prefix cache off) and tensor parallelism is refused. A checkpoint's multi-token-prediction
weights (``mtp.*``) are not read.
"""

from __future__ import annotations

from typing import Any

import torch

from freetoken_core.models.attention import AttentionMetadata, paged_attention
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.gated_deltanet import GatedDeltaNet, RecurrentStates
from freetoken_core.models.gemma3 import norm_weight
from freetoken_core.models.kv_layout import LayerViews
from freetoken_core.models.layers import (
    RotaryEmbedding,
    float32_weight_add_rms_norm,
    float32_weight_rms_norm,
)
from freetoken_core.models.linear import BlockArena, make_linear
from freetoken_core.models.llama import LlamaForCausalLM, Weights
from freetoken_core.models.moe import SparseMoE, feed_forward
from freetoken_core.models.recurrent import RecurrentModel, check_step
from freetoken_core.models.sharding import Shard


def partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, heads, head_dim]`` with its first ``cos.shape[-1]`` dimensions rotated
    (NEOX pairs ``i, i + rotated / 2``) and the rest as they are (transformers' Qwen3.5
    ``apply_rotary_pos_emb``)."""
    rot = cos.shape[-1]
    turning, passing = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-turning[..., half:], turning[..., :half]), dim=-1)
    turned = turning * cos[:, None] + rotated * sin[:, None]
    return torch.cat([turned, passing], dim=-1)


class Qwen3_5DecoderLayer:
    """Qwen3.5's block ``index`` (module docstring): ``layer(x, residual, ...)`` gives its
    ``(output, residual)``, as Llama's block."""

    def __init__(self, cfg: ModelConfig, weights: Weights, index: int, native: bool,
                 arena: BlockArena | None = None) -> None:
        prefix = f"model.layers.{index}."

        def w(name: str) -> Any:
            return weights.pop(prefix + name)

        self.linear_attn: GatedDeltaNet | None = None
        linears: list[Any] = []
        if cfg.layer_kinds[index] == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, weights, prefix, arena)
            linears += self.linear_attn.linears
        else:
            attn = "self_attn."
            self.qkv_proj = make_linear([w(f"{attn}{p}_proj.weight") for p in "qkv"],
                                        arena=arena)
            self.o_proj = make_linear([w(attn + "o_proj.weight")], arena=arena)
            self.q_norm = norm_weight(w(attn + "q_norm.weight"))
            self.k_norm = norm_weight(w(attn + "k_norm.weight"))
            linears += [self.qkv_proj, self.o_proj]
        # (Qwen3.5-MoE's, Qwen3-Next's: experts, a shared one)
        self.mlp = feed_forward(cfg, weights, prefix, index, native, arena)
        self.moe = self.mlp if isinstance(self.mlp, SparseMoE) else None
        linears += self.mlp.linears
        self.input_norm = norm_weight(w("input_layernorm.weight"))
        self.post_attn_norm = norm_weight(w("post_attention_layernorm.weight"))
        self.linears = tuple(linears)
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_heads, cfg.num_kv_heads,
                                                            cfg.head_dim)
        self.eps, self.native = cfg.rms_norm_eps, native
        self.one_call = None

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        return float32_weight_rms_norm(flat, weight, self.eps, self.native).view(x.shape)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                 sin: torch.Tensor, kv_cache: torch.Tensor | None, meta: AttentionMetadata,
                 states: RecurrentStates | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = float32_weight_rms_norm(x, self.input_norm, self.eps, self.native)
        else:
            x, residual = float32_weight_add_rms_norm(x, residual, self.input_norm, self.eps,
                                                      self.native)
        if self.linear_attn is not None:
            assert states is not None and meta.sequences is not None
            x = self.linear_attn(x, states, meta.sequences)
        else:
            assert kv_cache is not None
            x = self.attention(x, cos, sin, kv_cache, meta)
        x, residual = float32_weight_add_rms_norm(x, residual, self.post_attn_norm, self.eps,
                                                  self.native)
        return self.mlp(x), residual

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n, h, kvh, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q_gate, k, v = self.qkv_proj(x).split([2 * h * d, kvh * d, kvh * d], dim=-1)
        q, gate = q_gate.reshape(n, h, 2 * d).chunk(2, dim=-1)
        q = partial_rope(self.norm(q, self.q_norm), cos, sin)
        k = partial_rope(self.norm(k.reshape(n, kvh, d), self.k_norm), cos, sin)
        kv = torch.cat([k, v.reshape(n, kvh, d)], dim=1).view(n, 2, kvh, d)
        out = paged_attention(q.contiguous(), kv, kv_cache, meta)
        return self.o_proj(out * torch.sigmoid(gate.reshape(n, h * d)))


class Qwen3_5ForCausalLM(RecurrentModel, LlamaForCausalLM):
    """Qwen3.5's text model: ``forward`` gives hidden states, ``compute_logits`` float32
    logits; ``allocate_states`` makes the linear layers' states (``recurrent``: the engine
    gives each running sequence a slot); the block layouts are ``LlamaForCausalLM``'s."""

    family, mixers, mixer_name = "Qwen3.5", "linear-attention layers", "linear_attn"

    def __init__(self, cfg: ModelConfig, weights: Weights, max_positions: int,
                 shard: Shard | None = None) -> None:
        self.refuse_shard(shard)
        for name in [k for k in weights if k.startswith("mtp.")]:
            del weights[name]  # (multi-token prediction: not used)
        self.config = cfg
        self.num_kv_heads = cfg.num_kv_heads
        arena = self.set_embeddings(cfg, weights)
        self.layers = [Qwen3_5DecoderLayer(cfg, weights, i, self.native, arena)
                       for i in range(cfg.num_layers)]
        self.windows = [None] * cfg.num_layers
        self.norm = norm_weight(weights.pop("model.norm.weight"))
        self.uses_gguf_blocks = arena is not None
        rotated = int(cfg.head_dim * cfg.partial_rotary_factor)
        # (the rotated dimensions' frequencies: exponents over the rotated size)
        self.rotary = RotaryEmbedding(rotated, max_positions, cfg.rope_theta, None,
                                      self.embedding.dtype, self.embedding.device)
        leftover = [k for k in weights if "rotary_emb" not in k]
        if leftover:
            raise ValueError(f"unused weights in checkpoint: {leftover[:5]}")
        self.states = []
        self.views = LayerViews(cfg)
        if arena is None:
            self.pack_blocks()
        self.set_all_layers_args()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] of a flat step; writes the step's KV into the cache and
        its sequences' states into their slots (``meta.sequences``)."""
        check_step(self, meta)
        cos, sin = self.rotary.tables(positions)
        x, residual = self.embedding(input_ids), None
        for layer, cache, states in zip(self.layers, self.views(kv_caches), self.states):
            x, residual = layer(x, residual, cos, sin, cache, meta, states)
        return float32_weight_add_rms_norm(x, residual, self.norm, self.config.rms_norm_eps,
                                           self.native)[0]
