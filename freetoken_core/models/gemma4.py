"""Native Gemma 4 causal LM, text only (transformers' ``Gemma4ForCausalLM``, and the language
model of ``Gemma4ForConditionalGeneration``: E2B, E4B, 26B-A4B, 31B).

Gemma 3's block (gemma3.py) with Gemma 4's differences (config_gemma4.py reads them), each
computed as transformers computes it:

- RMSNorm ``x * w`` (not Gemma 3's ``1 + w``), in float32 and cast back once;
- per layer, its heads' size and KV heads (the global layers' wider heads, fewer KV heads);
  where ``values_from_keys`` the values are the key projection's output, normed without a
  weight and not rotated (every layer's values are RMSNormed so, without a weight);
- q and k RMSNormed per head, the scores unscaled (``query_scale`` 1);
- each layer type its rope: the sliding layers' of their head size and local base, the
  global layers' of theirs (``proportional``: only the first pairs turn);
- the last ``kv_shared_layers`` layers compute queries only and attend to the keys and
  values of the last earlier layer of their type (``kv_layout``: they store nothing);
- per-layer embeddings (PLE): a second embedding of each token, ``[layers x size]``, times
  ``sqrt(size)``, plus the RMSNormed projection of the (scaled) first embedding times
  ``hidden ** -0.5``, the two summed times ``2 ** -0.5``; after its MLP a layer adds
  ``norm(proj(gelu_tanh(gate(x)) * its input))``;
- with experts (26B-A4B), the dense MLP's output (normed) plus the experts' (normed), the
  experts reading the pre-MLP residual stream normed by a norm of their own, the router its
  weightless RMSNorm times ``scale`` times ``hidden ** -0.5``; the router's softmax over the
  experts, the top k renormalized, times each chosen expert's ``per_expert_scale``; each
  expert a GELU-tanh gated MLP;
- each layer's output times its ``layer_scalar``; tied embeddings times ``sqrt(hidden)``;
  the final logits softcapped where the config sets it.

Tensor parallelism is refused (the layers' shapes differ; one rank or data parallelism).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.attention import AttentionMetadata, paged_attention
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.gemma3 import Gemma3ForCausalLM
from freetoken_core.models.kv_layout import LayerViews, kv_sources, layer_kv_shape
from freetoken_core.models.layers import (
    RotaryEmbedding,
    apply_rope,
    float32_weight_rms_norm,
    gelu_tanh_and_mul,
)
from freetoken_core.models.linear import BlockArena, Embedding, make_linear
from freetoken_core.models.llama import LlamaForCausalLM, Weights
from freetoken_core.models.moe import SparseMoE
from freetoken_core.models.sharding import Shard


class Gemma4Experts(SparseMoE):
    """A layer's experts (GELU-tanh gated) and router (module docstring), by transformers'
    names under the layer (``router.proj`` / ``scale`` / ``per_expert_scale``,
    ``experts.gate_up_proj`` / ``down_proj``) or by a GGUF file's (``mlp.gate``,
    ``mlp.experts.{e}.*``, ``router.scale``, ``router.per_expert_scale``)."""

    gelu_tanh = True

    def __init__(self, cfg: ModelConfig, weights: Weights, prefix: str, native: bool,
                 arena: BlockArena | None) -> None:
        for old, new in (("router.proj.weight", "mlp.gate.weight"),
                         ("experts.gate_up_proj", "mlp.experts.gate_up_proj"),
                         ("experts.down_proj", "mlp.experts.down_proj")):
            if prefix + old in weights:
                weights[prefix + new] = weights.pop(prefix + old)
        super().__init__(cfg, weights, prefix, native, arena)
        self.router_scale = weights.pop(prefix + "router.scale")
        self.expert_scale = weights.pop(prefix + "router.per_expert_scale")
        for name, w, size in (("router.scale", self.router_scale, cfg.hidden_size),
                              ("router.per_expert_scale", self.expert_scale, cfg.num_experts)):
            if tuple(w.shape) != (size,):
                raise ModelLoadError(f"{prefix}{name} has shape {list(w.shape)}; expected "
                                     f"[{size}]")
        self.root = cfg.hidden_size ** -0.5
        self.eps = cfg.rms_norm_eps

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router of the residual stream ``x``: ``(weights, experts)``."""
        normed = torch.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)
        logits = self.router(normed * self.router_scale.to(x.dtype) * self.root)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.expert_scale[chosen], chosen

    def experts_of(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The experts' sum for the normed ``x``, routed by the residual stream."""
        weights, chosen = self.route(residual)
        return self.experts_sum(x, weights.to(x.dtype), chosen)


class Gemma4DecoderLayer:
    """Gemma 4's block ``index`` (module docstring): ``layer(x, ...)`` is its output."""

    def __init__(self, cfg: ModelConfig, weights: Weights, index: int, native: bool,
                 arena: BlockArena | None = None) -> None:
        prefix = f"model.layers.{index}."

        def w(name: str) -> Any:
            return weights.pop(prefix + name)

        def norm(name: str) -> torch.Tensor:
            return w(name).float()

        attn = "self_attn."
        self.num_heads = cfg.num_heads
        self.num_kv_heads, self.head_dim = layer_kv_shape(cfg, index)
        self.source = kv_sources(cfg)[index]
        self.values_are_keys = bool(cfg.values_from_keys and cfg.values_from_keys[index])
        projections = ["q"]
        if self.source == index:
            projections += ["k"] if self.values_are_keys else ["k", "v"]
        else:  # (checkpoints may hold a shared layer's unused k/v projections and k norm)
            for name in ("k_proj.weight", "v_proj.weight", "k_norm.weight"):
                weights.pop(prefix + attn + name, None)
        self.qkv_proj = make_linear([w(f"{attn}{p}_proj.weight") for p in projections],
                                    arena=arena)
        self.o_proj = make_linear([w(attn + "o_proj.weight")], arena=arena)
        self.q_norm = norm(attn + "q_norm.weight")
        self.k_norm = norm(attn + "k_norm.weight") if self.source == index else None
        self.input_norm = norm("input_layernorm.weight")
        self.post_attn_norm = norm("post_attention_layernorm.weight")
        self.pre_ff_norm = norm("pre_feedforward_layernorm.weight")
        self.post_ff_norm = norm("post_feedforward_layernorm.weight")
        self.gate_up_proj = make_linear([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")],
                                        arena=arena)
        self.down_proj = make_linear([w("mlp.down_proj.weight")], arena=arena)
        scalar = weights.pop(prefix + "layer_scalar", None)
        self.layer_scalar = None if scalar is None else scalar.reshape(-1)
        self.moe = None
        linears = [self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj]
        if cfg.num_experts:
            self.moe = Gemma4Experts(cfg, weights, prefix, native, arena)
            self.post_ff_norm_1 = norm("post_feedforward_layernorm_1.weight")
            self.pre_ff_norm_2 = norm("pre_feedforward_layernorm_2.weight")
            self.post_ff_norm_2 = norm("post_feedforward_layernorm_2.weight")
            linears += self.moe.linears
        self.per_layer_gate = self.per_layer_proj = None
        if cfg.per_layer_input_size:
            self.per_layer_gate = make_linear([w("per_layer_input_gate.weight")], arena=arena)
            self.per_layer_proj = make_linear([w("per_layer_projection.weight")], arena=arena)
            self.per_layer_norm = norm("post_per_layer_input_norm.weight")
            linears += [self.per_layer_gate, self.per_layer_proj]
        self.linears = tuple(linears)
        self.one_call = None  # (Llama's one-call block: not Gemma 4's)
        self.eps = cfg.rms_norm_eps
        self.native = native
        # (the values' norm has no weight)
        self.unit = torch.ones(self.head_dim, device=self.q_norm.device)

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Gemma 4's RMSNorm of the rows of ``x`` (any shape; its last dimension normed)."""
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        return float32_weight_rms_norm(flat, weight, self.eps, self.native).view(x.shape)

    def __call__(self, x: torch.Tensor, per_layer: torch.Tensor | None, cos: torch.Tensor,
                 sin: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                 step_kv: dict[int, torch.Tensor], index: int) -> torch.Tensor:
        """The block's output for its input ``x`` ``[T, hidden]``; ``per_layer``: its
        per-layer input ``[T, size]`` (PLE); ``step_kv``: the step's keys and values of the
        layers that store them, by layer (this one's added where it stores)."""
        residual = x
        x = self.attention(self.norm(x, self.input_norm), cos, sin, kv_cache, meta, step_kv,
                           index)
        x = residual + self.norm(x, self.post_attn_norm)
        residual = x
        out = self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(self.norm(x,
                                                                           self.pre_ff_norm))))
        if self.moe is not None:
            experts = self.moe.experts_of(residual, self.norm(residual, self.pre_ff_norm_2))
            out = self.norm(out, self.post_ff_norm_1) + self.norm(experts, self.post_ff_norm_2)
        x = residual + self.norm(out, self.post_ff_norm)
        if per_layer is not None:
            gate = F.gelu(self.per_layer_gate(x), approximate="tanh") * per_layer
            x = x + self.norm(self.per_layer_proj(gate), self.per_layer_norm)
        if self.layer_scalar is not None:
            x = x * self.layer_scalar.to(x.dtype)
        return x

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  kv_cache: torch.Tensor, meta: AttentionMetadata,
                  step_kv: dict[int, torch.Tensor], index: int) -> torch.Tensor:
        n, h, kvh, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        q = self.norm(qkv[:, :h * d].reshape(n, h, d), self.q_norm)
        if self.source != index:  # (a shared layer: the keys and values of its source)
            q = apply_rope(q, cos, sin, self.native)
            kv = step_kv[self.source]
        else:
            k = qkv[:, h * d:(h + kvh) * d].reshape(n, kvh, d)
            v = k if self.values_are_keys else qkv[:, (h + kvh) * d:].reshape(n, kvh, d)
            qk = apply_rope(torch.cat([q, self.norm(k, self.k_norm)], dim=1), cos, sin,
                            self.native)
            q = qk[:, :h]
            kv = torch.cat([qk[:, h:], self.norm(v, self.unit)], dim=1).view(n, 2, kvh, d)
            step_kv[index] = kv
        return self.o_proj(paged_attention(q, kv, kv_cache, meta, 1.0))


class Gemma4ForCausalLM(LlamaForCausalLM):
    """Gemma 4's text model: ``forward`` gives hidden states, ``compute_logits`` float32
    logits (softcapped where configured); the block layouts are ``LlamaForCausalLM``'s."""

    decoder_layer: type[Gemma4DecoderLayer] = Gemma4DecoderLayer  # (Gemma 3n's: gemma3n.py)

    def __init__(self, cfg: ModelConfig, weights: Weights, max_positions: int,
                 shard: Shard | None = None) -> None:
        if shard is not None:
            raise ModelLoadError("tensor parallelism of Gemma 4 is not supported (its layers "
                                 "differ in shape); serve it on one rank (data parallelism "
                                 "replicates it)")
        self.config = cfg
        self.num_kv_heads = cfg.num_kv_heads
        per_layer_embed = weights.pop("model.embed_tokens_per_layer.weight", None)
        arena = self.set_embeddings(cfg, weights)
        dtype, device = self.embedding.dtype, self.embedding.device
        self.per_layer_size = cfg.per_layer_input_size
        if self.per_layer_size:
            self.set_per_layer_inputs(weights, per_layer_embed, arena)
        elif per_layer_embed is not None:
            raise ModelLoadError("the checkpoint has per-layer embeddings "
                                 "(model.embed_tokens_per_layer) but its config sets "
                                 "hidden_size_per_layer_input 0")
        self.layers = [self.decoder_layer(cfg, weights, i, self.native, arena)
                       for i in range(cfg.num_layers)]
        self.windows = [w if w is not None and w < max_positions else None
                        for w in (cfg.layer_windows or (None,) * cfg.num_layers)]
        self.norm = weights.pop("model.norm.weight").float()
        self.uses_gguf_blocks = arena is not None
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5).to(dtype=dtype, device=device)
        # Each layer's rope tables: by layer type and head size.
        self.rotaries: dict[tuple[bool, int], RotaryEmbedding] = {}
        self.rope_of = []
        for i, window in enumerate(cfg.layer_windows or (None,) * cfg.num_layers):
            key = (window is not None, layer_kv_shape(cfg, i)[1])
            if key not in self.rotaries:
                theta, scaling = ((cfg.rope_local_theta or cfg.rope_theta, None) if key[0]
                                  else (cfg.rope_theta, cfg.rope_scaling))
                self.rotaries[key] = RotaryEmbedding(key[1], max_positions, theta, scaling,
                                                     dtype, device)
            self.rope_of.append(key)
        leftover = [k for k in weights if "rotary_emb" not in k]
        if leftover:
            raise ValueError(f"unused weights in checkpoint: {leftover[:5]}")
        self.views = LayerViews(cfg)
        if arena is None:
            self.pack_blocks()
        self.set_all_layers_args()

    def set_per_layer_inputs(self, weights: Weights, table: Any,
                             arena: BlockArena | None) -> None:
        """PLE's second embedding (its own blocks, outside the arena the linears are
        packed from), projection and norm."""
        cfg = self.config
        width = cfg.num_layers * self.per_layer_size
        rows = cfg.per_layer_vocab_size or cfg.vocab_size
        if table is None or tuple(table.shape) != (table.shape[0], width) or (
                table.shape[0] < rows):
            shape = None if table is None else list(table.shape)
            raise ModelLoadError(f"model.embed_tokens_per_layer.weight has shape {shape}; "
                                 f"expected [at least {rows}, {width}] (vocabulary, "
                                 "layers x hidden_size_per_layer_input)")
        self.per_layer_embedding = Embedding(table)
        self.per_layer_projection = make_linear(
            [weights.pop("model.per_layer_model_projection.weight")], arena=arena)
        self.per_layer_norm = weights.pop("model.per_layer_projection_norm.weight").float()
        dtype = self.embedding.dtype
        self.per_layer_scale = torch.tensor(self.per_layer_size ** 0.5).to(dtype)

    def per_layer_inputs(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """PLE's inputs ``[T, layers, size]`` of the tokens ``ids`` embedded as ``x``."""
        cfg, size = self.config, self.per_layer_size
        shape = (ids.shape[0], cfg.num_layers, size)
        tokens = self.per_layer_embedding(ids).view(shape) * self.per_layer_scale
        projected = self.per_layer_projection(x) * cfg.hidden_size ** -0.5
        projected = float32_weight_rms_norm(projected.reshape(-1, size).contiguous(),
                                            self.per_layer_norm, cfg.rms_norm_eps,
                                            self.native).view(shape)
        return (projected + tokens) * 2.0 ** -0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] of a flat step; writes the step's KV into the cache."""
        x = self.embedding(input_ids) * self.embed_scale
        per_layer = self.per_layer_inputs(input_ids, x) if self.per_layer_size else None
        ropes = {key: rotary.tables(positions) for key, rotary in self.rotaries.items()}
        metas = {window: meta.with_window(window) for window in set(self.windows)}
        step_kv: dict[int, torch.Tensor] = {}
        for i, (layer, window, cache) in enumerate(zip(self.layers, self.windows,
                                                       self.views(kv_caches))):
            x = layer(x, None if per_layer is None else per_layer[:, i], *ropes[self.rope_of[i]],
                      cache, metas[window], step_kv, i)
        return float32_weight_rms_norm(x, self.norm, self.config.rms_norm_eps, self.native)

    compute_logits = Gemma3ForCausalLM.compute_logits  # (softcapped where configured)

