"""LFM2's ``ModelConfig`` fields (transformers' ``Lfm2Config``), read as transformers reads
them, its defaults where config.json leaves a key out: its keys ``norm_eps``,
``tie_embedding`` and ``block_ff_dim`` under the names config.py reads; ``layer_types``
(``conv`` / ``full_attention``; else ``full_attn_idxs``, default every layer attention); the
convolutions' kernel ``conv_L_cache`` (3) and ``conv_bias``. The MLP's width comes from the
checkpoint's tensors (``block_auto_adjust_ff_dim`` changes only what transformers builds).

LFM2-MoE (``Lfm2MoeConfig``: LFM2-8B-A1B): the first ``num_dense_layers`` (2) layers'
MLPs dense, the others ``num_experts`` (32) experts of ``moe_intermediate_size`` (1792),
``num_experts_per_tok`` (4) a token chosen by the sigmoid of the router's logits plus a
per-expert bias (``use_expert_bias``, default on), their sigmoids rescaled to sum to 1
(``norm_topk_prob``, plus 1e-6) times ``routed_scaling_factor`` (1)."""

from __future__ import annotations

from typing import Any

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config_defaults import with_defaults
from freetoken_core.models.config_fields import rope_kind

ARCH = "Lfm2ForCausalLM"
_DEFAULTS = {"vocab_size": 65_536, "hidden_size": 2560, "intermediate_size": 12_288,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "max_position_embeddings": 128_000, "rms_norm_eps": 1e-5,
             "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
_KEYS = {"norm_eps": "rms_norm_eps", "tie_embedding": "tie_word_embeddings",
         "block_ff_dim": "intermediate_size"}


def lfm2_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """LFM2's config.json under the key names config.py reads, with ``Lfm2Config``'s
    defaults (its rope base 1,000,000)."""
    renamed = {_KEYS.get(k, k): v for k, v in cfg.items() if k not in _KEYS}
    renamed.update({_KEYS[k]: v for k, v in cfg.items() if k in _KEYS})
    return with_defaults(renamed, _DEFAULTS, 1_000_000.0)


def lfm2_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The fields of the module docstring, checked."""
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        full = cfg.get("full_attn_idxs")
        full = set(range(layers) if full is None else full)
        types = ["full_attention" if i in full else "conv" for i in range(layers)]
    if len(types) != layers or set(types) - {"conv", "full_attention"}:
        raise ModelLoadError(f"{ARCH} layer_types {types!r}: expected {layers} of 'conv' / "
                             "'full_attention'")
    kernel = cfg.get("conv_L_cache", 3)
    if not isinstance(kernel, int) or kernel < 2:
        raise ModelLoadError(f"{ARCH} conv_L_cache must be an integer >= 2, not {kernel!r}")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope_kind(rope) != "default":
        raise ModelLoadError(f"{ARCH} rope type {rope_kind(rope)!r} is not supported (its "
                             "checkpoints use the default rope)")
    return {"layer_kinds": tuple("short_conv" if t == "conv" else "attention" for t in types),
            "short_conv_kernel": kernel}


_MOE_DEFAULTS = {"hidden_size": 2048, "intermediate_size": 7168,
                 "moe_intermediate_size": 1792, "num_dense_layers": 2,
                 "num_experts_per_tok": 4, "num_experts": 32, "use_expert_bias": True,
                 "routed_scaling_factor": 1.0, "norm_topk_prob": True}


def lfm2_moe_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """LFM2-MoE's config.json as :func:`lfm2_config` reads LFM2's, ``Lfm2MoeConfig``'s
    defaults where it leaves keys out."""
    return lfm2_config({**_MOE_DEFAULTS, **cfg})


def lfm2_moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """LFM2's fields and its experts' (module docstring), checked."""
    arch = "Lfm2MoeForCausalLM"
    counts = {key: cfg[key] for key in ("num_experts", "num_experts_per_tok",
                                        "moe_intermediate_size")}
    dense = cfg["num_dense_layers"]
    layers = cfg["num_hidden_layers"]
    for key, value in (*counts.items(), ("num_dense_layers", dense + 1)):
        if not isinstance(value, int) or value < 1:
            raise ModelLoadError(f"{arch} {key} must be a positive integer, not {value!r}")
    if counts["num_experts_per_tok"] > counts["num_experts"]:
        raise ModelLoadError(f"{arch} num_experts_per_tok exceeds num_experts")
    scale = cfg["routed_scaling_factor"]
    if not isinstance(scale, int | float) or scale <= 0:
        raise ModelLoadError(f"{arch} routed_scaling_factor must be a positive number, not "
                             f"{scale!r}")
    return {**lfm2_fields(cfg), **counts, "expert_gating": "sigmoid",
            "norm_topk_prob": bool(cfg["norm_topk_prob"]), "expert_norm_eps": 1e-6,
            "routed_scaling_factor": float(scale),
            "expert_selection_bias": bool(cfg["use_expert_bias"]),
            "moe_layers": tuple(int(i >= dense) for i in range(layers))}
