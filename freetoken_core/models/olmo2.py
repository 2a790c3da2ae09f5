"""Native OLMo 2, OLMo 3 and EXAONE 4 causal LMs (transformers' ``Olmo2ForCausalLM``,
``Olmo3ForCausalLM``, ``Exaone4ForCausalLM``; GGUF ``olmo2``, which llama.cpp's converter
writes for both OLMos, and ``exaone4``).

Llama's model (llama.py) with OLMo's differences, each computed as transformers computes
it:

- norms after, not before: a block's input goes to the attention as it is; the attention's
  output is normed (``post_attention_layernorm``) and added to the residual stream, which
  goes to the MLP as it is; the MLP's output is normed (``post_feedforward_layernorm``) and
  added;
- q and k RMSNormed over all heads at once (``q_norm`` of ``heads x head_dim`` weights),
  before the rotation;
- OLMo 3: sliding-window layers (every 4th layer global by default) with their own unscaled
  rope, the global layers with the configured one (YaRN in the long-context checkpoints).

EXAONE 4 is the same block with q and k RMSNormed per head (Qwen3's ``head_dim`` weights)
and, where it has a sliding window (the 32B), the sliding layers rotated with the
configured rope (Llama 3's scaling in the checkpoints) and the global layers not rotated at
all (``no_rope_layers``; ``LlamaForCausalLM.forward_layers``).

No one-call native path (its block kernel norms before attention and MLP), and no tensor
parallelism: OLMo's norm over all heads needs every rank's heads (and EXAONE 4's blocks,
which would not, have not been sharded).
"""

from __future__ import annotations

import torch

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.attention import AttentionMetadata
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.layers import rms_norm
from freetoken_core.models.linear import BlockArena
from freetoken_core.models.llama import DecoderLayer, LlamaForCausalLM, Weights
from freetoken_core.models.sharding import Shard


class Olmo2DecoderLayer(DecoderLayer):
    """Llama's block with OLMo's norms after attention and MLP instead of before."""

    def __init__(self, cfg: ModelConfig, weights: Weights, index: int, native: bool,
                 arena: BlockArena | None = None) -> None:
        prefix = f"model.layers.{index}."
        self.post_ff_norm = weights.pop(prefix + "post_feedforward_layernorm.weight")
        weights[prefix + "input_layernorm.weight"] = None  # (none: the input is not normed)
        super().__init__(cfg, weights, index, native, arena)
        self.one_call = None

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                 sin: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(output, residual)`` as ``DecoderLayer``'s: the hidden state is their sum."""
        eps, native = self.eps, self.native
        hidden = x if residual is None else residual + x
        attn = rms_norm(self.self_attention(hidden, cos, sin, kv_cache, meta),
                        self.post_attn_norm, eps, native)
        hidden = hidden + attn
        out = self.mlp(hidden)
        return rms_norm(out, self.post_ff_norm, eps, native), hidden


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2 / OLMo 3 (module docstring): ``forward`` gives hidden states,
    ``compute_logits`` float32 logits, as ``LlamaForCausalLM``'s."""

    layer_class = Olmo2DecoderLayer

    def __init__(self, cfg: ModelConfig, weights: Weights, max_positions: int,
                 shard: Shard | None = None) -> None:
        if shard is not None:
            raise ModelLoadError(
                f"tensor parallelism of {cfg.architecture} is not supported (post-norm "
                "blocks); serve it on one rank (data parallelism replicates it)")
        super().__init__(cfg, weights, max_positions, shard)
        self.set_sliding_rope(cfg.rope_local_theta, max_positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] of a flat step; writes the step's KV into the cache."""
        x, residual = self.forward_layers(self.embedding(input_ids), positions, kv_caches, meta)
        return rms_norm(residual + x, self.norm, self.config.rms_norm_eps, self.native)
