"""Native Cohere Command causal LMs: transformers' ``CohereForCausalLM`` (Command-R, Command
R+, Aya 23, Aya Expanse; GGUF ``command-r``) and ``Cohere2ForCausalLM`` (Command R7B,
Command A; GGUF ``cohere2``).

Llama's model (llama.py) with Cohere's differences, each computed as transformers computes
it:

- a parallel block: one input norm, whose output both the attention and the MLP read;
  the block's output is ``x + attention + mlp`` (in that order: the attention's output
  joins the residual stream first, the MLP's is passed on as the block's output);
- Cohere's LayerNorm (``layers.layer_norm``: the mean subtracted, a weight and no bias,
  eps ``layer_norm_eps``) for the input norms and the final norm, in float32 op for op;
- Command R+'s q/k norms (``use_qk_norm``): the same LayerNorm over each head, with one
  weight per head (``[heads, head_dim]``), before the rotation;
- RoPE on **adjacent** pairs ``(2i, 2i + 1)`` (transformers' ``repeat_interleave`` of the
  frequencies and its Cohere ``rotate_half``; llama.cpp's ``ROPE_TYPE_NORM`` on the same,
  unpermuted, weights). Each q and k head's rows (and biases, and the q/k norms' columns)
  are reordered at load so that those pairs become Llama's half-offset pairs (GLM-4's
  ``interleaved_head_order`` over the whole head): q·k and the per-head LayerNorm do not
  depend on the order, and the value rows keep theirs;
- the logits multiplied by ``logit_scale`` (in the model's dtype, then float32);
- Cohere 2: sliding-window layers (``layer_types``, or every ``sliding_window_pattern``-th
  layer global, default 4) that rotate, beside global layers that attend to every key and
  do not rotate at all (NoPE: ``no_rope_layers``, as ``LlamaForCausalLM.forward_layers``
  honours it); no q/k norms.

Tied embeddings are the configs' default (``tie_word_embeddings``). No one-call native path
(its block kernel is Llama's sequential pre-norm block), and no tensor parallelism: the
per-head q/k norm weights are not sharded.
"""

from __future__ import annotations

import torch

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.attention import AttentionMetadata
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.glm4 import interleaved_head_order, reorder_qk_heads
from freetoken_core.models.layers import layer_norm
from freetoken_core.models.linear import BlockArena
from freetoken_core.models.llama import DecoderLayer, LlamaForCausalLM, Weights
from freetoken_core.models.sharding import Shard


def reorder_heads(weights: Weights, prefix: str, cfg: ModelConfig) -> None:
    """Layer ``prefix``'s q and k rows (and biases) reordered in place so that each head's
    adjacent rotary pairs are half-offset pairs, and the q/k norms' columns with them."""
    order = interleaved_head_order(cfg.head_dim, cfg.head_dim)
    attn = prefix + "self_attn."
    reorder_qk_heads(weights, attn, cfg, order)
    for name in ("q", "k"):
        norm = f"{attn}{name}_norm.weight"
        if norm in weights:
            weights[norm] = weights[norm][..., order]


class CohereDecoderLayer(DecoderLayer):
    """Cohere's parallel block: one LayerNorm, attention and MLP both of its output."""

    def __init__(self, cfg: ModelConfig, weights: Weights, index: int, native: bool,
                 arena: BlockArena | None = None) -> None:
        prefix = f"model.layers.{index}."
        weights[prefix + "post_attention_layernorm.weight"] = None  # (one norm a block)
        super().__init__(cfg, weights, index, native, arena)
        self.one_call = None

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                 sin: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(output, residual)`` as ``DecoderLayer``'s: the hidden state is their sum
        (here the MLP's output and the stream with the attention's added, so that the next
        block's sum adds them in transformers' order)."""
        hidden = x if residual is None else residual + x
        normed = layer_norm(hidden, self.input_norm, self.eps)
        attn = self.self_attention(normed, cos, sin, kv_cache, meta)
        return self.mlp(normed), hidden + attn

    def normed_qk(self, qk: torch.Tensor) -> torch.Tensor:
        """Command R+'s q/k norms: each head LayerNormed with its own weight."""
        h = self.num_heads
        return torch.cat([layer_norm(qk[:, :h], self.q_norm, self.eps),
                          layer_norm(qk[:, h:], self.k_norm, self.eps)], dim=1)


class CohereForCausalLM(LlamaForCausalLM):
    """Cohere and Cohere 2 (module docstring): ``forward`` gives hidden states,
    ``compute_logits`` float32 logits times ``logit_scale``."""

    layer_class = CohereDecoderLayer

    def __init__(self, cfg: ModelConfig, weights: Weights, max_positions: int,
                 shard: Shard | None = None) -> None:
        if shard is not None:
            raise ModelLoadError(
                f"tensor parallelism of {cfg.architecture} is not supported (per-head q/k "
                "norm weights); serve it on one rank (data parallelism replicates it)")
        for i in range(cfg.num_layers):
            reorder_heads(weights, f"model.layers.{i}.", cfg)
        super().__init__(cfg, weights, max_positions, shard)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] of a flat step; writes the step's KV into the cache."""
        x, residual = self.forward_layers(self.embedding(input_ids), positions, kv_caches, meta)
        return layer_norm(residual + x, self.norm, self.config.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (self.lm_head(hidden) * self.config.logit_scale).float()
