"""Each family's ``ModelConfig`` fields beyond the common ones, read from its config.json as
transformers' config class reads them (its defaults where a key is left out), a value
FreeToken cannot run refused naming its key (``config.ModelConfig.from_dict`` calls them)."""

from __future__ import annotations

import math
from typing import Any

from freetoken_core.errors import ModelLoadError


def rope_kind(params: dict[str, Any]) -> str:
    return params.get("rope_type", params.get("type", "default"))


def gemma3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's fields, read as transformers' ``Gemma3TextConfig`` reads them: the rope of
    each layer type (``rope_parameters`` per type, or the legacy ``rope_theta``,
    ``rope_local_base_freq`` and ``rope_scaling`` keys, which apply to the global layers),
    ``layer_types`` (or every ``sliding_window_pattern``-th layer global), the query scale,
    the logits' softcap where set."""
    if cfg.get("attn_logit_softcapping") is not None:
        raise ModelLoadError(
            f"Gemma3ForCausalLM with attn_logit_softcapping={cfg['attn_logit_softcapping']} is "
            "not supported (transformers' Gemma 3 attention ignores it, llama.cpp's converter "
            "refuses it; Gemma 3 checkpoints have it null)")
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError("Gemma3ForCausalLM with use_bidirectional_attention (an encoder, "
                             "e.g. EmbeddingGemma) is not supported: FreeToken generates text")
    full, local = _ropes_by_layer_type("Gemma3ForCausalLM", cfg, 1_000_000.0,
                                       cfg.get("rope_local_base_freq") or 10_000.0)
    kind = rope_kind(full)
    num_layers = cfg["num_hidden_layers"]
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        pattern = cfg.get("sliding_window_pattern") or 6
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                       for i in range(num_layers)]
    return {
        "rope_theta": float(full["rope_theta"]),
        "rope_scaling": None if kind == "default" else dict(full, rope_type=kind),
        "rope_local_theta": float(local["rope_theta"]),
        "layer_windows": layer_windows_from("Gemma3ForCausalLM", layer_types, num_layers,
                                        cfg.get("sliding_window")),
        "query_scale": cfg.get("query_pre_attn_scalar", 256) ** -0.5,
        "final_logit_softcap": _softcap("Gemma3ForCausalLM", cfg, "final_logit_softcapping",
                                        None),
    }


def _ropes_by_layer_type(arch: str, cfg: dict[str, Any], full_theta: float,
                         local_theta: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """The rope parameters of the global and of the sliding-window layers, as transformers'
    Gemma 3 and OLMo 3 configs read them: ``rope_parameters`` per layer type, or one set of
    them and the legacy ``rope_theta`` / ``rope_scaling`` keys, which apply to the global
    layers; the bases ``full_theta`` and ``local_theta`` where none is given. The sliding
    layers' rope must be unscaled (the checkpoints' is)."""
    params = cfg.get("rope_parameters") or {}
    nested = "full_attention" in params or "sliding_attention" in params
    full = dict(params.get("full_attention") or {}) if nested else dict(params)
    local = dict(params.get("sliding_attention") or {}) if nested else {}
    if cfg.get("rope_scaling"):
        full.update(cfg["rope_scaling"])
    full.setdefault("rope_theta", cfg.get("rope_theta") or full_theta)
    local.setdefault("rope_theta", local_theta)
    if rope_kind(local) != "default":
        raise ModelLoadError(f"{arch} with rope type {rope_kind(local)!r} on its "
                             "sliding-window layers is not supported (checkpoints use default)")
    return full, local


def gemma2_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's fields as transformers' ``Gemma2Config`` reads them (its defaults where
    config.json leaves a key out): the scores softcapped at ``attn_logit_softcapping`` (50)
    and the logits at ``final_logit_softcapping`` (30), either off where null; the query
    scaled by ``query_pre_attn_scalar ** -0.5`` (256); ``layer_types`` (default: every
    other layer, the first included, sliding over ``sliding_window`` keys, 4096). One rope,
    ``rope_theta`` with ``rope_scaling``, on every layer (the common keys)."""
    arch, layers = "Gemma2ForCausalLM", cfg["num_hidden_layers"]
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{arch} with use_bidirectional_attention (an encoder) is not "
                             "supported: FreeToken generates text")
    scalar = cfg.get("query_pre_attn_scalar", 256)
    if _positive(scalar) is None:
        raise ModelLoadError(f"{arch} query_pre_attn_scalar must be a positive number, "
                             f"not {scalar!r}")
    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    return {"query_scale": scalar ** -0.5,
            "attn_logit_softcap": _softcap(arch, cfg, "attn_logit_softcapping", 50.0),
            "final_logit_softcap": _softcap(arch, cfg, "final_logit_softcapping", 30.0),
            "layer_windows": layer_windows_from(arch, layer_types, layers,
                                            cfg.get("sliding_window", 4096))}


def _positive(value: Any) -> float | None:
    """``value`` as a float where it is a finite positive number, else ``None``."""
    if isinstance(value, int | float) and not isinstance(value, bool) and (
            math.isfinite(value) and value > 0):
        return float(value)
    return None


def _softcap(arch: str, cfg: dict[str, Any], key: str, default: float | None
             ) -> float | None:
    """A softcap ``key`` (``default`` where config.json leaves it out): a positive number,
    or null for none."""
    value = cfg.get(key, default)
    if value is not None and _positive(value) is None:
        raise ModelLoadError(f"{arch} {key} must be a positive number or null (none), "
                             f"not {value!r}")
    return _positive(value)


def layer_windows_from(arch: str, layer_types: list[str], num_layers: int, window: Any
                       ) -> tuple[int | None, ...]:
    """Each layer's window from ``layer_types`` (``sliding_attention`` layers attend to
    their last ``window`` keys, ``full_attention`` ones to all), checked: one type a layer,
    and a window of at least one key where a layer slides."""
    if len(layer_types) != num_layers or set(layer_types) - {"sliding_attention",
                                                             "full_attention"}:
        raise ModelLoadError(f"{arch} layer_types {layer_types!r}: expected {num_layers} of "
                             "'sliding_attention' / 'full_attention'")
    if "sliding_attention" in layer_types and (not isinstance(window, int) or window < 1):
        raise ModelLoadError(f"{arch} with sliding-window layers needs sliding_window >= 1, "
                             f"not {window!r}")
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


def granite_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """Granite's (and Granite MoE's) four multipliers, transformers' ``GraniteConfig``
    defaults (1) where config.json leaves them out: the embeddings', the residual branches',
    the attention scores' (in place of ``head_dim ** -0.5``) and the logits' divisor."""
    def number(key: str) -> float:
        value = cfg.get(key, 1.0)
        if not isinstance(value, int | float) or not math.isfinite(value) or value == 0:
            raise ModelLoadError(f"{arch} {key} must be a finite non-zero number, not "
                                 f"{value!r}")
        return float(value)

    return {"embedding_multiplier": number("embedding_multiplier"),
            "residual_multiplier": number("residual_multiplier"),
            "query_scale": number("attention_multiplier"),
            "logits_scaling": number("logits_scaling")}


def smollm3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """SmolLM3's NoPE layers as transformers' ``SmolLM3Config`` reads them: ``no_rope_layers``
    (1 rotates), else every ``no_rope_layer_interval``-th layer (default 4) without RoPE.
    Its optional sliding window is refused (the released models have none)."""
    layers = cfg["num_hidden_layers"]
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = int(cfg.get("no_rope_layer_interval") or 4)
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(flags) != layers or any(f not in (0, 1) for f in flags):
        raise ModelLoadError(f"SmolLM3ForCausalLM no_rope_layers must hold 0 or 1 for each "
                             f"of the {layers} layers, not {flags!r}")
    if cfg.get("use_sliding_window"):
        raise ModelLoadError("SmolLM3ForCausalLM with use_sliding_window is not supported "
                             "(the released SmolLM3 models attend to every key)")
    return {"no_rope_layers": tuple(int(f) for f in flags)}


def exaone4_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """EXAONE 4's layers as transformers' ``Exaone4Config`` and ``Exaone4Attention`` read
    them: with a ``sliding_window`` (default 4096), ``layer_types`` (default: every
    ``sliding_window_pattern``-th layer global, 4; a pattern string such as ``"LLLG"`` read
    as llama.cpp's converter reads it), the sliding layers rotated and the global ones not
    (NoPE); without one (the 1.2B), every layer global and rotated."""
    window = cfg.get("sliding_window", 4096)
    return {} if window is None else nope_global_layers("Exaone4ForCausalLM", cfg, window)


def nope_global_layers(arch: str, cfg: dict[str, Any], window: Any) -> dict[str, Any]:
    """EXAONE 4's and Cohere 2's layers: ``layer_types``, else every
    ``sliding_window_pattern``-th layer global (default 4; a string such as ``"LLLG"``, as
    llama.cpp's converter reads EXAONE 4's, a type a layer over and over); the sliding layers
    attend to their last ``window`` keys and rotate, the global ones attend to every key and
    do not rotate (``no_rope_layers``)."""
    layers = cfg["num_hidden_layers"]
    layer_types = cfg.get("layer_types")
    if not layer_types:
        pattern = cfg.get("sliding_window_pattern", 4)
        if isinstance(pattern, str) and pattern and set(pattern) <= {"L", "G"}:
            layer_types = ["sliding_attention" if pattern[i % len(pattern)] == "L"
                           else "full_attention" for i in range(layers)]
        elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 1:
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                           for i in range(layers)]
        else:
            raise ModelLoadError(f"{arch} sliding_window_pattern must be a positive integer "
                                 f"or a string of 'L' and 'G', not {pattern!r}")
    windows = layer_windows_from(arch, layer_types, layers, window)
    return {"layer_windows": windows,
            "no_rope_layers": tuple(int(w is not None) for w in windows)}


def phi3_fields(cfg: dict[str, Any], rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """Phi-3's fields: LongRoPE (``su`` and ``yarn`` are its old names, as transformers has
    them) with the pre-training length, the rotated fraction of each head, and the sliding
    window, which transformers applies to every layer (llama.cpp ignores it)."""
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    factor = cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0
    fields: dict[str, Any] = {"partial_rotary_factor": float(factor)}
    if rope_scaling is not None:
        kind = rope_scaling["rope_type"]
        kind = "longrope" if kind in ("su", "yarn") else kind
        if kind != "longrope":
            raise ModelLoadError(f"Phi3ForCausalLM with rope_scaling type {kind!r} is not "
                                 "supported (transformers' Phi-3 knows default and longrope)")
        original = cfg.get("original_max_position_embeddings",
                           rope_scaling.get("original_max_position_embeddings"))
        if original is None:
            raise ModelLoadError("Phi3ForCausalLM longrope needs "
                                 "original_max_position_embeddings in config.json")
        fields["rope_scaling"] = dict(rope_scaling, rope_type=kind,
                                      original_max_position_embeddings=original)
    window = cfg.get("sliding_window")
    if window is not None:
        if window < 1:
            raise ModelLoadError(f"Phi3ForCausalLM sliding_window {window}: must be >= 1")
        fields["layer_windows"] = (window,) * cfg["num_hidden_layers"]
    return fields


def glm4_fields(cfg: dict[str, Any], rope_scaling: dict[str, Any] | None
                ) -> dict[str, Any]:
    """GLM-4's fields as transformers' ``Glm4Config`` reads them: the rotated fraction of
    each head (``partial_rotary_factor``, top level or in ``rope_parameters``; default 0.5)
    and the default rope (the released checkpoints scale none)."""
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    factor = cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 0.5
    if rope_scaling is not None:
        raise ModelLoadError(f"Glm4ForCausalLM with rope type {rope_scaling['rope_type']!r} "
                             "is not supported (its checkpoints use the default rope)")
    return {"partial_rotary_factor": float(factor)}


def ministral3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Ministral 3's attention temperature as transformers' ``Ministral3Attention`` reads it:
    ``llama_4_scaling_beta`` and ``original_max_position_embeddings`` of its rope parameters
    (YaRN's, read as for any model)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    beta = params.get("llama_4_scaling_beta") or 0.0
    length = params.get("original_max_position_embeddings") or 0
    if not isinstance(beta, int | float) or not math.isfinite(beta):
        raise ModelLoadError(f"Ministral3ForCausalLM llama_4_scaling_beta must be a number, "
                             f"not {beta!r}")
    if beta and (not isinstance(length, int) or length < 1):
        raise ModelLoadError("Ministral3ForCausalLM llama_4_scaling_beta needs "
                             "original_max_position_embeddings >= 1 in rope_parameters, not "
                             f"{length!r}")
    return {"attention_temperature_beta": float(beta),
            "attention_temperature_length": int(length) if beta else 0}


def olmo3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """OLMo 3's fields as transformers' ``Olmo3Config`` reads them: ``layer_types`` (default:
    every 4th layer global, the others sliding over ``sliding_window`` keys, 4096) and the
    rope of each layer type: ``rope_parameters`` per type, or the legacy ``rope_theta`` and
    ``rope_scaling`` keys (the global layers'; its default base 500,000 for either); the
    sliding layers' rope unscaled."""
    arch, num_layers = "Olmo3ForCausalLM", cfg["num_hidden_layers"]
    full, local = _ropes_by_layer_type(arch, cfg, 500_000.0, 500_000.0)
    kind = rope_kind(full)
    if kind not in ("default", "yarn"):
        raise ModelLoadError(f"{arch} with rope type {kind!r} is not supported (default or "
                             "yarn)")
    if kind == "yarn":
        full.setdefault("original_max_position_embeddings",
                        cfg.get("max_position_embeddings", 2048))
    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(num_layers)]
    return {
        "rope_theta": float(full["rope_theta"]),
        "rope_scaling": None if kind == "default" else dict(full, rope_type=kind),
        "rope_local_theta": float(local["rope_theta"]),
        "layer_windows": layer_windows_from(arch, layer_types, num_layers,
                                        cfg.get("sliding_window", 4096)),
    }


def starcoder2_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """StarCoder2's window: every layer attends to its last ``sliding_window`` keys where the
    config has one (transformers' ``Starcoder2Attention``), else to all of them."""
    window = cfg.get("sliding_window")
    if window is None:
        return {}
    layers = cfg["num_hidden_layers"]
    return {"layer_windows": layer_windows_from("Starcoder2ForCausalLM",
                                                ["sliding_attention"] * layers, layers,
                                                window)}
