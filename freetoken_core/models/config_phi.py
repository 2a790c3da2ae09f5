"""Phi's config.json (transformers' ``PhiConfig``: Phi-1, Phi-1.5, Phi-2) as
``config.ModelConfig.from_dict`` reads it: its keys under the names that reads, with
transformers' defaults (:func:`phi_config`), then the family's fields (:func:`phi_fields`);
a value FreeToken cannot run is refused naming its key."""

from __future__ import annotations

from typing import Any

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config_defaults import with_defaults

# PhiConfig's defaults where config.json leaves a key out, for the keys config.py reads
# with other defaults (its rope base: the common 10,000).
_PHI_DEFAULTS = {"vocab_size": 51200, "hidden_size": 2048, "intermediate_size": 8192,
                 "num_hidden_layers": 24, "num_attention_heads": 32,
                 "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
                 "tie_word_embeddings": False}


def phi_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A Phi config.json as config.py reads a config, with ``PhiConfig``'s defaults where it
    leaves keys out: ``layer_norm_eps`` (default 1e-5) as the norms' eps (``rms_norm_eps``:
    a model's one norm eps), biases on q/k/v always (``attention_bias``), ``qk_layernorm``
    (default false) as ``use_qk_norm``. The checkpoints of Phi's original format
    (``model_type`` ``phi-msft``, its own keys and tensor names) are refused."""
    if cfg.get("model_type") == "phi-msft":
        raise ModelLoadError(
            "PhiForCausalLM with model_type 'phi-msft' (Phi's original checkpoint format, "
            "before transformers' PhiForCausalLM) is not supported; use the checkpoint in "
            "transformers' format (model_type 'phi')")
    out = with_defaults(cfg, _PHI_DEFAULTS)
    eps = cfg.get("layer_norm_eps", 1e-5)
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps >= 0:
        raise ModelLoadError(f"PhiForCausalLM layer_norm_eps must be a number >= 0, not {eps!r}")
    qk_norm = cfg.get("qk_layernorm", False)
    if not isinstance(qk_norm, bool):
        raise ModelLoadError(f"PhiForCausalLM qk_layernorm must be true or false, not "
                             f"{qk_norm!r}")
    heads = out["num_attention_heads"]
    head_dim = out.get("head_dim") or out["hidden_size"] // heads
    if qk_norm and head_dim != out["hidden_size"] // heads:
        # (transformers' q/k LayerNorms are hidden_size / heads wide, whatever head_dim)
        raise ModelLoadError(f"PhiForCausalLM qk_layernorm with head_dim {head_dim} != "
                             f"hidden_size / num_attention_heads is not supported")
    out.update(rms_norm_eps=float(eps), attention_bias=True, use_qk_norm=qk_norm)
    return out


def phi_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Phi's fields as ``PhiConfig`` and ``PhiAttention`` read them: the rotated fraction of
    each head (``rope_parameters``' ``partial_rotary_factor``, else the top-level key,
    default 0.5), the default rope only (the released checkpoints scale none), and an MLP
    that is not gated (``fc2(act(fc1(x)))``)."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ModelLoadError(f"PhiForCausalLM rope_parameters must be an object, not "
                             f"{params!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ModelLoadError(f"PhiForCausalLM with rope type {kind!r} (rope_parameters) is "
                             "not supported; FreeToken runs Phi's default rope")
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not 0 < factor <= 1:
        raise ModelLoadError(f"PhiForCausalLM partial_rotary_factor must be a number in "
                             f"(0, 1], not {factor!r}")
    return {"partial_rotary_factor": float(factor), "gated_mlp": False}
