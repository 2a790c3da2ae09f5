"""Llama 4's ``ModelConfig`` fields (transformers' ``Llama4TextConfig``: Llama 4 Scout
17B-16E, Maverick 17B-128E, and the language model of ``Llama4ForConditionalGeneration``,
``multimodal.py``), read as transformers reads them, its defaults where config.json leaves a
key out (and its head size 128 whatever the hidden size, rope base 500,000, eps 1e-5):

- ``intermediate_size`` (8192) is each expert's and the shared expert's size,
  ``intermediate_size_mlp`` (16384) the dense layers' (under the names config.py reads,
  ``moe_intermediate_size`` and ``intermediate_size``, as llama.cpp's converter renames
  them);
- the layers ``moe_layers`` lists (default every ``interleave_moe_layer_step``-th, 1: all)
  are ``num_local_experts`` (16) experts, ``num_experts_per_tok`` (1) a token, beside a
  shared expert (``llama4.py``: the chosen experts' inputs scaled by the sigmoid of their
  router logits);
- the layers ``no_rope_layers`` marks 1 rotate queries and keys (default: all but every
  ``no_rope_layer_interval``-th, 4), and L2-normalize them after the rotation where
  ``use_qk_norm``; the others (NoPE) scale their queries by the attention temperature
  ``1 + attn_scale ln(1 + floor((position + 1) / floor_scale))`` where
  ``attn_temperature_tuning`` (0.1, 8192);
- ``layer_types``: the ``chunked_attention`` layers (default: the rotating ones, where
  ``attention_chunk_size`` is not None) attend within chunks of ``attention_chunk_size``
  (8192) positions (``ModelConfig.layer_chunks``), the ``full_attention`` ones to every key.
"""

from __future__ import annotations

import math
from typing import Any

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config_defaults import with_defaults
from freetoken_core.models.config_fields import rope_kind

ARCH = "Llama4ForCausalLM"
_DEFAULTS = {"vocab_size": 202_048, "hidden_size": 5120, "intermediate_size": 8192,
             "intermediate_size_mlp": 16_384, "num_hidden_layers": 48,
             "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
             "max_position_embeddings": 131_072, "rms_norm_eps": 1e-5, "bos_token_id": 1,
             "eos_token_id": 2, "num_experts_per_tok": 1, "num_local_experts": 16,
             "interleave_moe_layer_step": 1, "use_qk_norm": True, "no_rope_layer_interval": 4,
             "attention_chunk_size": 8192, "attn_temperature_tuning": True,
             "floor_scale": 8192, "attn_scale": 0.1}
_ROPES = ("default", "linear", "llama3", "yarn", "factors")  # (factors: a GGUF file's llama3)


def llama4_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Llama 4's config.json with ``Llama4TextConfig``'s defaults, its two MLP sizes under
    the names config.py reads (module docstring)."""
    out = with_defaults(cfg, _DEFAULTS, 500_000.0)
    out["moe_intermediate_size"] = out["intermediate_size"]
    out["intermediate_size"] = out["intermediate_size_mlp"]
    return out


def _count(key: str, value: Any, least: int = 1) -> int:
    """``value`` of ``key``, an integer of at least ``least``; refused naming the key."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ModelLoadError(f"{ARCH} {key} must be an integer >= {least}, not {value!r}")
    return value


def _flags(key: str, values: Any, layers: int) -> list[int]:
    """The first ``layers`` of ``values`` (0 / 1 a layer, ``no_rope_layers``)."""
    if not isinstance(values, list) or len(values) < layers or any(
            v not in (0, 1) for v in values):
        raise ModelLoadError(f"{ARCH} {key} must list 0 or 1 for each of the {layers} layers, "
                             f"not {values!r}")
    return [int(v) for v in values[:layers]]


def llama4_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The fields of the module docstring, from :func:`llama4_config`'s dict, checked."""
    layers = cfg["num_hidden_layers"]
    experts = _count("num_local_experts", cfg["num_local_experts"])
    used = _count("num_experts_per_tok", cfg["num_experts_per_tok"])
    if used > experts:
        raise ModelLoadError(f"{ARCH} num_experts_per_tok {used} exceeds num_local_experts "
                             f"{experts}")
    size = _count("intermediate_size", cfg["moe_intermediate_size"])
    moe = cfg.get("moe_layers")
    if moe is None:
        step = _count("interleave_moe_layer_step", cfg["interleave_moe_layer_step"])
        moe = list(range(step - 1, layers, step))
    if not isinstance(moe, list) or any(isinstance(i, bool) or not isinstance(i, int)
                                        or not 0 <= i < layers for i in moe):
        raise ModelLoadError(f"{ARCH} moe_layers must list layer indices below {layers}, not "
                             f"{moe!r}")
    rotates = cfg.get("no_rope_layers")
    if not rotates:  # (transformers: none or an empty list)
        interval = _count("no_rope_layer_interval", cfg["no_rope_layer_interval"])
        rotates = [int((i + 1) % interval != 0) for i in range(layers)]
    rotates = _flags("no_rope_layers", rotates, layers)
    chunk = cfg.get("attention_chunk_size")
    if chunk is not None:
        _count("attention_chunk_size", chunk)
    types = cfg.get("layer_types")
    if types is None:
        types = ["chunked_attention" if r and chunk is not None else "full_attention"
                 for r in rotates]
    if not isinstance(types, list) or len(types) != layers or set(types) - {
            "chunked_attention", "full_attention"}:
        raise ModelLoadError(f"{ARCH} layer_types {types!r}: expected {layers} of "
                             "'chunked_attention' / 'full_attention'")
    if chunk is None and "chunked_attention" in types:
        raise ModelLoadError(f"{ARCH} layer_types has chunked_attention layers but "
                             "attention_chunk_size is None")
    tuning = bool(cfg["attn_temperature_tuning"])
    scale = cfg["attn_scale"]
    if tuning and (isinstance(scale, bool) or not isinstance(scale, int | float)
                   or not math.isfinite(scale)):
        raise ModelLoadError(f"{ARCH} attn_scale must be a number, not {scale!r}")
    floor = _count("floor_scale", cfg["floor_scale"]) if tuning else 0
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope_kind(params) not in _ROPES:
        raise ModelLoadError(f"{ARCH} rope type {rope_kind(params)!r} is not supported "
                             f"({', '.join(_ROPES)})")
    return {"num_experts": experts, "num_experts_per_tok": used,
            "moe_intermediate_size": size, "shared_expert_intermediate_size": size,
            "moe_layers": tuple(int(i in moe) for i in range(layers)),
            "expert_gating": "llama4", "norm_topk_prob": False,
            "no_rope_layers": tuple(rotates),
            "layer_chunks": tuple(chunk if t == "chunked_attention" else 0 for t in types),
            "attention_temperature_beta": float(scale) if tuning else 0.0,
            "attention_temperature_length": floor}
