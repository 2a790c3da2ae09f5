"""Gemma 3n's ``ModelConfig`` fields, read from its config.json as transformers'
``Gemma3nTextConfig`` reads it (its defaults where a key is left out); a value FreeToken
cannot run is refused naming its key (``config.ModelConfig.from_dict`` calls
:func:`gemma3n_config`, then :func:`gemma3n_fields`).

What Gemma 3n's text model has beyond Gemma 3's (``models/gemma3n.py`` computes each):

- ``layer_types`` (default: every 5th layer global), the sliding layers over
  ``sliding_window`` keys (512); each type its rope (``rope_parameters`` per type, or the
  legacy ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling``: bases 1,000,000 and
  10,000);
- ``intermediate_size`` a number or a number a layer;
- ``num_kv_shared_layers`` (15): the last layers compute no keys or values and attend to
  those of the last earlier layer of their type (Gemma 4's, ``kv_layout``);
- per-layer embeddings (``hidden_size_per_layer_input``, 256; ``vocab_size_per_layer_input``
  tokens, 262,144, have a row: the others take token 0's);
- AltUp: ``altup_num_inputs`` (4) copies of the hidden state, the layers computing on copy
  ``altup_active_idx`` (0), its correction scaled where ``altup_correct_scale`` (true);
  ``altup_coef_clip`` clamps the coefficients in training only (transformers' inference
  reads it nowhere: neither does FreeToken);
- LAuReL, a ``laurel_rank``-wide (64) residual branch beside attention;
- ``activation_sparsity_pattern``: a sparsity a layer (default: 0.95 for the first 10
  layers of a model of more than 10, 0 after);
- the scores unscaled (``query_scale`` 1), the logits softcapped at
  ``final_logit_softcapping`` (30).
"""

from __future__ import annotations

import math
from typing import Any

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config_defaults import with_defaults
from freetoken_core.models.config_fields import (
    _ropes_by_layer_type,
    _softcap,
    layer_windows_from,
    rope_kind,
)

ARCH = "Gemma3nForCausalLM"

# Gemma3nTextConfig's defaults.
_DEFAULTS = {"vocab_size": 262_400, "hidden_size": 2048, "intermediate_size": 16_384,
             "num_hidden_layers": 35, "num_attention_heads": 8, "num_key_value_heads": 2,
             "head_dim": 256, "max_position_embeddings": 32_768, "rms_norm_eps": 1e-6,
             "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1,
             "sliding_window": 512, "final_logit_softcapping": 30.0,
             "vocab_size_per_layer_input": 262_144, "hidden_size_per_layer_input": 256,
             "altup_active_idx": 0, "altup_correct_scale": True, "altup_num_inputs": 4,
             "num_kv_shared_layers": 15, "laurel_rank": 64}


def gemma3n_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3n's config.json with ``Gemma3nTextConfig``'s defaults where it leaves keys out;
    ``intermediate_size`` the widest layer's, the list kept as ``layer_intermediate_sizes``
    (for :func:`gemma3n_fields`)."""
    out = with_defaults(cfg, _DEFAULTS)
    layers, sizes = out["num_hidden_layers"], out["intermediate_size"]
    if not isinstance(sizes, list):
        sizes = [sizes] * layers
    if len(sizes) != layers or not all(_count(s) for s in sizes):
        raise ModelLoadError(f"{ARCH} intermediate_size must be a positive integer or one for "
                             f"each of the {layers} layers, not {out['intermediate_size']!r}")
    return {**out, "intermediate_size": max(sizes), "layer_intermediate_sizes": sizes}


def gemma3n_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The fields of the module docstring, checked (``cfg`` from :func:`gemma3n_config`)."""
    if cfg.get("attention_bias"):
        raise ModelLoadError(f"{ARCH} with attention_bias is not supported (Gemma 3n's "
                             "checkpoints have none)")
    layers = cfg["num_hidden_layers"]
    if cfg["hidden_size"] % cfg["num_attention_heads"]:
        raise ModelLoadError(f"{ARCH} hidden_size {cfg['hidden_size']} must be a multiple of "
                             f"num_attention_heads {cfg['num_attention_heads']} (transformers' "
                             "Gemma3nTextConfig refuses it)")
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(layers)]
    windows = layer_windows_from(ARCH, types, layers, cfg["sliding_window"])
    full, local = _ropes_by_layer_type(ARCH, cfg, 1_000_000.0,
                                       cfg.get("rope_local_base_freq") or 10_000.0)
    shared = cfg["num_kv_shared_layers"]
    if not isinstance(shared, int) or not 0 <= shared < layers or shared and any(
            t not in types[:layers - shared] for t in types[layers - shared:]):
        raise ModelLoadError(f"{ARCH} num_kv_shared_layers {shared!r} must leave, before the "
                             f"shared layers, a layer of each type they have ({layers} layers)")
    copies, active = cfg["altup_num_inputs"], cfg["altup_active_idx"]
    if not _count(copies) or not isinstance(active, int) or not 0 <= active < copies:
        raise ModelLoadError(f"{ARCH} altup_num_inputs {copies!r} must be a positive integer "
                             f"and altup_active_idx {active!r} one of its copies")
    for key in ("hidden_size_per_layer_input", "vocab_size_per_layer_input", "laurel_rank"):
        if not _count(cfg[key]):
            raise ModelLoadError(f"{ARCH} {key} must be a positive integer, not {cfg[key]!r}")
    softcap = _softcap(ARCH, cfg, "final_logit_softcapping", 30.0)
    if softcap is None:
        raise ModelLoadError(f"{ARCH} final_logit_softcapping must be a positive number "
                             "(transformers' Gemma3nTextConfig refuses null)")
    return {
        "layer_windows": windows,
        "rope_theta": float(full["rope_theta"]),
        "rope_scaling": None if rope_kind(full) == "default" else dict(full,
                                                                      rope_type=rope_kind(full)),
        "rope_local_theta": float(local["rope_theta"]),
        "query_scale": 1.0,
        "final_logit_softcap": softcap,
        "kv_shared_layers": shared,
        "per_layer_input_size": cfg["hidden_size_per_layer_input"],
        "per_layer_vocab_size": cfg["vocab_size_per_layer_input"],
        "altup": (copies, active, int(bool(cfg["altup_correct_scale"]))),
        "laurel_rank": cfg["laurel_rank"],
        "activation_sparsity": _sparsity(cfg.get("activation_sparsity_pattern"), layers),
        "layer_intermediate_sizes": tuple(cfg["layer_intermediate_sizes"]),
    }


def _sparsity(pattern: Any, layers: int) -> tuple[float, ...]:
    """``activation_sparsity_pattern``, checked; transformers' default where it is null."""
    if pattern is None:
        sparse = 10 if layers > 10 else 0
        return (0.95,) * sparse + (0.0,) * (layers - sparse)
    if not isinstance(pattern, list) or len(pattern) != layers or not all(
            isinstance(s, int | float) and not isinstance(s, bool) and math.isfinite(s)
            and 0 <= s <= 1 for s in pattern):
        raise ModelLoadError(f"{ARCH} activation_sparsity_pattern must hold a sparsity in "
                             f"[0, 1] for each of the {layers} layers, not {pattern!r}")
    return tuple(float(s) for s in pattern)


def _count(value: Any) -> bool:
    """Whether ``value`` is a positive integer."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
