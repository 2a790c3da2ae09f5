"""The KV cache's layout: one tensor ``[cache layer, slot, key/value, KV head, head dim]``
(``engine.model_runner.kv_cache_shape``), and which part of it each layer reads and writes.

Most models' layers are alike: a cache layer a layer, of the model's KV heads and head size.
Gemma 4's are not: its global layers have other heads than its sliding ones
(``ModelConfig.layer_head_dims`` / ``layer_kv_heads``), and its last
``kv_shared_layers`` layers store nothing, each reading the cache of the last earlier layer
of its type (transformers' ``kv_sharing_modes``); Qwen3.5's linear-attention layers store
none (a recurrent state instead: ``gated_deltanet``). Such a model's cache has a cache layer per
layer that stores keys and values, each slot as wide as the widest layer's keys and values
(one KV head of ``max(KV heads x head dim)`` values, or, where those layers are alike, of
their shape); a layer's view of its cache layer
(:func:`layer_caches`) is the first ``slots x 2 x its KV heads x its head dim`` values of it,
contiguous, shaped ``[slot, key/value, its KV heads, its head dim]``. The narrower layers
leave the rest of their cache layer unused (Gemma 4 31B: its 10 global layers' slots are
half used). Multi-head latent attention (DeepSeek's, ``mla_shape``) stores one KV head of a
token's normed latent and rotated key part, its keys and values the same vector
(``deepseek.MlaAttention``). Falcon-H1's hybrid layers store keys and values (their
attention) beside a recurrent state (their Mamba-2 mixer, which the model keeps)."""

from __future__ import annotations

import torch

from freetoken_core.models.config import ModelConfig

KV_KINDS = frozenset({"attention", "hybrid"})
"""The ``ModelConfig.layer_kinds`` whose layers store keys and values."""


def uniform(cfg: ModelConfig) -> bool:
    """Whether every layer stores keys and values of the model's own shape."""
    return not cfg.kv_shared_layers and set(cfg.layer_head_dims) <= {cfg.head_dim} and set(
        cfg.layer_kv_heads) <= {cfg.num_kv_heads} and set(cfg.layer_kinds) <= KV_KINDS


def layer_kv_shape(cfg: ModelConfig, index: int) -> tuple[int, int]:
    """``(KV heads, head dim)`` of layer ``index``."""
    return (cfg.layer_kv_heads[index] if cfg.layer_kv_heads else cfg.num_kv_heads,
            cfg.layer_head_dims[index] if cfg.layer_head_dims else cfg.head_dim)


def kv_sources(cfg: ModelConfig) -> tuple[int | None, ...]:
    """Per layer, the layer whose keys and values it attends to: itself, or for the last
    ``kv_shared_layers`` layers the last layer before them of the same type (sliding or
    global); ``None`` for a layer without keys and values (Qwen3.5's linear attention)."""
    layers = cfg.num_layers
    first_shared = layers - cfg.kv_shared_layers
    sliding = [w is not None for w in cfg.layer_windows or (None,) * layers]
    kinds = cfg.layer_kinds or ("attention",) * layers
    return tuple(None if kinds[i] not in KV_KINDS else i if i < first_shared
                 else max(j for j in range(first_shared) if sliding[j] == sliding[i])
                 for i in range(layers))


def kv_cache_dims(cfg: ModelConfig, num_kv_heads: int | None = None) -> tuple[int, int, int]:
    """``(cache layers, KV heads, head dim)`` of the model's cache (``num_kv_heads``: a
    tensor-parallel rank's share of a uniform model's)."""
    if cfg.mla_shape:  # (the latent and the rotated key part, one "head": deepseek.py)
        return cfg.num_layers, 1, cfg.mla_shape[1] + cfg.mla_shape[3]
    if uniform(cfg):
        return cfg.num_layers, num_kv_heads or cfg.num_kv_heads, cfg.head_dim
    stores = [i for i, source in enumerate(kv_sources(cfg)) if source == i]
    shapes = {layer_kv_shape(cfg, i) for i in stores}
    if len(shapes) == 1:  # (alike, but not every layer stores: Qwen3.5's)
        return len(stores), *shapes.pop()
    return len(stores), 1, max(h * d for h, d in shapes)


def layer_caches(cfg: ModelConfig, kv_caches: torch.Tensor) -> list[torch.Tensor | None]:
    """Each layer's ``[slot, 2, KV heads, head dim]`` view of the cache (the module
    docstring): a shared layer gets the view of the layer it reads, a layer without keys
    and values ``None``."""
    if uniform(cfg):
        return list(kv_caches)
    sources = kv_sources(cfg)
    stores = {layer: n for n, layer in enumerate(i for i, s in enumerate(sources) if s == i)}
    slots = kv_caches.shape[1]
    views: dict[int, torch.Tensor] = {}
    for layer, n in stores.items():
        heads, dim = layer_kv_shape(cfg, layer)
        views[layer] = kv_caches[n].view(-1)[:slots * 2 * heads * dim].view(
            slots, 2, heads, dim)
    return [None if source is None else views[source] for source in sources]


class LayerViews:
    """``layer_caches`` of the cache a model is given, made once a cache (a step's
    ``forward`` asks each time; the engine's cache is one tensor for good)."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self._key: tuple[int, tuple[int, ...]] | None = None
        self._views: list[torch.Tensor | None] = []

    def __call__(self, kv_caches: torch.Tensor) -> list[torch.Tensor | None]:
        key = (kv_caches.data_ptr(), tuple(kv_caches.shape))
        if key != self._key:
            self._key, self._views = key, layer_caches(self.cfg, kv_caches)
        return self._views
