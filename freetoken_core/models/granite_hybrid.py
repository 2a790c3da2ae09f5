"""Native Granite 4 causal LM (transformers' ``GraniteMoeHybridForCausalLM``: granite-4.0-h-micro,
-h-tiny, -h-small, and the dense granite-4.0-micro), computed as transformers computes it:
Granite's multipliers (embeddings, residual branches, attention scores, logits) over blocks
whose token mixer is Mamba-2 (``mamba`` layers, ``mamba2``: a state per running sequence in
its scheduler slot, ``recurrent``) or attention (RoPE where ``position_embedding_type`` is
``rope``, else none), and whose MLP is a shared SwiGLU MLP (``shared_mlp``, gate and up in
one tensor, or two as GGUF files hold them: ``gguf_granite4``) plus, where the config has
experts, Granite MoE's experts (the softmax of the top k router logits: ``moe.py``). Only
the attention layers have keys and values; the prefix cache is off and tensor parallelism
refused, as for the other recurrent models."""

from __future__ import annotations

from typing import Any

import torch

from freetoken_core.models.attention import AttentionMetadata, paged_attention
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.kv_layout import LayerViews
from freetoken_core.models.layers import add_rms_norm, apply_rope, rms_norm, silu_and_mul
from freetoken_core.models.linear import BlockArena, make_linear
from freetoken_core.models.llama import LlamaForCausalLM, Weights
from freetoken_core.models.mamba2 import Mamba2
from freetoken_core.models.moe import SparseMoE
from freetoken_core.models.recurrent import RecurrentModel, check_step
from freetoken_core.models.sharding import Shard


class GraniteHybridLayer:
    """Granite 4's block ``index`` (module docstring): ``(output, residual)`` as Llama's."""

    def __init__(self, cfg: ModelConfig, weights: Weights, index: int, native: bool,
                 arena: BlockArena | None = None) -> None:
        prefix = f"model.layers.{index}."

        def w(name: str) -> Any:
            return weights.pop(prefix + name)

        linears: list[Any] = []
        self.mixer: Mamba2 | None = None
        if cfg.layer_kinds[index] == "mamba":
            self.mixer = Mamba2(cfg, weights, prefix, arena)
            linears += self.mixer.linears
        else:
            attn = prefix + "self_attn."
            bias = (torch.cat([weights.pop(f"{attn}{p}_proj.bias") for p in "qkv"])
                    if cfg.attention_bias else None)
            self.qkv_proj = make_linear([weights.pop(f"{attn}{p}_proj.weight") for p in "qkv"],
                                        bias, arena=arena)
            self.o_proj = make_linear([weights.pop(attn + "o_proj.weight")],
                                      weights.pop(attn + "o_proj.bias", None), arena=arena)
            linears += [self.qkv_proj, self.o_proj]
        self.moe = SparseMoE(cfg, weights, prefix, native, arena) if cfg.num_experts else None
        if self.moe is not None:
            linears += self.moe.linears
        fused = prefix + "shared_mlp.input_linear.weight"  # (gate rows, then up rows)
        self.shared_up = make_linear([weights.pop(fused)] if fused in weights else [
            w("shared_mlp.gate_proj.weight"), w("shared_mlp.up_proj.weight")], arena=arena)
        self.shared_down = make_linear([w("shared_mlp.output_linear.weight")], arena=arena)
        self.input_norm = w("input_layernorm.weight")
        self.post_attn_norm = w("post_attention_layernorm.weight")
        self.linears = (*linears, self.shared_up, self.shared_down)
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_heads, cfg.num_kv_heads,
                                                            cfg.head_dim)
        self.scale, self.multiplier = cfg.query_scale, cfg.residual_multiplier
        self.eps, self.native = cfg.rms_norm_eps, native
        self.one_call = None

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None,
                 rope: tuple[torch.Tensor, torch.Tensor] | None, kv_cache: torch.Tensor | None,
                 meta: AttentionMetadata, states: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = rms_norm(x, self.input_norm, self.eps, self.native)
        else:
            x, residual = add_rms_norm(x, residual, self.input_norm, self.eps, self.native)
        if self.mixer is not None:
            assert meta.sequences is not None
            x = self.mixer(x, states, meta.sequences)
        else:
            assert kv_cache is not None
            x = self.attention(x, rope, kv_cache, meta)
        x, residual = add_rms_norm(x * self.multiplier, residual, self.post_attn_norm,
                                   self.eps, self.native)
        out = self.shared_down(silu_and_mul(self.shared_up(x), self.native))
        if self.moe is not None:
            out = self.moe(x) + out
        return out * self.multiplier, residual

    def attention(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                  kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n, h, kvh, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qk, v = self.qkv_proj(x).split([(h + kvh) * d, kvh * d], dim=-1)
        qk = qk.reshape(n, h + kvh, d)
        if rope is not None:
            qk = apply_rope(qk.contiguous(), *rope, self.native)
        kv = torch.cat([qk[:, h:], v.reshape(n, kvh, d)], dim=1).view(n, 2, kvh, d)
        return self.o_proj(paged_attention(qk[:, :h].contiguous(), kv, kv_cache, meta,
                                           self.scale))


class GraniteHybridForCausalLM(RecurrentModel, LlamaForCausalLM):
    """Granite 4 (module docstring): ``compute_logits`` as Llama's (Granite's logit scale);
    ``allocate_states`` makes the Mamba-2 layers' states (``recurrent``)."""

    layer_class = staticmethod(GraniteHybridLayer)  # type: ignore[assignment]
    family, mixers, mixer_name = "Granite 4", "Mamba-2 layers", "mixer"

    def __init__(self, cfg: ModelConfig, weights: Weights, max_positions: int,
                 shard: Shard | None = None) -> None:
        self.refuse_shard(shard)
        super().__init__(cfg, weights, max_positions)
        self.rotates = not cfg.no_rope_layers  # (position_embedding_type rope)
        self.states = []
        self.views = LayerViews(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        check_step(self, meta)
        rope = self.rotary.tables(positions) if self.rotates else None
        x, residual = self.embedding(input_ids) * self.config.embedding_multiplier, None
        for layer, cache, states in zip(self.layers, self.views(kv_caches), self.states):
            x, residual = layer(x, residual, rope, cache, meta, states)
        return add_rms_norm(x, residual, self.norm, self.config.rms_norm_eps, self.native)[0]
