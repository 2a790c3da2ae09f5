"""Native GLM-4 causal LM (transformers' ``Glm4ForCausalLM``: GLM-4-9B-0414, GLM-4-32B-0414,
GLM-Z1; GGUF ``glm4``).

Llama's model (llama.py) with GLM-4's differences, each computed as transformers computes
it:

- four RMSNorms a block: the input norm, a norm of the attention's output before it joins
  the residual stream (``post_self_attn_layernorm``), the MLP's input norm
  (``post_attention_layernorm``) and a norm of the MLP's output (``post_mlp_layernorm``);
- biases on the q/k/v projections (``attention_bias``), none on the o projection;
- the gate and up projections one tensor (``gate_up_proj``, gate rows first), split here
  into Llama's two (which the Llama block fuses again, in the same order);
- RoPE on the first ``partial_rotary_factor`` (default 0.5) of each head, on **adjacent**
  pairs ``(2i, 2i + 1)`` turning at ``base^(-2i / rotary_dim)`` (transformers' GLM
  ``rotate_half``; llama.cpp's ``ROPE_TYPE_NORM`` on the same, unpermuted, weights).
  Each q and k head's rows (and biases) are reordered so that those pairs become the
  half-offset pairs Phi-3's partial rotation uses (``phi3.head_order``): dimension ``2i`` of
  the rotated part to ``i``, ``2i + 1`` to ``i + rotary_dim / 2``; q·k does not depend on
  the order, and the value rows keep theirs.
"""

from __future__ import annotations

import torch

from freetoken_core.models.attention import AttentionMetadata
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.layers import add_rms_norm, rms_norm
from freetoken_core.models.linear import BlockArena
from freetoken_core.models.llama import DecoderLayer, LlamaForCausalLM, Weights
from freetoken_core.models.phi3 import (
    head_order,
    phi3_rope,
    reorder_rows,
    rotary_dim,
    split_rows,
)
from freetoken_core.models.sharding import Shard


def interleaved_head_order(head_dim: int, rot: int) -> torch.Tensor:
    """Within a head, the original dimension each new one takes: GLM's adjacent rotary pairs
    ``(2i, 2i + 1)`` made half-offset pairs ``(i, i + rot / 2)``, then Phi-3's
    ``head_order`` (the passed dimensions between the halves)."""
    neox = torch.cat([torch.arange(0, rot, 2), torch.arange(1, rot, 2),
                      torch.arange(rot, head_dim)])
    return neox[head_order(head_dim, rot)]


def unfuse_layer(weights: Weights, prefix: str, cfg: ModelConfig, rot: int) -> None:
    """Layer ``prefix``'s GLM-4 weights as Llama's, in place: the q and k rows (and biases)
    reordered for the rotation, gate and up split."""
    attn, mlp = prefix + "self_attn.", prefix + "mlp."
    size = cfg.intermediate_size
    weights[mlp + "gate_proj.weight"], weights[mlp + "up_proj.weight"] = split_rows(
        weights.pop(mlp + "gate_up_proj.weight"), [size, size])
    reorder_qk_heads(weights, attn, cfg, interleaved_head_order(cfg.head_dim, rot))


def reorder_qk_heads(weights: Weights, attn: str, cfg: ModelConfig, order: torch.Tensor
                     ) -> None:
    """The q and k rows (and biases) under ``attn`` reordered within each head, in place:
    new dimension ``j`` of a head is its dimension ``order[j]``."""
    d = cfg.head_dim
    for name, heads in (("q", cfg.num_heads), ("k", cfg.num_kv_heads)):
        rows = (torch.arange(heads)[:, None] * d + order[None, :]).reshape(-1)
        for kind in ("weight", "bias"):
            key = f"{attn}{name}_proj.{kind}"
            if key in weights:
                weights[key] = reorder_rows(weights[key], rows)


class Glm4DecoderLayer(DecoderLayer):
    """Llama's block with GLM-4's norms of the attention's and the MLP's outputs."""

    def __init__(self, cfg: ModelConfig, weights: Weights, index: int, native: bool,
                 arena: BlockArena | None = None) -> None:
        prefix = f"model.layers.{index}."
        self.post_self_attn_norm = weights.pop(prefix + "post_self_attn_layernorm.weight")
        self.post_mlp_norm = weights.pop(prefix + "post_mlp_layernorm.weight")
        super().__init__(cfg, weights, index, native, arena)
        self.one_call = None  # (llama_layer has no room for the two extra norms)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                 sin: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(output, residual)`` as ``DecoderLayer``'s."""
        eps, native = self.eps, self.native
        if residual is None:
            residual = x
            x = rms_norm(x, self.input_norm, eps, native)
        else:
            x, residual = add_rms_norm(x, residual, self.input_norm, eps, native)
        x = rms_norm(self.self_attention(x, cos, sin, kv_cache, meta), self.post_self_attn_norm,
                     eps, native)
        x, residual = add_rms_norm(x, residual, self.post_attn_norm, eps, native)
        x = self.mlp(x)
        return rms_norm(x, self.post_mlp_norm, eps, native), residual


class Glm4ForCausalLM(LlamaForCausalLM):
    """GLM-4 as Llama (module docstring); ``forward`` and ``compute_logits`` as
    ``LlamaForCausalLM``'s, with Phi-3's partial rotation tables."""

    layer_class = Glm4DecoderLayer

    def __init__(self, cfg: ModelConfig, weights: Weights, max_positions: int,
                 shard: Shard | None = None) -> None:
        rot = rotary_dim(cfg)
        for i in range(cfg.num_layers):
            unfuse_layer(weights, f"model.layers.{i}.", cfg, rot)
        super().__init__(cfg, weights, max_positions, shard)
        self.rotary = phi3_rope(cfg, max_positions, rot, self.embedding.dtype,
                                self.embedding.device)
