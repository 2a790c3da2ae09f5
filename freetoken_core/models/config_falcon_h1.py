"""Falcon-H1's ``ModelConfig`` fields (transformers' ``FalconH1Config``), read as transformers
reads them, its defaults where config.json leaves a key out; a value FreeToken cannot run is
refused naming its key:

- every layer ``hybrid``: attention and a Mamba-2 mixer side by side on the same normed input
  (``layer_kinds``; the attention's keys and values in the cache, the mixer's state per
  sequence);
- the mixer's ``mamba_n_heads`` (128) of ``mamba_d_head`` (``auto``: ``mamba_d_ssm`` (1024; null:
  ``mamba_expand`` (2) x hidden) over the heads), ``mamba_n_groups`` (1), ``mamba_d_state``
  (256), ``mamba_d_conv`` (4), ``mamba_chunk_size`` (256), ``time_step_limit``; its gated norm
  where ``mamba_rms_norm`` (false; else ``y * silu(z)``), before the gate where
  ``mamba_norm_before_gate`` (true) - the biases (``mamba_conv_bias``, ``mamba_proj_bias``,
  ``projectors_bias``) are the checkpoint's tensors;
- ``hidden_act`` SiLU (the MLP's and the mixer's convolution's: checked with the other
  families' activations);
- the µP multipliers (:class:`HybridMultipliers`, 1 by default), the embeddings'
  ``embedding_multiplier`` and the logits' ``lm_head_multiplier``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config_defaults import with_defaults
from freetoken_core.models.config_granite4 import mamba_shape, time_step_limit

ARCH = "FalconH1ForCausalLM"
_DEFAULTS = {"vocab_size": 128_000, "hidden_size": 4096, "intermediate_size": 14_336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
             "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


@dataclass(frozen=True)
class HybridMultipliers:
    """Falcon-H1's µP multipliers of a parallel hybrid block (``falcon_h1.py``), as
    transformers applies them."""

    attention_in: float = 1.0
    """The attention's input (``attention_in_multiplier``)."""
    key: float = 1.0
    """The keys, before the rotation (``key_multiplier``)."""
    attention_out: float = 1.0
    """The attention's output (``attention_out_multiplier``)."""
    ssm_in: float = 1.0
    """The mixer's input (``ssm_in_multiplier``)."""
    ssm_projection: tuple[float, ...] = (1.0,) * 5
    """The mixer's in projection's parts, ``z``, ``x``, ``B``, ``C``, ``dt``
    (``ssm_multipliers``: transformers' ``mup_vector``)."""
    ssm_out: float = 1.0
    """The mixer's output (``ssm_out_multiplier``)."""
    mlp_gate: float = 1.0
    """The MLP's gate projection, before the SiLU (``mlp_multipliers[0]``)."""
    mlp_down: float = 1.0
    """The MLP's output (``mlp_multipliers[1]``)."""


def falcon_h1_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Falcon-H1's config.json with ``FalconH1Config``'s defaults."""
    return with_defaults(cfg, _DEFAULTS, 10_000.0)


def falcon_h1_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The fields of the module docstring, checked."""
    layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    inner = cfg.get("mamba_d_ssm", 1024)
    if inner is None:
        inner = cfg.get("mamba_expand", 2) * hidden
    shape = mamba_shape(ARCH, cfg, inner, "the mixer's size mamba_d_ssm")
    norm = ("none" if not cfg.get("mamba_rms_norm", False) else
            "before_gate" if cfg.get("mamba_norm_before_gate", True) else "after_gate")
    mlp = _numbers(cfg, "mlp_multipliers", 2)
    return {
        "layer_kinds": ("hybrid",) * layers, "mamba_shape": shape,
        "mamba_time_step_limit": time_step_limit(ARCH, cfg), "mamba_norm": norm,
        "embedding_multiplier": _number(cfg, "embedding_multiplier"),
        "logit_scale": _number(cfg, "lm_head_multiplier"),
        "hybrid_multipliers": HybridMultipliers(
            attention_in=_number(cfg, "attention_in_multiplier"),
            key=_number(cfg, "key_multiplier"),
            attention_out=_number(cfg, "attention_out_multiplier"),
            ssm_in=_number(cfg, "ssm_in_multiplier"),
            ssm_projection=_numbers(cfg, "ssm_multipliers", 5),
            ssm_out=_number(cfg, "ssm_out_multiplier"), mlp_gate=mlp[0], mlp_down=mlp[1])}


def _number(cfg: dict[str, Any], key: str) -> float:
    """``cfg[key]`` (default 1), a finite number."""
    value = cfg.get(key, 1.0)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(
            value):
        raise ModelLoadError(f"{ARCH} {key} must be a finite number, not {value!r}")
    return float(value)


def _numbers(cfg: dict[str, Any], key: str, count: int) -> tuple[float, ...]:
    """``cfg[key]``: ``count`` finite numbers (null or left out: all 1)."""
    values = cfg.get(key)
    if values is None:
        return (1.0,) * count
    if not isinstance(values, list | tuple) or len(values) != count:
        raise ModelLoadError(f"{ARCH} {key} must be a list of {count} numbers, not {values!r}")
    return tuple(_number({key: v}, key) for v in values)
