"""Native LFM2 causal LM (Liquid AI's LFM2-350M ... 2.6B: transformers' ``Lfm2ForCausalLM``;
LFM2-8B-A1B, ``Lfm2MoeForCausalLM``, with experts in its MLPs past the first two, routed
by sigmoid scores: ``moe.py``), computed as transformers computes it. Its ``full_attention``
layers are Qwen3's (Llama's block with q/k RMSNorms per head; its names read as Llama's:
``weight_names.py``), its
``conv`` layers the same block with a gated short convolution (``short_conv``) in place of
attention, which keeps per running sequence its convolution's last inputs in the sequence's
scheduler slot (``recurrent``). RMSNorm ``w * x``; tied embeddings; the final norm is the
checkpoint's ``embedding_norm``.

Only the attention layers have keys and values (``kv_layout``); a prefix-cache hit would skip
the convolutions' states, so the engine turns the prefix cache off; tensor parallelism is
refused."""

from __future__ import annotations

from typing import Any

import torch

from freetoken_core.models.attention import AttentionMetadata
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.kv_layout import LayerViews
from freetoken_core.models.layers import add_rms_norm, rms_norm
from freetoken_core.models.linear import BlockArena
from freetoken_core.models.llama import DecoderLayer, LlamaForCausalLM, Weights
from freetoken_core.models.moe import SparseMoE, feed_forward
from freetoken_core.models.recurrent import RecurrentModel, check_step
from freetoken_core.models.sharding import Shard
from freetoken_core.models.short_conv import ShortConv


class ShortConvLayer:
    """An LFM2 ``conv`` layer: ``(output, residual)`` as Llama's block, its mixer the short
    convolution."""

    def __init__(self, cfg: ModelConfig, weights: Weights, index: int, native: bool,
                 arena: BlockArena | None = None) -> None:
        prefix = f"model.layers.{index}."
        self.mixer = ShortConv(cfg, weights, prefix, arena)
        self.mlp = feed_forward(cfg, weights, prefix, index, native, arena)
        self.moe = self.mlp if isinstance(self.mlp, SparseMoE) else None
        self.input_norm = weights.pop(prefix + "input_layernorm.weight")
        self.post_attn_norm = weights.pop(prefix + "post_attention_layernorm.weight")
        self.linears = (*self.mixer.linears, *self.mlp.linears)
        self.eps, self.native = cfg.rms_norm_eps, native
        self.one_call = None

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, states: torch.Tensor,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = rms_norm(x, self.input_norm, self.eps, self.native)
        else:
            x, residual = add_rms_norm(x, residual, self.input_norm, self.eps, self.native)
        assert meta.sequences is not None
        x = self.mixer(x, states, meta.sequences)
        x, residual = add_rms_norm(x, residual, self.post_attn_norm, self.eps, self.native)
        return self.mlp(x), residual


def _layer(cfg: ModelConfig, weights: Weights, index: int, native: bool,
           arena: BlockArena | None = None) -> Any:
    """Layer ``index``: attention (Qwen3's block) or a short convolution."""
    if cfg.layer_kinds[index] == "short_conv":
        return ShortConvLayer(cfg, weights, index, native, arena)
    return DecoderLayer(cfg, weights, index, native, arena)


class Lfm2ForCausalLM(RecurrentModel, LlamaForCausalLM):
    """LFM2 (module docstring): ``forward`` and ``compute_logits`` as Llama's;
    ``allocate_states`` makes the convolutions' states (``recurrent``)."""

    layer_class = staticmethod(_layer)  # type: ignore[assignment]
    family, mixers, mixer_name = "LFM2", "convolution layers", "mixer"

    def __init__(self, cfg: ModelConfig, weights: Weights, max_positions: int,
                 shard: Shard | None = None) -> None:
        self.refuse_shard(shard)
        super().__init__(cfg, weights, max_positions)
        self.states = []
        self.views = LayerViews(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        check_step(self, meta)
        cos, sin = self.rotary.tables(positions)
        x, residual = self.embedding(input_ids), None
        for layer, cache, states in zip(self.layers, self.views(kv_caches), self.states):
            if states is not None:
                x, residual = layer(x, residual, states, meta)
            else:
                x, residual = layer(x, residual, cos, sin, cache, meta)
        return add_rms_norm(x, residual, self.norm, self.config.rms_norm_eps, self.native)[0]
