"""Nemotron-H's ``ModelConfig`` fields (transformers' ``NemotronHConfig``), read as transformers
reads them, its defaults where config.json leaves a key out: the blocks from
``layers_block_type`` / ``layer_types`` (or the released configs' ``hybrid_override_pattern``:
``M`` Mamba-2, ``*`` attention, ``-`` MLP, ``E`` experts - refused), their count the model's
layers; the Mamba-2 blocks' ``mamba_num_heads`` (128) of ``mamba_head_dim`` (64), ``n_groups``
(8), ``ssm_state_size`` (128), ``conv_kernel`` (4), ``chunk_size`` (128) and
``time_step_limit`` (each also under its released ``mamba_*`` name); ``layer_norm_epsilon``;
the MLP's ``mlp_hidden_act`` (ReLU², the only one its checkpoints use)."""

from __future__ import annotations

from typing import Any

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config_defaults import with_defaults
from freetoken_core.models.config_granite4 import time_step_limit

ARCH = "NemotronHForCausalLM"
_DEFAULTS = {"vocab_size": 131_072, "hidden_size": 4096, "num_attention_heads": 32,
             "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 4096,
             "intermediate_size": 21_504, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
             "bos_token_id": 1, "eos_token_id": 2}
_PATTERN = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
_KINDS = {"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp",
          "moe": "moe"}
# (the released configs' names -> NemotronHConfig's)
_KEYS = {"layer_norm_epsilon": "rms_norm_eps", "mamba_n_groups": "n_groups",
         "mamba_d_conv": "conv_kernel", "mamba_chunk_size": "chunk_size",
         "mamba_dt_limit": "time_step_limit"}


def nemotron_h_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Nemotron-H's config.json under the names config.py reads, its defaults, and
    ``num_hidden_layers`` the blocks'."""
    out = {_KEYS.get(k, k): v for k, v in cfg.items()}
    types = out.get("layers_block_type") or out.get("layer_types")
    if types is None and isinstance(out.get("hybrid_override_pattern"), str):
        pattern = out["hybrid_override_pattern"]
        if set(pattern) - set(_PATTERN):
            raise ModelLoadError(f"{ARCH} hybrid_override_pattern {pattern!r}: expected the "
                                 f"characters {''.join(_PATTERN)}")
        types = [_PATTERN[c] for c in pattern]
    out["layers_block_type"] = types or ["linear_attention", "moe", "full_attention", "mlp"]
    out["num_hidden_layers"] = len(out["layers_block_type"])
    return with_defaults(out, _DEFAULTS, 10_000.0)


def nemotron_h_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The fields of the module docstring, checked."""
    types = cfg["layers_block_type"]
    if not isinstance(types, list) or set(types) - set(_KINDS):
        raise ModelLoadError(f"{ARCH} layers_block_type {types!r}: expected "
                             "'linear_attention', 'full_attention' or 'mlp' blocks")
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if cfg.get(key, want) != want:
            raise ModelLoadError(f"{ARCH} {key} {cfg[key]!r} is not supported; FreeToken "
                                 f"computes {want} for it")
    shape = tuple(cfg.get(k, d) for k, d in (
        ("mamba_num_heads", 128), ("mamba_head_dim", 64), ("n_groups", 8),
        ("ssm_state_size", 128), ("conv_kernel", 4), ("chunk_size", 128)))
    for name, value in zip(("mamba_num_heads", "mamba_head_dim", "n_groups",
                            "ssm_state_size", "conv_kernel", "chunk_size"), shape):
        if not isinstance(value, int) or value < (2 if name == "conv_kernel" else 1):
            raise ModelLoadError(f"{ARCH} {name} must be a positive integer, not {value!r}")
    if shape[0] % shape[2]:
        raise ModelLoadError(f"{ARCH} mamba_num_heads {shape[0]} is not a multiple of "
                             f"n_groups {shape[2]}")
    fields: dict[str, Any] = {
        "layer_kinds": tuple(_KINDS[t] for t in types), "mamba_shape": shape,
        "mamba_time_step_limit": time_step_limit(ARCH, cfg), "gated_mlp": False,
        "hidden_act": "relu2"}
    if "moe" in types:
        fields.update(_experts(cfg))
    return fields


def _experts(cfg: dict[str, Any]) -> dict[str, Any]:
    """Nemotron 3 Nano's experts: ``n_routed_experts`` (8) ungated ReLU² experts of
    ``moe_intermediate_size`` (7688), ``num_experts_per_tok`` (2) a token chosen by sigmoid
    scores plus the router's ``e_score_correction_bias`` among the best ``topk_group`` of
    ``n_group`` groups, rescaled to sum to 1 (``norm_topk_prob``) times
    ``routed_scaling_factor``, beside a shared one of ``moe_shared_expert_intermediate_size``;
    a latent projection (``moe_latent_size``) refused."""
    if cfg.get("moe_latent_size") is not None:
        raise ModelLoadError(f"{ARCH} with moe_latent_size (a latent projection around the "
                             "experts) is not supported")
    experts = cfg.get("n_routed_experts", cfg.get("num_local_experts", 8))
    counts = {"n_routed_experts": experts, "num_experts_per_tok": cfg.get("num_experts_per_tok", 2),
              "moe_intermediate_size": cfg.get("moe_intermediate_size", 7688),
              "moe_shared_expert_intermediate_size": cfg.get(
                  "moe_shared_expert_intermediate_size", 7688),
              "n_group": cfg.get("n_group", 1), "topk_group": cfg.get("topk_group", 1)}
    for key, value in counts.items():
        if not isinstance(value, int) or value < 1:
            raise ModelLoadError(f"{ARCH} {key} must be a positive integer, not {value!r}")
    if counts["num_experts_per_tok"] > experts or experts % counts["n_group"]:
        raise ModelLoadError(f"{ARCH} num_experts_per_tok / n_group do not fit its "
                             f"{experts} experts")
    scale = cfg.get("routed_scaling_factor", 1.0)
    return {"num_experts": experts, "num_experts_per_tok": counts["num_experts_per_tok"],
            "moe_intermediate_size": counts["moe_intermediate_size"],
            "shared_expert_intermediate_size": counts["moe_shared_expert_intermediate_size"],
            "expert_gating": "sigmoid", "expert_selection_bias": True,
            "expert_groups": (counts["n_group"], counts["topk_group"]),
            "expert_norm_eps": 1e-20, "norm_topk_prob": bool(cfg.get("norm_topk_prob", True)),
            "routed_scaling_factor": float(scale),
            "moe_layers": tuple(int(t == "moe") for t in cfg["layers_block_type"])}
