"""Native ERNIE 4.5 dense causal LM (transformers' ``Ernie4_5ForCausalLM``: ERNIE-4.5-0.3B;
GGUF ``ernie4_5``).

Llama's model (llama.py) with ERNIE 4.5's differences, each computed as transformers computes
it:

- RoPE over the whole head on **adjacent** pairs ``(2i, 2i + 1)``, pair ``i`` turning at
  ``base^(-2i / head_dim)`` (transformers' GLM ``rotate_half`` with cos and sin
  ``repeat_interleave``d; llama.cpp's ``ROPE_TYPE_NORM`` on the same weights, which its
  converter writes unpermuted). Each q and k head's rows (and biases) are reordered at load,
  dimension ``2i`` to ``i`` and ``2i + 1`` to ``i + head_dim / 2``, so that Llama's
  half-offset rotation (and the native kernels, the one-call block included) turns the same
  pairs by the same angles; q·k does not depend on the order, and the value rows keep
  theirs;
- ``use_bias``: biases on q/k/v, o and the gate/up/down projections (none on the head),
  which Llama's block adds where the checkpoint has them;
- transformers' config defaults where config.json leaves a key out (``head_dim`` 128, two
  KV heads, rope base 500,000, tied embeddings: ``config_defaults.ernie4_5_config``); only
  the default rope, as the released checkpoints have it.

transformers rotates in float32 whatever the model's dtype; in float32 the two are the same
computation, in bfloat16 FreeToken rotates as its Llama does (tables in bfloat16).
"""

from __future__ import annotations

from freetoken_core.models.config import ModelConfig
from freetoken_core.models.glm4 import interleaved_head_order, reorder_qk_heads
from freetoken_core.models.llama import LlamaForCausalLM, Weights
from freetoken_core.models.sharding import Shard


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    """ERNIE 4.5 as Llama (module docstring): its q/k rows reordered, then Llama's model."""

    def __init__(self, cfg: ModelConfig, weights: Weights, max_positions: int,
                 shard: Shard | None = None) -> None:
        # The whole head rotates: GLM's adjacent pairs made half-offset ones over all of it.
        order = interleaved_head_order(cfg.head_dim, cfg.head_dim)
        for i in range(cfg.num_layers):
            reorder_qk_heads(weights, f"model.layers.{i}.self_attn.", cfg, order)
        super().__init__(cfg, weights, max_positions, shard)
