"""Native Llama 4 causal LM (transformers' ``Llama4ForCausalLM`` and the language model of
``Llama4ForConditionalGeneration``: Llama 4 Scout 17B-16E, Maverick 17B-128E; llama.cpp's
``llama4``), computed as transformers computes it. Llama's block (llama.py), except:

- RoPE on the layers ``no_rope_layers`` marks 1 (three in four), on adjacent pairs of each
  head's dimensions (transformers' complex rotation): each q and k head's rows are reordered,
  its even dimensions first, so that Llama's half rotation turns each pair (the scores are
  the same dot products; the values are untouched). The other layers (NoPE) get the identity
  rotation, cos 1 and sin 0, which leaves every float as it is;
- ``use_qk_norm``: on the rotating layers, the rotated queries and keys RMS-normalized per
  head without a weight (transformers' ``Llama4TextL2Norm``; a weight of ones);
- the attention temperature on the NoPE layers (``attn_temperature_tuning``): each query
  times ``1 + attn_scale ln(1 + floor((position + 1) / floor_scale))``, in float32;
- chunked attention on the ``chunked_attention`` layers (``ModelConfig.layer_chunks``): a
  query attends to the keys of its own chunk of ``attention_chunk_size`` positions only
  (``AttentionMetadata.with_chunk``; the native kernel's ``attention_chunk``);
- the MLP of the layers ``moe_layers`` lists is a shared expert plus the experts a token's
  top ``num_experts_per_tok`` router logits choose (:class:`Llama4Experts`); the others' a
  SwiGLU of ``intermediate_size_mlp``.

The weights, by transformers' names: ``feed_forward.*`` (read as ``mlp.*``: the router
``feed_forward.router`` as ``mlp.gate``, ``feed_forward.shared_expert`` as the ungated
``mlp.shared_experts``, the fused experts ``gate_up_proj`` ``[experts, hidden, 2 x size]`` and
``down_proj`` ``[experts, size, hidden]`` transposed to the ``[out, in]`` layout ``moe.py``
reads), or a GGUF file's per-expert names (``gguf_llama4``).
"""

from __future__ import annotations

import dataclasses

import torch

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.attention import AttentionMetadata
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.glm4 import reorder_qk_heads
from freetoken_core.models.layers import add_rms_norm
from freetoken_core.models.linear import BlockArena
from freetoken_core.models.llama import DecoderLayer, LlamaForCausalLM, Weights
from freetoken_core.models.moe import SparseMoE
from freetoken_core.models.sharding import Shard

# transformers' names of a layer's MLP weights -> the names llama.py and moe.py read.
_RENAMES = ((".feed_forward.router.", ".mlp.gate."),
            (".feed_forward.shared_expert.", ".mlp.shared_experts."),
            (".feed_forward.", ".mlp."))


class Llama4Experts(SparseMoE):
    """Llama 4's experts (transformers' ``Llama4TextMoe``; llama.cpp's ``build_moe_ffn`` with
    ``weight_before_ffn``): a token's top ``num_experts_per_tok`` router logits choose its
    experts, and each chosen expert computes the token's input times the sigmoid of its
    logit (the others, given zeros, add nothing); the shared expert is added unweighted."""

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights, experts)``, each ``[tokens, top_k]``: the top k logits' sigmoids
        (float32, then ``x``'s dtype, as transformers' router) and their experts."""
        top, chosen = torch.topk(self.router(x), self.top_k, dim=-1)
        return torch.sigmoid(top.float()).to(x.dtype), chosen

    def experts_sum(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor
                    ) -> torch.Tensor:
        """Each token's sum of its chosen experts' outputs of its input times their weight:
        every (token, expert) pair one row of the experts' computation (in one native call
        where they compute from GGUF blocks), a token's rows summed from the lowest expert
        up, as transformers sums every expert's output."""
        k = chosen.shape[1]
        if k > 1:
            chosen, order = chosen.sort(dim=1)
            weights = weights.gather(1, order)
        inputs = (x[:, None, :] * weights[:, :, None]).reshape(-1, x.shape[-1])
        ones = torch.ones(inputs.shape[0], 1, dtype=x.dtype, device=x.device)
        out = super().experts_sum(inputs, ones, chosen.reshape(-1, 1)).view(len(x), k, -1)
        total = out[:, 0]
        for slot in range(1, k):
            total = total + out[:, slot]
        return total


class Llama4DecoderLayer(DecoderLayer):
    """Llama's block with Llama 4's experts and its weightless q/k norm after the rotation
    (on the rotating layers, where ``use_qk_norm``)."""

    moe_class = Llama4Experts

    def __init__(self, cfg: ModelConfig, weights: Weights, index: int, native: bool,
                 arena: BlockArena | None = None) -> None:
        super().__init__(dataclasses.replace(cfg, qk_norm=False), weights, index, native,
                         arena)
        if cfg.qk_norm and cfg.no_rope_layers[index]:
            self.q_norm = self.k_norm = torch.ones(cfg.head_dim, dtype=self.input_norm.dtype,
                                                   device=self.input_norm.device)
            self.norm_after_rope = True
            self.one_call = None  # (llama_layer has no q/k norm)


def llama4_weights(weights: Weights, cfg: ModelConfig) -> None:
    """``weights`` under the names llama.py and moe.py read, in place (module docstring),
    the rotating layers' q and k rows (and biases) with each head's even dimensions first."""
    for name in [k for k in weights if ".feed_forward." in k]:
        tensor = weights.pop(name)
        new = next(name.replace(old, to) for old, to in _RENAMES if old in name)
        if new.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            size = cfg.moe_intermediate_size
            want = ((cfg.hidden_size, 2 * size) if new.endswith("gate_up_proj")
                    else (size, cfg.hidden_size))
            if tensor.dim() != 3 or tuple(tensor.shape) != (cfg.num_experts, *want):
                raise ModelLoadError(f"{name} has shape {list(tensor.shape)}; expected "
                                     f"{[cfg.num_experts, *want]}")
            tensor = tensor.transpose(1, 2).contiguous()
        weights[new] = tensor
    d = cfg.head_dim
    pairs = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
    for i, rotates in enumerate(cfg.no_rope_layers):
        if rotates:
            reorder_qk_heads(weights, f"model.layers.{i}.self_attn.", cfg, pairs)


class Llama4ForCausalLM(LlamaForCausalLM):
    """Llama 4 (module docstring); ``compute_logits`` as Llama's."""

    layer_class = Llama4DecoderLayer

    def __init__(self, cfg: ModelConfig, weights: Weights, max_positions: int,
                 shard: Shard | None = None) -> None:
        llama4_weights(weights, cfg)
        super().__init__(cfg, weights, max_positions, shard)
        # Each layer's chunk, None where it has none or where it is as long as the context
        # (it limits nothing); the one-call kernel attends to every key.
        self.chunks = [c if c and c < max_positions else None
                       for c in cfg.layer_chunks or (0,) * cfg.num_layers]
        for layer, chunk in zip(self.layers, self.chunks):
            if chunk is not None:
                layer.one_call = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] of a flat step; writes the step's KV into the cache.
        The blocks in order, each with its rotation (or the identity), its chunk's metadata
        and, on the NoPE layers, the attention temperature."""
        x = self.embedding(input_ids)
        cos, sin = self.rotary.tables(positions)
        ropes = {1: (cos, sin), 0: (torch.ones_like(cos), torch.zeros_like(cos))}
        scales = self.temperature(positions)
        metas: dict[tuple[int | None, int], AttentionMetadata] = {}
        residual = None
        for layer, rotates, chunk, cache in zip(self.layers, self.config.no_rope_layers,
                                                self.chunks, kv_caches):
            if (chunk, rotates) not in metas:
                metas[chunk, rotates] = meta.with_chunk(chunk)
                if not rotates and scales is not None:
                    metas[chunk, rotates] = dataclasses.replace(metas[chunk, rotates],
                                                                query_scales=scales)
            x, residual = layer(x, residual, *ropes[rotates], cache, metas[chunk, rotates])
        return add_rms_norm(x, residual, self.norm, self.config.rms_norm_eps, self.native)[0]

    def temperature(self, positions: torch.Tensor) -> torch.Tensor | None:
        """The NoPE layers' query multipliers [T] (float32), transformers' ``attn_scales``:
        ``log1p(floor((position + 1) / floor_scale)) * attn_scale + 1``; None where the
        config has no temperature or every multiplier of the step is 1."""
        scale, floor = (self.config.attention_temperature_beta,
                        self.config.attention_temperature_length)
        if not scale or positions.numel() == 0 or int(positions.max()) + 1 < floor:
            return None
        return torch.log1p(torch.floor((positions.float() + 1.0) / floor)) * scale + 1.0
