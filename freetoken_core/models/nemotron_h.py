"""Native Nemotron-H causal LM (transformers' ``NemotronHForCausalLM``: Nemotron-H 4B/8B/47B,
Nemotron Nano 2 9B/12B), computed as transformers computes it. Each block is one sub-layer,
``x + mixer(norm(x))``, its mixer per ``hybrid_override_pattern`` / ``layers_block_type``:
Mamba-2 (``M``, ``mamba2``: a state per running sequence in its scheduler slot,
``recurrent``), attention without positional encoding (``*``), an MLP ``down(relu(up(x))^2)``
(``-``), or (``E``: Nemotron 3 Nano) experts of that MLP chosen by sigmoid scores plus a
selection bias among groups, beside a shared one (``moe.py``). RMSNorm ``w * x`` with the
weight multiplied in float32. Tensor parallelism is refused and, as for the other recurrent
models, the prefix cache is off."""

from __future__ import annotations

from typing import Any

import torch

from freetoken_core.models.attention import AttentionMetadata, paged_attention
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.kv_layout import LayerViews
from freetoken_core.models.layers import float32_weight_add_rms_norm, float32_weight_rms_norm
from freetoken_core.models.linear import BlockArena, make_linear
from freetoken_core.models.llama import LlamaForCausalLM, Weights
from freetoken_core.models.mamba2 import Mamba2
from freetoken_core.models.moe import SparseMoE
from freetoken_core.models.recurrent import RecurrentModel, check_step
from freetoken_core.models.sharding import Shard


class NemotronHBlock:
    """Nemotron-H's block ``index`` (module docstring): ``(output, residual)`` as Llama's."""

    def __init__(self, cfg: ModelConfig, weights: Weights, index: int, native: bool,
                 arena: BlockArena | None = None) -> None:
        prefix = f"model.layers.{index}."
        mixer = prefix + "mixer."
        self.kind = cfg.layer_kinds[index]
        self.mamba: Mamba2 | None = None
        self.moe: SparseMoE | None = None
        if self.kind == "mamba":
            self.mamba = Mamba2(cfg, weights, prefix, arena, name="mixer")
            linears = self.mamba.linears
        elif self.kind == "moe":  # (its mixer's tensors under the names moe.py reads)
            for name in [k for k in weights if k.startswith(mixer)]:
                weights[prefix + "mlp." + name[len(mixer):].replace(
                    "gate.e_score_correction_bias", "expert_bias")] = weights.pop(name)
            self.moe = SparseMoE(cfg, weights, prefix, native, arena)
            linears = self.moe.linears
        elif self.kind == "attention":
            self.qkv_proj = make_linear([weights.pop(f"{mixer}{p}_proj.weight") for p in "qkv"],
                                        arena=arena)
            self.o_proj = make_linear([weights.pop(mixer + "o_proj.weight")], arena=arena)
            linears = (self.qkv_proj, self.o_proj)
        else:  # (mlp)
            self.up_proj = make_linear([weights.pop(mixer + "up_proj.weight")],
                                       weights.pop(mixer + "up_proj.bias", None), arena=arena)
            self.down_proj = make_linear([weights.pop(mixer + "down_proj.weight")],
                                         weights.pop(mixer + "down_proj.bias", None), arena=arena)
            linears = (self.up_proj, self.down_proj)
        self.norm = weights.pop(prefix + "norm.weight").float()
        self.linears = tuple(linears)
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_heads, cfg.num_kv_heads,
                                                            cfg.head_dim)
        self.eps, self.native = cfg.rms_norm_eps, native
        self.one_call = None

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None,
                 kv_cache: torch.Tensor | None, meta: AttentionMetadata, states: Any
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = float32_weight_rms_norm(x, self.norm, self.eps, self.native)
        else:
            x, residual = float32_weight_add_rms_norm(x, residual, self.norm, self.eps,
                                                      self.native)
        if self.mamba is not None:
            assert meta.sequences is not None
            return self.mamba(x, states, meta.sequences), residual
        if self.moe is not None:
            return self.moe(x), residual
        if self.kind == "attention":
            assert kv_cache is not None
            n, h, kvh, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
            q, k, v = self.qkv_proj(x).split([h * d, kvh * d, kvh * d], dim=-1)
            kv = torch.cat([k.reshape(n, kvh, d), v.reshape(n, kvh, d)], dim=1).view(n, 2,
                                                                                  kvh, d)
            return self.o_proj(paged_attention(q.reshape(n, h, d).contiguous(), kv, kv_cache,
                                               meta)), residual
        return self.down_proj(torch.square(torch.relu(self.up_proj(x)))), residual


class NemotronHForCausalLM(RecurrentModel, LlamaForCausalLM):
    """Nemotron-H (module docstring): ``compute_logits`` as Llama's; ``allocate_states``
    makes the Mamba-2 blocks' states (``recurrent``)."""

    layer_class = staticmethod(NemotronHBlock)  # type: ignore[assignment]
    family, mixers, mixer_name = "Nemotron-H", "Mamba-2 blocks", "mamba"

    def __init__(self, cfg: ModelConfig, weights: Weights, max_positions: int,
                 shard: Shard | None = None) -> None:
        self.refuse_shard(shard)
        for name in [k for k in weights if k.startswith("mtp.")]:
            del weights[name]  # (multi-token prediction: not used)
        super().__init__(cfg, weights, max_positions)
        self.norm = self.norm.float()
        self.states = []
        self.views = LayerViews(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        check_step(self, meta)
        x, residual = self.embedding(input_ids), None
        for layer, cache, states in zip(self.layers, self.views(kv_caches), self.states):
            x, residual = layer(x, residual, cache, meta, states)
        return float32_weight_add_rms_norm(x, residual, self.norm, self.config.rms_norm_eps,
                                           self.native)[0]
