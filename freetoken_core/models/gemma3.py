"""Native Gemma 3 causal LM, text only (transformers' ``Gemma3ForCausalLM``), and the blocks
Gemma 2 shares with it (gemma2.py).

Llama's model (llama.py: paged attention, fused q/k/v and gate/up linears, the residual
stream passed beside each block's output) with Gemma's differences, each computed as
transformers computes it:

- token embeddings times ``sqrt(hidden_size)``, the factor rounded to the weights' dtype;
- RMSNorm ``x * (1 + w)`` in float32, cast back once (the model keeps ``1 + w`` in float32),
  on both sides of each half of the block (input and post-attention norms around
  attention, pre- and post-feedforward norms around the MLP) and per head on q and k;
- scores scaled by ``query_pre_attn_scalar ** -0.5``; a GELU-tanh gated MLP;
- sliding-window layers (``layer_types``) attend to their last ``sliding_window`` keys,
  their own included, rotated with the local base ``rope_local_base_freq`` and no scaling;
  global layers attend to every key, rotated with ``rope_theta`` and ``rope_scaling``;
- tied embeddings, and the final logit softcap where the config sets one;
- where the config has them (Gemma 2's, ``attn_logit_softcap``), the scores softcapped
  before the softmax; without q/k norms (Gemma 2) the queries and keys go to the rope as
  projected; without a local base (Gemma 2) every layer has the one rope.

Every layer keeps every key in the KV cache (no ring buffer for the sliding layers): the
window only limits what a query reads.
"""

from __future__ import annotations

import torch

from freetoken_core.models.attention import AttentionMetadata, paged_attention
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.layers import (
    apply_rope,
    float32_weight_add_rms_norm,
    float32_weight_rms_norm,
    gelu_tanh_and_mul,
)
from freetoken_core.models.linear import BlockArena
from freetoken_core.models.llama import DecoderLayer, LlamaForCausalLM, Weights
from freetoken_core.models.sharding import Shard


def norm_weight(w: torch.Tensor) -> torch.Tensor:
    """A Gemma RMSNorm's multiplier ``1 + w`` in float32, as transformers computes it."""
    return 1.0 + w.float()


class Gemma3DecoderLayer(DecoderLayer):
    """Llama's block with Gemma's four norms, q/k norms (Gemma 3's; Gemma 2 has none), query
    scale, scores' softcap (Gemma 2's) and GELU-tanh MLP."""

    def __init__(self, cfg: ModelConfig, weights: Weights, index: int, native: bool,
                 arena: BlockArena | None = None) -> None:
        prefix = f"model.layers.{index}."
        self.pre_ff_norm = norm_weight(weights.pop(prefix + "pre_feedforward_layernorm.weight"))
        self.post_ff_norm = norm_weight(
            weights.pop(prefix + "post_feedforward_layernorm.weight"))
        super().__init__(cfg, weights, index, native, arena)
        self.one_call = None  # (Llama's block: its norms, its MLP)
        self.input_norm = norm_weight(self.input_norm)
        self.post_attn_norm = norm_weight(self.post_attn_norm)
        if cfg.qk_norm:
            self.q_norm = norm_weight(self.q_norm)
            self.k_norm = norm_weight(self.k_norm)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                 sin: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(output, residual)`` as ``DecoderLayer``'s; ``meta`` carries the layer's
        window and ``cos``/``sin`` its rope."""
        n, h, kvh, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        eps, native = self.eps, self.native
        if residual is None:
            residual = x
            x = float32_weight_rms_norm(x, self.input_norm, eps, native)
        else:
            x, residual = float32_weight_add_rms_norm(x, residual, self.input_norm, eps,
                                                      native)
        q, k, v = self.qkv_proj(x).split([h * d, kvh * d, kvh * d], dim=-1)
        if self.q_norm is not None:
            qk = torch.cat([float32_weight_rms_norm(q.view(n, h, d), self.q_norm, eps),
                            float32_weight_rms_norm(k.view(n, kvh, d), self.k_norm, eps)],
                           dim=1)
        else:
            qk = torch.cat([q.view(n, h, d), k.view(n, kvh, d)], dim=1)
        qk = apply_rope(qk, cos, sin, native)
        kv = torch.cat([qk[:, h:], v.view(n, kvh, d)], dim=1).view(n, 2, kvh, d)
        x = self.o_proj(paged_attention(qk[:, :h], kv, kv_cache, meta, self.scale,
                                        softcap=self.softcap))
        x = float32_weight_rms_norm(x, self.post_attn_norm, eps, native)
        x, residual = float32_weight_add_rms_norm(x, residual, self.pre_ff_norm, eps, native)
        x = self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))
        return float32_weight_rms_norm(x, self.post_ff_norm, eps, native), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's text model: ``forward`` gives hidden states, ``compute_logits`` float32
    logits (softcapped where configured), as ``LlamaForCausalLM``'s."""

    layer_class = Gemma3DecoderLayer

    def __init__(self, cfg: ModelConfig, weights: Weights, max_positions: int,
                 shard: Shard | None = None) -> None:
        super().__init__(cfg, weights, max_positions, shard)  # self.rotary: the global layers'
        dtype, device = self.embedding.dtype, self.embedding.device
        self.norm = norm_weight(self.norm)
        # transformers: torch.tensor(sqrt(hidden)) (float32), cast to the weights' dtype.
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5).to(dtype=dtype, device=device)
        self.set_sliding_rope(cfg.rope_local_theta, max_positions)  # (Gemma 2: one rope)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] of a flat step; writes the step's KV into the cache."""
        x, residual = self.forward_layers(self.embedding(input_ids) * self.embed_scale,
                                          positions, kv_caches, meta)
        return float32_weight_add_rms_norm(x, residual, self.norm, self.config.rms_norm_eps,
                                           self.native)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
