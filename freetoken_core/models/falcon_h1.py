"""Native Falcon-H1 causal LM (transformers' ``FalconH1ForCausalLM``: Falcon-H1 0.5B to 34B,
Falcon-H1R), computed as transformers computes it. Each block runs attention (Llama's, RoPE)
and a Mamba-2 mixer (``mamba2``: a state per running sequence in its scheduler slot,
``recurrent``) side by side on the same normed input, adds their outputs to the residual
stream, then a SwiGLU MLP; with Falcon-H1's µP multipliers (``config_falcon_h1``): the
attention's input, its keys (before the rotation) and its output; the mixer's input, its in
projection's parts ``z`` / ``x`` / ``B`` / ``C`` / ``dt`` (transformers' ``mup_vector``) and its
output; the MLP's gate (before the SiLU) and output; the embeddings and the logits. The mixer's
gated norm as the config says (``ModelConfig.mamba_norm``).

Every layer has keys and values (``kv_layout``: ``hybrid`` layers) and a state; tensor
parallelism is refused and, as for the other recurrent models, the prefix cache is off. GGUF
files hold the multipliers folded into their weights (llama.cpp's converter), so theirs are
1 (``gguf_falcon_h1``)."""

from __future__ import annotations

from typing import Any

import torch

from freetoken_core.models.attention import AttentionMetadata, paged_attention
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.config_falcon_h1 import HybridMultipliers
from freetoken_core.models.layers import add_rms_norm, apply_rope, rms_norm, silu_and_mul
from freetoken_core.models.linear import BlockArena
from freetoken_core.models.llama import DecoderLayer, LlamaForCausalLM, Weights
from freetoken_core.models.mamba2 import Mamba2
from freetoken_core.models.recurrent import RecurrentModel, check_step
from freetoken_core.models.sharding import Shard


class FalconH1Mixer(Mamba2):
    """Falcon-H1's Mamba-2 mixer (transformers' ``FalconH1Mixer``): its input times
    ``ssm_in``, its in projection's parts times ``ssm_projection``."""

    def __init__(self, cfg: ModelConfig, weights: Weights, prefix: str,
                 arena: BlockArena | None, multipliers: HybridMultipliers) -> None:
        super().__init__(cfg, weights, prefix, arena)
        self.in_multiplier = multipliers.ssm_in
        sizes = (self.inner, self.inner, *(2 * [self.groups * self.state_size]), self.heads)
        self.part_multipliers = None
        if set(multipliers.ssm_projection) != {1.0}:
            self.part_multipliers = torch.cat([
                torch.full((size,), value) for size, value in zip(
                    sizes, multipliers.ssm_projection)]).to(self.dt_bias.device,
                                                            self.dt_bias.dtype)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_multiplier != 1.0:
            x = x * self.in_multiplier
        out = self.in_proj(x)
        if self.part_multipliers is None:
            return out
        return out * self.part_multipliers


class FalconH1Layer(DecoderLayer):
    """Falcon-H1's block ``index`` (module docstring): Llama's attention, norms and MLP,
    under Llama's names (``weight_names``), beside the mixer; ``(output, residual)`` as
    Llama's."""

    def __init__(self, cfg: ModelConfig, weights: Weights, index: int, native: bool,
                 arena: BlockArena | None = None) -> None:
        super().__init__(cfg, weights, index, native, arena)
        assert cfg.hybrid_multipliers is not None
        self.multipliers = cfg.hybrid_multipliers
        self.mamba = FalconH1Mixer(cfg, weights, f"model.layers.{index}.", arena,
                                   self.multipliers)
        self.linears = (*self.linears, *self.mamba.linears)
        self.one_call = None  # (the native one-call block is Llama's alone)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None,  # type: ignore[override]
                 cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata, states: Any) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.multipliers
        if residual is None:
            residual = x
            x = rms_norm(x, self.input_norm, self.eps, self.native)
        else:
            x, residual = add_rms_norm(x, residual, self.input_norm, self.eps, self.native)
        assert meta.sequences is not None
        mixed = _times(self.mamba(x, states, meta.sequences), m.ssm_out)
        attended = self.scaled_attention(_times(x, m.attention_in), cos, sin, kv_cache, meta)
        x, residual = add_rms_norm(mixed + _times(attended, m.attention_out), residual,
                                   self.post_attn_norm, self.eps, self.native)
        gate_up = self.gate_up_proj(x)
        if m.mlp_gate != 1.0:
            gate_up[:, :gate_up.shape[1] // 2] *= m.mlp_gate
        return _times(self.down_proj(silu_and_mul(gate_up, self.native)), m.mlp_down), residual

    def scaled_attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Llama's ``self_attention`` of ``x``, the keys times ``key`` before the
        rotation."""
        n, h, kvh, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qk, v = self.qkv_proj(x).split([(h + kvh) * d, kvh * d], dim=-1)
        qk = qk.reshape(n, h + kvh, d)
        if self.multipliers.key != 1.0:
            qk[:, h:] *= self.multipliers.key
        qk = apply_rope(qk.contiguous(), cos, sin, self.native)
        kv = torch.cat([qk[:, h:], v.reshape(n, kvh, d)], dim=1).view(n, 2, kvh, d)
        return self.o_proj(paged_attention(qk[:, :h].contiguous(), kv, kv_cache, meta))


def _times(x: torch.Tensor, multiplier: float) -> torch.Tensor:
    return x if multiplier == 1.0 else x * multiplier


class FalconH1ForCausalLM(RecurrentModel, LlamaForCausalLM):
    """Falcon-H1 (module docstring): ``compute_logits`` times ``lm_head_multiplier``
    (``logit_scale``); ``allocate_states`` makes the mixers' states (``recurrent``)."""

    layer_class = staticmethod(FalconH1Layer)  # type: ignore[assignment]
    family, mixers, mixer_name = "Falcon-H1", "Mamba-2 mixers", "mamba"

    def __init__(self, cfg: ModelConfig, weights: Weights, max_positions: int,
                 shard: Shard | None = None) -> None:
        self.refuse_shard(shard)
        super().__init__(cfg, weights, max_positions)
        self.states = []

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        check_step(self, meta)
        cos, sin = self.rotary.tables(positions)
        x, residual = _times(self.embedding(input_ids), self.config.embedding_multiplier), None
        for layer, cache, states in zip(self.layers, kv_caches, self.states):
            x, residual = layer(x, residual, cos, sin, cache, meta, states)
        return add_rms_norm(x, residual, self.norm, self.config.rms_norm_eps, self.native)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (self.lm_head(hidden) * self.config.logit_scale).float()
