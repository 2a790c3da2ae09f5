"""Native StarCoder2 causal LM (transformers' ``Starcoder2ForCausalLM``: StarCoder2 3B, 7B,
15B; GGUF ``starcoder2``).

Llama's model (llama.py) with StarCoder2's differences, each computed as transformers
computes it:

- LayerNorms with a bias (``torch.nn.functional.layer_norm``, transformers' ``nn.LayerNorm``,
  eps ``norm_epsilon``) before the attention, before the MLP and at the end, where Llama has
  RMSNorms;
- biases on every linear but the head (``use_bias``, on in the released models);
- an MLP that is not gated: ``c_proj(gelu_tanh(c_fc(x)))`` (``ModelConfig.gated_mlp``;
  ``c_fc`` / ``c_proj`` read as ``up_proj`` / ``down_proj``: ``weight_names.py``);
- a sliding window over every layer (``sliding_window``, 4,096 in the released configs) where
  the config has one. llama.cpp's converter writes none and its graph has none: a GGUF file
  attends to every key, unless it has ``attention.sliding_window``.

Rotary pairs are Llama's half-offset ones on the checkpoint's rows (llama.cpp's NEOX rope on
unpermuted weights). No one-call native path (its block kernel has RMSNorms and SwiGLU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken_core.models.attention import AttentionMetadata
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.linear import BlockArena
from freetoken_core.models.llama import DecoderLayer, LlamaForCausalLM, Weights
from freetoken_core.models.sharding import Shard


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
               ) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


class Starcoder2DecoderLayer(DecoderLayer):
    """Llama's block with LayerNorms (and their biases) for its RMSNorms."""

    def __init__(self, cfg: ModelConfig, weights: Weights, index: int, native: bool,
                 arena: BlockArena | None = None) -> None:
        prefix = f"model.layers.{index}."
        self.input_bias = weights.pop(prefix + "input_layernorm.bias")
        self.post_attn_bias = weights.pop(prefix + "post_attention_layernorm.bias")
        super().__init__(cfg, weights, index, native, arena)
        self.one_call = None

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                 sin: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(output, residual)`` as ``DecoderLayer``'s: the hidden state is their sum."""
        hidden = x if residual is None else residual + x
        normed = _layer_norm(hidden, self.input_norm, self.input_bias, self.eps)
        hidden = hidden + self.self_attention(normed, cos, sin, kv_cache, meta)
        normed = _layer_norm(hidden, self.post_attn_norm, self.post_attn_bias, self.eps)
        return self.mlp(normed), hidden


class Starcoder2ForCausalLM(LlamaForCausalLM):
    """StarCoder2 (module docstring): ``forward`` gives hidden states, ``compute_logits``
    float32 logits, as ``LlamaForCausalLM``'s."""

    layer_class = Starcoder2DecoderLayer

    def __init__(self, cfg: ModelConfig, weights: Weights, max_positions: int,
                 shard: Shard | None = None) -> None:
        self.norm_bias = weights.pop("model.norm.bias")
        super().__init__(cfg, weights, max_positions, shard)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] of a flat step; writes the step's KV into the cache."""
        x, residual = self.forward_layers(self.embedding(input_ids), positions, kv_caches, meta)
        return _layer_norm(residual + x, self.norm, self.norm_bias, self.config.rms_norm_eps)
