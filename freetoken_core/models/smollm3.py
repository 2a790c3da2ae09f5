"""Native SmolLM3 causal LM (transformers' ``SmolLM3ForCausalLM``; llama.cpp's ``smollm3``).

Llama's model exactly, except that the layers ``no_rope_layers`` marks 0 (every 4th in the
released models) do not rotate queries and keys (NoPE). Those layers get the identity
rotation, cos 1 and sin 0, which leaves every float as it is; the blocks then run one call
each (the all-blocks call takes one rotation for every block)."""

from __future__ import annotations

import torch

from freetoken_core.models.attention import AttentionMetadata
from freetoken_core.models.layers import add_rms_norm
from freetoken_core.models.llama import LlamaForCausalLM


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """SmolLM3 as Llama with NoPE layers (module docstring)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] of a flat step; writes the step's KV into the cache."""
        x, residual = self.forward_layers(self.embedding(input_ids), positions, kv_caches, meta)
        return add_rms_norm(x, residual, self.norm, self.config.rms_norm_eps, self.native)[0]
