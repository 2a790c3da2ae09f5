"""Cohere's and Cohere 2's config.json (transformers' ``CohereConfig``, ``Cohere2Config``)
as ``config.ModelConfig.from_dict`` reads it: its keys under the names that reads, with
transformers' defaults (:func:`cohere_config`), then the family's fields
(:func:`cohere_fields`); a value FreeToken cannot run is refused naming its key. (The
model, ``cohere.py``, imports the config, so the config cannot import it.)"""

from __future__ import annotations

import math
from typing import Any

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config_defaults import with_defaults
from freetoken_core.models.config_fields import nope_global_layers

# Cohere's and Cohere 2's config defaults where config.json leaves a key out, for the keys
# config.py reads with other defaults (``CohereConfig``'s, ``Cohere2Config``'s).
_COHERE_DEFAULTS = {"vocab_size": 256000, "hidden_size": 8192, "intermediate_size": 22528,
                    "num_hidden_layers": 40, "num_attention_heads": 64,
                    "max_position_embeddings": 8192, "bos_token_id": 5,
                    "eos_token_id": 255001, "tie_word_embeddings": True}
_ARCHITECTURES = {"cohere": "CohereForCausalLM", "cohere2": "Cohere2ForCausalLM"}


def cohere_config(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """A Cohere or Cohere 2 config.json as config.py reads a config, with transformers'
    defaults where it leaves keys out: ``layer_norm_eps`` (default 1e-5) as the norms' eps
    (``rms_norm_eps``: a model's one norm eps), Cohere's default rope base 500,000 (Cohere
    2's is the common 10,000), and Cohere 2's head size, which its config always derives
    as ``hidden_size / num_attention_heads``."""
    out = with_defaults(cfg, _COHERE_DEFAULTS, 500_000.0 if family == "cohere" else None)
    eps = cfg.get("layer_norm_eps", 1e-5)
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps >= 0:
        raise ModelLoadError(f"{_ARCHITECTURES[family]} layer_norm_eps must be a number >= 0, "
                             f"not {eps!r}")
    out["rms_norm_eps"] = float(eps)
    if family == "cohere2":
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    return out


def cohere_fields(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """Cohere's ``logit_scale`` (default 0.0625), and Cohere 2's layers as transformers'
    ``Cohere2Config`` and ``Cohere2Attention`` read them: ``layer_types`` (default: every
    ``sliding_window_pattern``-th layer global, 4), the sliding layers attending to their
    last ``sliding_window`` keys (default 4096) and rotated, the global ones attending to
    every key and not rotated (NoPE)."""
    arch = _ARCHITECTURES[family]
    scale = cfg.get("logit_scale", 0.0625)
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(
            scale):
        raise ModelLoadError(f"{arch} logit_scale must be a number, not {scale!r}")
    fields: dict[str, Any] = {"logit_scale": float(scale)}
    if family == "cohere2":
        fields.update(nope_global_layers(arch, cfg, cfg.get("sliding_window", 4096)))
    return fields
