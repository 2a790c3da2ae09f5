"""Native Phi causal LM (transformers' ``PhiForCausalLM``: Phi-1, Phi-1.5, Phi-2; GGUF
``phi2``).

Llama's model (llama.py) with Phi's differences, each computed as transformers computes it:

- a parallel block: one LayerNorm (with a bias, eps ``layer_norm_eps``), whose output both
  the attention and the MLP read; the block's output is ``(attention + mlp) + x``, which
  the next block's ``residual + x`` gives in the same floats (the addition commutes);
- biases on the q/k/v projections, on the attention's output (``dense``, read as
  ``o_proj``), on the MLP's two linears and on the head;
- an MLP that is not gated: ``fc2(gelu_new(fc1(x)))`` with transformers' ``gelu_new``
  (the tanh approximation, op for op; ``fc1`` / ``fc2`` read as ``up_proj`` /
  ``down_proj``: ``weight_names.py``);
- RoPE on the first ``partial_rotary_factor`` of each head (0.4 on Phi-2, 0.5 on Phi-1 and
  1.5), NEOX pairs within them: Phi-3's partial rotation (``phi3.head_order``), each q and
  k head's rows, biases and q/k norm weights reordered so that Llama's full-width rotation
  turns them, the passed dimensions at angle 0;
- ``qk_layernorm``: a LayerNorm (weight and bias, one for all heads) over each q and k head
  before the rotation;
- the final LayerNorm with a bias.

A GGUF file's fused ``attn_qkv`` (llama.cpp's converter writes one for the checkpoints of
Phi's original format, whose ``Wqkv`` it keeps) is split by rows, q, k then v, as
llama.cpp's graph splits it. No one-call native path (its block kernel is Llama's
sequential pre-norm block).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from freetoken_core.models.attention import AttentionMetadata
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.glm4 import reorder_qk_heads
from freetoken_core.models.linear import BlockArena
from freetoken_core.models.llama import DecoderLayer, LlamaForCausalLM, Weights
from freetoken_core.models.phi3 import head_order, phi3_rope, reorder_rows, rotary_dim, split_rows
from freetoken_core.models.sharding import Shard, even_ranges


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``NewGELUActivation`` (``gelu_new``), op for op."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi)
                                       * (x + 0.044715 * torch.pow(x, 3.0))))


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
                ) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def prepare_layer(weights: Weights, prefix: str, cfg: ModelConfig, rot: int) -> None:
    """Layer ``prefix``'s weights as Llama's block reads them, in place: a fused q/k/v
    (GGUF ``attn_qkv``) split by rows, and the q and k rows, biases and norm weights
    reordered within each head for the partial rotation."""
    h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attn = prefix + "self_attn."
    for kind in ("weight", "bias"):
        fused = weights.pop(f"{attn}qkv_proj.{kind}", None)
        if fused is not None:
            for name, part in zip("qkv", split_rows(fused, [h * d, kvh * d, kvh * d])):
                weights[f"{attn}{name}_proj.{kind}"] = part
    if rot < d:
        order = head_order(d, rot)
        reorder_qk_heads(weights, attn, cfg, order)
        for norm in ("q_norm", "k_norm"):  # (one weight and bias for every head)
            for kind in ("weight", "bias"):
                key = f"{attn}{norm}.{kind}"
                if key in weights:
                    weights[key] = reorder_rows(weights[key], order)


class PhiDecoderLayer(DecoderLayer):
    """Phi's parallel block: one LayerNorm, attention and MLP both of its output."""

    def __init__(self, cfg: ModelConfig, weights: Weights, index: int, native: bool,
                 arena: BlockArena | None = None) -> None:
        prefix = f"model.layers.{index}."
        self.input_bias = weights.pop(prefix + "input_layernorm.bias")
        weights[prefix + "post_attention_layernorm.weight"] = None  # (one norm a block)
        self.q_bias = self.k_bias = None
        if cfg.qk_norm:
            self.q_bias = weights.pop(prefix + "self_attn.q_norm.bias")
            self.k_bias = weights.pop(prefix + "self_attn.k_norm.bias")
        super().__init__(cfg, weights, index, native, arena)
        self.one_call = None

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                 sin: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(output, residual)`` as ``DecoderLayer``'s: the hidden state is their sum
        (here the attention's output plus the MLP's, and the block's input)."""
        hidden = x if residual is None else residual + x
        normed = _layer_norm(hidden, self.input_norm, self.input_bias, self.eps)
        attn = self.self_attention(normed, cos, sin, kv_cache, meta)
        return attn + self.mlp(normed), hidden

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """``fc2(gelu_new(fc1(x)))``."""
        return self.down_proj(gelu_new(self.gate_up_proj(x)))

    def normed_qk(self, qk: torch.Tensor) -> torch.Tensor:
        """``qk_layernorm``: each q and k head LayerNormed (``[T, heads, head_dim]``)."""
        h = self.num_heads
        return torch.cat([_layer_norm(qk[:, :h], self.q_norm, self.q_bias, self.eps),
                          _layer_norm(qk[:, h:], self.k_norm, self.k_bias, self.eps)], dim=1)


class PhiForCausalLM(LlamaForCausalLM):
    """Phi (module docstring): ``forward`` gives hidden states (the final LayerNorm's),
    ``compute_logits`` float32 logits (the head's bias added)."""

    layer_class = PhiDecoderLayer

    def __init__(self, cfg: ModelConfig, weights: Weights, max_positions: int,
                 shard: Shard | None = None) -> None:
        rot = rotary_dim(cfg)
        for i in range(cfg.num_layers):
            prepare_layer(weights, f"model.layers.{i}.", cfg, rot)
        self.norm_bias = weights.pop("model.norm.bias")
        head_bias = weights.pop("lm_head.bias")
        super().__init__(cfg, weights, max_positions, shard)
        if shard is not None:  # (this rank's slice of the vocabulary, as the head's rows)
            start, stop = even_ranges(cfg.vocab_size, shard.world_size)[shard.rank]
            head_bias = head_bias[start:stop]
        self.lm_head.bias = head_bias.contiguous()
        self.rotary = self.local_rotary = phi3_rope(cfg, max_positions, rot,
                                                    self.embedding.dtype,
                                                    self.embedding.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] of a flat step; writes the step's KV into the cache."""
        x, residual = self.forward_layers(self.embedding(input_ids), positions, kv_caches, meta)
        return _layer_norm(residual + x, self.norm, self.norm_bias, self.config.rms_norm_eps)
