"""Native GLM-4.5 causal LM (transformers' ``Glm4MoeForCausalLM``: GLM-4.5, GLM-4.5-Air,
GLM-4.6), computed as transformers computes it: Llama's block (llama.py) with q/k/v biases,
q/k norms where ``use_qk_norm``, RoPE on the first half of each head (NEOX pairs within it:
Phi-3's partial rotation, ``phi3.head_order``: each q and k head's rows, biases and norm
weights reordered so that Llama's full-width rotation turns them, the passed dimensions at
angle 0), and past the first ``first_k_dense_replace`` layers a mixture of experts routed by
sigmoid scores, chosen with the router's ``e_score_correction_bias`` among the best groups,
beside ungated shared experts (``moe.py``). The checkpoints' multi-token-prediction layers
(``model.layers.{num_hidden_layers}`` on) are not read, as transformers does not.

MiniMax-M2 (``MiniMaxM2ForCausalLM``: M2, M2.1, M2.5) is the same computation with q/k
RMSNorms over all the heads at once (their weights reordered head by head), no biases, and
experts in every layer without groups or shared experts (``config_moe.minimax_m2_fields``)."""

from __future__ import annotations

import re

import torch

from freetoken_core.models.config import ModelConfig
from freetoken_core.models.glm4 import reorder_qk_heads
from freetoken_core.models.llama import LlamaForCausalLM, Weights
from freetoken_core.models.phi3 import head_order, phi3_rope, reorder_rows, rotary_dim
from freetoken_core.models.sharding import Shard

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def drop_extra_layers(weights: Weights, num_layers: int) -> None:
    """The weights of layers ``num_layers`` on (checkpoints' multi-token-prediction layers,
    which transformers does not read) removed from ``weights``."""
    for name in [k for k in weights if (m := _LAYER.match(k)) and int(m.group(1)) >= num_layers]:
        del weights[name]


class Glm4MoeForCausalLM(LlamaForCausalLM):
    """GLM-4.5 (module docstring); ``forward`` and ``compute_logits`` as Llama's, with
    Phi-3's partial rotation tables."""

    def __init__(self, cfg: ModelConfig, weights: Weights, max_positions: int,
                 shard: Shard | None = None) -> None:
        drop_extra_layers(weights, cfg.num_layers)  # (the multi-token-prediction layers)
        rot = rotary_dim(cfg)
        if rot < cfg.head_dim:
            order = head_order(cfg.head_dim, rot)
            for i in range(cfg.num_layers):
                attn = f"model.layers.{i}.self_attn."
                reorder_qk_heads(weights, attn, cfg, order)
                for norm in ("q_norm", "k_norm"):  # (a weight a head dimension, or a
                    key = f"{attn}{norm}.weight"  # head's dimensions each: MiniMax-M2's)
                    if key in weights:
                        heads = weights[key].shape[0] // cfg.head_dim
                        weights[key] = reorder_rows(weights[key], (
                            torch.arange(heads)[:, None] * cfg.head_dim + order).reshape(-1))
        super().__init__(cfg, weights, max_positions, shard)
        self.rotary = phi3_rope(cfg, max_positions, rot, self.embedding.dtype,
                                self.embedding.device)
