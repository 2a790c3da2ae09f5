"""Native multi-head latent attention (MLA) causal LMs: transformers' ``DeepseekV2ForCausalLM``
(DeepSeek-V2, V2-Lite, V2.5, DeepSeek-Coder-V2), ``DeepseekV3ForCausalLM`` (DeepSeek-V3, R1,
V3.1, Kimi K2, Moonlight) and ``Glm4MoeLiteForCausalLM`` (GLM-4.7-Flash), computed as
transformers computes them, the attention in its absorbed form:

- queries from ``q_proj``, or (``q_lora_rank``) ``q_b_proj`` of the RMSNormed ``q_a_proj``;
  each head's ``qk_nope_head_dim`` unrotated and ``qk_rope_head_dim`` rotated dimensions;
- ``kv_a_proj_with_mqa`` gives each token a latent of ``kv_lora_rank`` (RMSNormed) and one
  rotated key part shared by every head; ``kv_b_proj`` would expand the latent into each
  head's unrotated key (``W_UK``) and value (``W_UV``). Instead, each head's unrotated query
  is taken into the latent space (``q W_UK``), so that every head attends over the same
  cached vectors ``[latent | rotated key]`` (one KV head, the paged cache's keys and values
  both: ``kv_layout``), and the attention's output (a mix of latents) is taken out through
  ``W_UV`` per head: the same products in another order (float32: the same logits to
  ~1e-6), and a cache of ``kv_lora_rank + qk_rope_head_dim`` values a token and layer, not
  ``heads x (qk_head_dim + v_head_dim)``;
- the rotated parts on adjacent pairs (DeepSeek-V2's complex rotation, V3's
  ``rope_interleave``): their rows reordered at load into half-offset pairs (each pair's
  two dimensions at ``i`` and ``i + half``), which Llama's rotation turns by the same
  angles; the q·k products do not depend on the order. YaRN's ``mscale_all_dim`` in the
  score scale (``config_deepseek``); the latent norms' epsilon is 1e-6 (transformers'
  default, not ``rms_norm_eps``);
- Llama's pre-norm blocks; past the dense first layers a mixture of experts (``moe.py``:
  V2's softmax routing, greedy or among the best groups by their best expert; V3's sigmoid
  scores with ``e_score_correction_bias`` among the best groups) beside SwiGLU shared
  experts. The multi-token-prediction layers of V3's checkpoints are not read.

No one-call native path and no tensor parallelism (a mixture of experts)."""

from __future__ import annotations

from typing import Any

import torch

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.attention import AttentionMetadata, paged_attention
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.glm4_moe import drop_extra_layers
from freetoken_core.models.layers import add_rms_norm, apply_rope, rms_norm
from freetoken_core.models.linear import BlockArena, HeadLinears, make_linear
from freetoken_core.models.llama import LlamaForCausalLM, Weights
from freetoken_core.models.moe import SparseMoE, feed_forward
from freetoken_core.models.phi3 import reorder_rows
from freetoken_core.models.sharding import Shard

LATENT_NORM_EPS = 1e-6  # (DeepseekV3RMSNorm(q_lora_rank) / (kv_lora_rank): the default eps)


def deinterleave_rope_rows(weights: Weights, prefix: str, cfg: ModelConfig) -> None:
    """Layer ``prefix``'s rotated query and key rows reordered in place (module docstring):
    within each head's last ``qk_rope_head_dim`` query rows and the last as many rows of
    ``kv_a_proj_with_mqa``, the even dimensions first, then the odd ones."""
    q_lora, kv_lora, nope, rope, _ = cfg.mla_shape
    pairs = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    head = torch.cat([torch.arange(nope), nope + pairs])
    attn = prefix + "self_attn."
    q_name = attn + ("q_b_proj" if q_lora else "q_proj")
    heads = torch.arange(cfg.num_heads)[:, None] * (nope + rope)
    for name, order in ((q_name, (heads + head[None, :]).reshape(-1)),
                        (attn + "kv_a_proj_with_mqa",
                         torch.cat([torch.arange(kv_lora), kv_lora + pairs]))):
        for kind in ("weight", "bias"):
            if f"{name}.{kind}" in weights:
                weights[f"{name}.{kind}"] = reorder_rows(weights[f"{name}.{kind}"], order)


class MlaAttention:
    """One layer's latent attention (module docstring): ``attn(x, cos, sin, kv_cache, meta)``
    of the normed hidden states ``x``, through the o projection."""

    def __init__(self, cfg: ModelConfig, weights: Weights, prefix: str,
                 arena: BlockArena | None) -> None:
        attn = prefix + "self_attn."
        q_lora, kv_lora, nope, rope, v = cfg.mla_shape
        h = cfg.num_heads

        def pop(name: str) -> Any:
            return weights.pop(attn + name)

        # The two projections of x in one linear: [q_a | kv_a], or [q | kv_a].
        first = "q_a_proj" if q_lora else "q_proj"
        parts = [pop(f"{first}.weight"), pop("kv_a_proj_with_mqa.weight")]
        biases = [weights.pop(f"{attn}{first}.bias", None),
                  weights.pop(attn + "kv_a_proj_with_mqa.bias", None)]
        widths = [q_lora or h * (nope + rope), kv_lora + rope]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b if b is not None else torch.zeros(n) for b, n in
                              zip(biases, widths)]).to(next(b for b in biases if b is not None))
        self.a_proj = make_linear(parts, bias, arena)
        self.widths = widths
        self.q_a_norm = pop("q_a_layernorm.weight") if q_lora else None
        self.q_b_proj = make_linear([pop("q_b_proj.weight")], arena=arena) if q_lora else None
        self.kv_a_norm = pop("kv_a_layernorm.weight")
        self.k_b: HeadLinears | None = None  # (per head: GGUF blocks, k_b_proj / v_b_proj)
        self.v_b: HeadLinears | None = None
        kv_b = weights.pop(attn + "kv_b_proj.weight", None)
        if kv_b is None:  # (a GGUF file's: kv_b split per head, W_UK transposed)
            k_b = [pop(f"k_b_proj.{i}.weight") for i in range(h)]
            v_b = [pop(f"v_b_proj.{i}.weight") for i in range(h)]
            for name, parts, shape in (("k_b_proj", k_b, (kv_lora, nope)),
                                       ("v_b_proj", v_b, (v, kv_lora))):
                if any(tuple(p.shape) != shape for p in parts):
                    raise ModelLoadError(f"{attn}{name} has heads of shape "
                                         f"{list(parts[0].shape)}; expected {list(shape)}")
            if all(isinstance(p, torch.Tensor) for p in (*k_b, *v_b)):
                kv_b = torch.cat([torch.cat([k.t(), w]) for k, w in zip(k_b, v_b)])
            else:
                self.k_b = HeadLinears([make_linear([w], arena=arena) for w in k_b])
                self.v_b = HeadLinears([make_linear([w], arena=arena) for w in v_b])
        if kv_b is not None:
            if not isinstance(kv_b, torch.Tensor):  # (older GGUF files' unsplit kv_b)
                kv_b = kv_b.dequantize()
            if tuple(kv_b.shape) != (h * (nope + v), kv_lora):
                raise ModelLoadError(f"{attn}kv_b_proj.weight has shape {list(kv_b.shape)}; "
                                     f"expected [{h * (nope + v)}, {kv_lora}] (heads x "
                                     "(qk_nope_head_dim + v_head_dim), kv_lora_rank)")
            per_head = kv_b.view(h, nope + v, kv_lora)
            self.w_uk = per_head[:, :nope].contiguous()  # [heads, nope, latent]
            self.w_uv_t = per_head[:, nope:].transpose(1, 2).contiguous()  # [heads, latent, v]
        self.o_proj = make_linear([pop("o_proj.weight")],
                                  weights.pop(attn + "o_proj.bias", None), arena)
        self.shape = (h, kv_lora, nope, rope, v)
        self.scale = cfg.query_scale
        self.eps = cfg.rms_norm_eps

    @property
    def linears(self) -> tuple[Any, ...]:
        return tuple(lin for lin in (self.a_proj, self.q_b_proj, self.o_proj,
                                     *(self.k_b.linears if self.k_b else ()),
                                     *(self.v_b.linears if self.v_b else ())) if lin is not None)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_cache: torch.Tensor, meta: AttentionMetadata, native: bool
                 ) -> torch.Tensor:
        h, kv_lora, nope, rope, v = self.shape
        n = x.shape[0]
        q, kv = self.a_proj(x).split(self.widths, dim=-1)
        if self.q_b_proj is not None:
            q = self.q_b_proj(rms_norm(q.contiguous(), self.q_a_norm, LATENT_NORM_EPS, native))
        q = q.view(n, h, nope + rope)
        latent, k_rot = kv.split([kv_lora, rope], dim=-1)
        latent = rms_norm(latent.contiguous(), self.kv_a_norm, LATENT_NORM_EPS, native)
        # One rotation for the heads' query parts and the shared key part.
        rotated = apply_rope(torch.cat([q[:, :, nope:], k_rot.view(n, 1, rope)], dim=1),
                             cos, sin, native)
        if self.k_b is None:
            if self.w_uk.dtype != q.dtype:  # (once: the model's compute dtype)
                self.w_uk, self.w_uv_t = self.w_uk.to(q.dtype), self.w_uv_t.to(q.dtype)
            q_latent = torch.bmm(q[:, :, :nope].transpose(0, 1), self.w_uk).transpose(0, 1)
        else:
            q_latent = self.k_b(q[:, :, :nope])
        query = torch.cat([q_latent, rotated[:, :h]], dim=-1)
        key = torch.cat([latent, rotated[:, h]], dim=-1).view(n, 1, 1, kv_lora + rope)
        out = paged_attention(query.contiguous(), key.expand(n, 2, 1, kv_lora + rope),
                              kv_cache, meta, self.scale)
        mixed = out.view(n, h, kv_lora + rope)[:, :, :kv_lora]
        if self.v_b is not None:
            return self.o_proj(self.v_b(mixed).view(n, h * v))
        values = torch.bmm(mixed.transpose(0, 1), self.w_uv_t)  # [heads, T, v]
        return self.o_proj(values.transpose(0, 1).reshape(n, h * v))


class DeepseekDecoderLayer:
    """Llama's pre-norm block with the latent attention and a dense or mixture-of-experts
    MLP: ``(output, residual)`` as ``DecoderLayer``'s."""

    def __init__(self, cfg: ModelConfig, weights: Weights, index: int, native: bool,
                 arena: BlockArena | None = None) -> None:
        prefix = f"model.layers.{index}."
        self.attn = MlaAttention(cfg, weights, prefix, arena)
        self.mlp = feed_forward(cfg, weights, prefix, index, native, arena)
        self.moe = self.mlp if isinstance(self.mlp, SparseMoE) else None
        self.input_norm = weights.pop(prefix + "input_layernorm.weight")
        self.post_attn_norm = weights.pop(prefix + "post_attention_layernorm.weight")
        self.linears = (*self.attn.linears, *self.mlp.linears)
        self.eps, self.native = cfg.rms_norm_eps, native
        self.one_call = None

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                 sin: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = rms_norm(x, self.input_norm, self.eps, self.native)
        else:
            x, residual = add_rms_norm(x, residual, self.input_norm, self.eps, self.native)
        x = self.attn(x, cos, sin, kv_cache, meta, self.native)
        x, residual = add_rms_norm(x, residual, self.post_attn_norm, self.eps, self.native)
        return self.mlp(x), residual


class DeepseekForCausalLM(LlamaForCausalLM):
    """DeepSeek-V2/V3 and GLM-4.7-Flash (module docstring): ``forward`` and
    ``compute_logits`` as Llama's, the rotary tables ``qk_rope_head_dim`` wide."""

    layer_class = DeepseekDecoderLayer  # type: ignore[assignment]

    def __init__(self, cfg: ModelConfig, weights: Weights, max_positions: int,
                 shard: Shard | None = None) -> None:
        if shard is not None:
            raise ModelLoadError(f"tensor parallelism of {cfg.architecture} (multi-head "
                                 "latent attention) is not supported; serve it on one rank "
                                 "(data parallelism replicates it)")
        drop_extra_layers(weights, cfg.num_layers)  # (V3's multi-token-prediction layers)
        if cfg.rope_interleaved:
            for i in range(cfg.num_layers):
                deinterleave_rope_rows(weights, f"model.layers.{i}.", cfg)
        super().__init__(cfg, weights, max_positions)
