"""Native Gemma 3n causal LM, text only (transformers' ``Gemma3nForCausalLM``, and the language
model of ``Gemma3nForConditionalGeneration``: E2B, E4B).

Gemma 4's attention, norms and per-layer embeddings (gemma4.py: RMSNorm ``x * w`` in float32,
q/k normed per head and the values by a norm without a weight, the scores unscaled, each
layer type its rope, the last ``kv_shared_layers`` layers attending to the keys and values of
the last earlier layer of their type) with Gemma 3n's differences (config_gemma3n.py reads
them), each computed as transformers computes it:

- AltUp: the model carries ``n`` copies of the hidden state, the embedding and its ``n - 1``
  projections (each rescaled to the embedding's root mean square, the projection's clamped
  to at least 1e-5 squared). Each layer first *predicts*: the router's modalities
  ``tanh(router(norm(copy[a]) / hidden))`` give each copy ``i`` the coefficients
  ``P[i, j]``, and ``pred[i] = copy[i] + sum_j P[i, j] copy[j]``; the layer computes on
  ``pred[a]`` (``a``: ``altup_active_idx``); then it *corrects*: with the modalities of its
  output ``y``, ``copy[i] = pred[i] + (y - pred[a]) (C[i] + 1)``. The coefficients are not
  clipped (``altup_coef_clip`` is transformers' training-time clamp);
- the layer: ``x = norm(pred[a])``; LAuReL ``x + norm(right(left(x)))`` beside attention;
  ``h = (pred[a] + norm(attn(x)) + laurel) / sqrt(2)``; ``y = h + norm(mlp(norm(h)))``;
- the MLP's gate, in the layers with an activation sparsity ``s`` > 0, is
  ``relu(gate - mean - std * icdf(s))`` before GELU-tanh (mean and population standard
  deviation over the gate's features: a Gaussian top-k);
- the per-layer input: the corrected ``copy[a]`` (times ``correct_output_scale`` where
  ``altup_correct_scale``) through the gate, GELU-tanh, times the layer's per-layer input,
  projected and normed, is added to copies ``1 ... n - 1``; a token past
  ``vocab_size_per_layer_input`` takes token 0's per-layer embedding;
- at the end, copies ``1 ... n - 1`` unembedded by their projections, each rescaled to copy
  0's root mean square; the final norm of the copies' mean; tied embeddings times
  ``sqrt(hidden)``; the logits softcapped (``final_logit_softcapping``, 30).

Tensor parallelism is refused (one rank, or data parallelism).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.attention import AttentionMetadata
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.gemma4 import Gemma4DecoderLayer, Gemma4ForCausalLM
from freetoken_core.models.layers import float32_weight_rms_norm
from freetoken_core.models.linear import BlockArena, make_linear
from freetoken_core.models.llama import Weights
from freetoken_core.models.sharding import Shard


def _shaped(weights: Weights, name: str, shape: tuple[int, ...]) -> Any:
    """``weights[name]``, popped, checked to be of ``shape``."""
    w = weights.pop(name)
    if tuple(w.shape) != shape:
        raise ModelLoadError(f"{name} has shape {list(w.shape)}; expected {list(shape)}")
    return w


class Gemma3nDecoderLayer(Gemma4DecoderLayer):
    """Gemma 3n's block ``index`` (module docstring): ``layer(copies, ...)`` are the copies
    of the hidden state after it."""

    def __init__(self, cfg: ModelConfig, weights: Weights, index: int, native: bool,
                 arena: BlockArena | None = None) -> None:
        super().__init__(cfg, weights, index, native, arena)
        prefix, hidden = f"model.layers.{index}.", cfg.hidden_size
        copies, self.active, scaled = cfg.altup
        rank = cfg.laurel_rank

        def linear(name: str, shape: tuple[int, int]) -> Any:
            return make_linear([_shaped(weights, prefix + name, shape)], arena=arena)

        self.router = linear("altup.modality_router.weight", (copies, hidden))
        self.prediction_coefs = linear("altup.prediction_coefs.weight", (copies ** 2, copies))
        self.correction_coefs = linear("altup.correction_coefs.weight", (copies, copies))
        self.router_norm = _shaped(weights, prefix + "altup.router_norm.weight",
                                   (hidden,)).float()
        scale = _shaped(weights, prefix + "altup.correct_output_scale", (hidden,))
        self.correct_scale = scale if scaled else None
        self.laurel_left = linear("laurel.linear_left.weight", (rank, hidden))
        self.laurel_right = linear("laurel.linear_right.weight", (hidden, rank))
        self.laurel_norm = _shaped(weights, prefix + "laurel.post_laurel_norm.weight",
                                   (hidden,)).float()
        self.linears += (self.router, self.prediction_coefs, self.correction_coefs,
                         self.laurel_left, self.laurel_right)
        size = (cfg.layer_intermediate_sizes or (cfg.intermediate_size,) * cfg.num_layers)[index]
        if self.gate_up_proj.out_features != 2 * size:
            raise ModelLoadError(f"{prefix}mlp.gate_proj.weight has "
                                 f"{self.gate_up_proj.out_features // 2} rows; the config's "
                                 f"intermediate_size of layer {index} is {size}")
        sparsity = cfg.activation_sparsity[index] if cfg.activation_sparsity else 0.0
        # (transformers' multiplier: the standard normal's quantile, in float32)
        self.std_multiplier = None if sparsity <= 0.0 else torch.distributions.Normal(
            0.0, 1.0).icdf(torch.tensor(sparsity, dtype=torch.float32))
        self.router_scale = 1.0 / hidden

    def __call__(self, copies: torch.Tensor, per_layer: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                 step_kv: dict[int, torch.Tensor], index: int) -> torch.Tensor:
        """The copies ``[n, T, hidden]`` after the block; ``per_layer``: its per-layer input
        ``[T, size]``; ``step_kv``: the step's keys and values by layer (Gemma 4's)."""
        predictions = self.predict(copies)
        active = predictions[self.active]
        x = self.norm(active, self.input_norm)
        laurel = x + self.norm(self.laurel_right(self.laurel_left(x)), self.laurel_norm)
        attn = self.norm(self.attention(x, cos, sin, kv_cache, meta, step_kv, index),
                         self.post_attn_norm)
        h = (active + attn + laurel) / math.sqrt(2)
        y = h + self.norm(self.mlp(self.norm(h, self.pre_ff_norm)), self.post_ff_norm)
        corrected = self.correct(predictions, y)
        first = corrected[self.active]
        if self.correct_scale is not None:
            first = first * self.correct_scale.to(first.dtype)
        gate = F.gelu(self.per_layer_gate(first), approximate="tanh") * per_layer
        corrected[1:] += self.norm(self.per_layer_proj(gate), self.per_layer_norm)
        return corrected

    def modalities(self, x: torch.Tensor) -> torch.Tensor:
        """AltUp's router ``[T, n]`` of the hidden state ``x``."""
        routed = self.router(self.norm(x, self.router_norm) * self.router_scale)
        return torch.tanh(routed.float()).to(x.dtype)

    def predict(self, copies: torch.Tensor) -> torch.Tensor:
        """AltUp's predictions of the copies ``[n, T, hidden]`` (module docstring)."""
        n, tokens = copies.shape[0], copies.shape[1]
        coefs = self.prediction_coefs(self.modalities(copies[self.active]))
        coefs = coefs.view(tokens, n, n).permute(0, 2, 1)  # [T, j, i]: P[i, j]
        mixed = torch.matmul(copies.permute(1, 2, 0), coefs)  # [T, hidden, i]
        return mixed.permute(2, 0, 1) + copies

    def correct(self, predictions: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """AltUp's correction of the ``predictions`` by the layer's output ``y``."""
        coefs = self.correction_coefs(self.modalities(y)) + 1.0  # [T, n]
        innovation = y - predictions[self.active]
        return innovation * coefs.t().unsqueeze(-1) + predictions

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP of the normed ``x``, its gate sparsified where the layer is sparse."""
        gate, up = self.gate_up_proj(x).chunk(2, -1)
        if self.std_multiplier is not None:
            cutoff = gate.mean(-1, keepdim=True) + gate.std(
                -1, keepdim=True, unbiased=False) * self.std_multiplier.to(gate.dtype)
            gate = F.relu(gate - cutoff)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3nForCausalLM(Gemma4ForCausalLM):
    """Gemma 3n's text model: ``forward`` gives hidden states, ``compute_logits`` float32
    logits (softcapped); the block layouts are ``LlamaForCausalLM``'s."""

    decoder_layer = Gemma3nDecoderLayer

    def __init__(self, cfg: ModelConfig, weights: Weights, max_positions: int,
                 shard: Shard | None = None) -> None:
        if shard is not None:
            raise ModelLoadError("tensor parallelism of Gemma 3n is not supported; serve it "
                                 "on one rank (data parallelism replicates it)")
        hidden, copies = cfg.hidden_size, cfg.altup[0]
        spread, merge = ([_shaped(weights, f"model.{kind}.{i}.weight", (hidden, hidden))
                          for i in range(copies - 1)]
                         for kind in ("altup_projections", "altup_unembed_projections"))
        super().__init__(cfg, weights, max_positions)
        # (their blocks outside the arena, as the per-layer embedding's)
        self.altup_projection = make_linear(spread) if spread else None
        self.altup_unembed = [make_linear([w]) for w in merge]

    def per_layer_inputs(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Gemma 4's per-layer inputs, a token past the per-layer vocabulary taking token
        0's row (transformers' ``get_per_layer_inputs``)."""
        outside = (ids < 0) | (ids >= self.config.per_layer_vocab_size)
        return super().per_layer_inputs(ids.masked_fill(outside, 0), x)

    def spread(self, x: torch.Tensor) -> torch.Tensor:
        """AltUp's copies ``[n, T, hidden]`` of the embeddings ``x``: ``x`` and its
        projections, each rescaled to ``x``'s root mean square."""
        if self.altup_projection is None:
            return x.unsqueeze(0)
        target = torch.mean(x ** 2, dim=-1, keepdim=True) ** 0.5
        projected = self.altup_projection(x).view(x.shape[0], -1, x.shape[1]).unbind(1)
        return torch.stack([x, *(_rescaled(p, target) for p in projected)])

    def merge(self, copies: torch.Tensor) -> torch.Tensor:
        """The hidden states of the final copies: their mean, copies ``1 ... n - 1``
        unembedded and rescaled to copy 0's root mean square."""
        target = torch.mean(copies[0] ** 2, dim=-1, keepdim=True) ** 0.5
        unembedded = [_rescaled(unembed(c), target)
                      for unembed, c in zip(self.altup_unembed, copies[1:])]
        return torch.mean(torch.stack([copies[0], *unembedded]), dim=0)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] of a flat step; writes the step's KV into the cache."""
        x = self.embedding(input_ids) * self.embed_scale
        per_layer = self.per_layer_inputs(input_ids, x)
        copies = self.spread(x)
        ropes = {key: rotary.tables(positions) for key, rotary in self.rotaries.items()}
        metas = {window: meta.with_window(window) for window in set(self.windows)}
        step_kv: dict[int, torch.Tensor] = {}
        for i, (layer, window, cache) in enumerate(zip(self.layers, self.windows,
                                                       self.views(kv_caches))):
            copies = layer(copies, per_layer[:, i], *ropes[self.rope_of[i]], cache,
                           metas[window], step_kv, i)
        return float32_weight_rms_norm(self.merge(copies), self.norm, self.config.rms_norm_eps,
                                       self.native)


def _rescaled(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``x`` rescaled to the root mean square ``target`` (its own clamped to at least
    1e-5 squared), as transformers' AltUp computes it."""
    magnitude = torch.sqrt(torch.mean(x ** 2, dim=-1, keepdim=True).clamp(min=1e-5))
    return x * target / magnitude
