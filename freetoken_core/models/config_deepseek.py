"""The config.json of the multi-head latent attention (MLA) families, read as transformers'
config classes read them: ``DeepseekV2Config`` (DeepSeek-V2, V2-Lite, V2.5, DeepSeek-Coder-V2),
``DeepseekV3Config`` (DeepSeek-V3, R1, V3.1, Kimi K2, Moonlight) and ``Glm4MoeLiteConfig``
(GLM-4.7-Flash), each with its class's defaults where a key is left out.

``ModelConfig`` holds such a model as ``models/deepseek.py`` computes it (the absorbed form):
``head_dim`` is ``qk_rope_head_dim`` (the rotary tables', as transformers sets it), one KV
head (the cache holds each token's normed latent and rotated key part, ``kv_layout``), the
latent shapes in ``mla_shape`` and the score scale ``qk_head_dim ** -0.5`` times YaRN's
``mscale_all_dim`` factor squared (transformers' ``yarn_apply_mscale``)."""

from __future__ import annotations

import math
from typing import Any

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config_defaults import with_defaults
from freetoken_core.models.config_moe import expert_counts, routed_scale

_MLA = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128}
# The config classes' defaults where config.json leaves a key out (``None``: transformers'
# default is None too; those keys are required or mean "none").
DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v2": {**_MLA, "vocab_size": 102_400, "hidden_size": 4096,
                    "intermediate_size": 11_008, "num_hidden_layers": 32,
                    "num_attention_heads": 32, "max_position_embeddings": 2048,
                    "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2,
                    "tie_word_embeddings": False, "n_routed_experts": 64,
                    "n_shared_experts": 2, "moe_intermediate_size": 1407,
                    "num_experts_per_tok": None, "first_k_dense_replace": 0,
                    "routed_scaling_factor": 1.0, "topk_method": "greedy", "n_group": None,
                    "topk_group": None, "norm_topk_prob": False},
    "deepseek_v3": {**_MLA, "vocab_size": 129_280, "hidden_size": 7168,
                    "intermediate_size": 18_432, "num_hidden_layers": 61,
                    "num_attention_heads": 128, "max_position_embeddings": 4096,
                    "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 1,
                    "tie_word_embeddings": False, "n_routed_experts": 256,
                    "n_shared_experts": 1, "moe_intermediate_size": 2048,
                    "num_experts_per_tok": 8, "first_k_dense_replace": 3,
                    "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
                    "norm_topk_prob": True, "rope_interleave": True},
    "glm4_moe_lite": {"q_lora_rank": 768, "kv_lora_rank": 512, "qk_nope_head_dim": 192,
                      "qk_rope_head_dim": 64, "v_head_dim": 256, "vocab_size": 154_880,
                      "hidden_size": 2048, "intermediate_size": 10_240,
                      "num_hidden_layers": 47, "num_attention_heads": 20,
                      "max_position_embeddings": 202_752, "rms_norm_eps": 1e-5,
                      "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
                      "n_routed_experts": 64, "n_shared_experts": 1,
                      "moe_intermediate_size": 1536, "num_experts_per_tok": 4,
                      "routed_scaling_factor": 1.8, "n_group": 1, "topk_group": 1,
                      "norm_topk_prob": True, "rope_interleave": True},
}
_CLASSES = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
            "glm4_moe_lite": "Glm4MoeLiteForCausalLM"}


def mla_config(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """``cfg`` with ``family``'s defaults, its rope base 10,000 where none is given, and
    ``head_dim`` / ``num_key_value_heads`` as ``ModelConfig`` holds an MLA model (module
    docstring)."""
    out = with_defaults(cfg, DEFAULTS[family], theta=10_000.0)
    arch = _CLASSES[family]
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        value = out[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ModelLoadError(f"{arch} {key} must be a positive integer, not {value!r}")
    if out["qk_rope_head_dim"] % 2:
        raise ModelLoadError(f"{arch} qk_rope_head_dim {out['qk_rope_head_dim']} is odd; "
                             "RoPE turns pairs of dimensions")
    q_lora = out["q_lora_rank"]
    if q_lora is not None and (not isinstance(q_lora, int) or q_lora < 1):
        raise ModelLoadError(f"{arch} q_lora_rank must be a positive integer or null, "
                             f"not {q_lora!r}")
    if out.get("mlp_bias"):
        raise ModelLoadError(f"{arch} with mlp_bias true is not supported (the released "
                             "models' MLPs have no biases)")
    return {**out, "head_dim": out["qk_rope_head_dim"], "num_key_value_heads": 1}


def mla_fields(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """The latent shapes, the score scale, the rope layout and the experts (module
    docstring): DeepSeek-V2's chosen by softmax probabilities (``topk_method`` ``greedy``, or
    ``group_limited_greedy``: among the ``topk_group`` groups of the best single
    probability), not rescaled; V3's and GLM-4.7-Flash's by sigmoid scores plus the router's
    ``e_score_correction_bias`` among the best groups (by their two best), rescaled where
    ``norm_topk_prob``; both times ``routed_scaling_factor``, beside ``n_shared_experts``
    SwiGLU shared experts, past the first ``first_k_dense_replace`` dense layers
    (GLM-4.7-Flash: ``mlp_layer_types``)."""
    arch, layers = _CLASSES[family], cfg["num_hidden_layers"]
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError(f"{arch} with partial_rotary_factor "
                             f"{rope['partial_rotary_factor']!r} is not supported (RoPE turns "
                             "the whole qk_rope_head_dim part)")
    qk_dim = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    return {"mla_shape": (cfg["q_lora_rank"] or 0, cfg["kv_lora_rank"], cfg["qk_nope_head_dim"],
                          cfg["qk_rope_head_dim"], cfg["v_head_dim"]),
            "query_scale": qk_dim ** -0.5 * _mscale(rope) ** 2,
            # (DeepSeek-V2's rotation is on adjacent pairs always, V3's where rope_interleave)
            "rope_interleaved": family == "deepseek_v2" or bool(cfg.get("rope_interleave")),
            **_experts(cfg, family, arch, layers)}


def _mscale(rope: dict[str, Any]) -> float:
    """YaRN's ``0.1 mscale_all_dim ln(factor) + 1`` (1 without YaRN or the key)."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    all_dim, factor = rope.get("mscale_all_dim") or 0, rope.get("factor") or 1.0
    if kind == "default" or not all_dim or factor <= 1:
        return 1.0
    return 0.1 * all_dim * math.log(factor) + 1.0


def _experts(cfg: dict[str, Any], family: str, arch: str, layers: int) -> dict[str, Any]:
    experts, top_k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    size, shared = cfg["moe_intermediate_size"], cfg["n_shared_experts"]
    v2 = family == "deepseek_v2"
    method = cfg.get("topk_method", "greedy" if v2 else "noaux_tc")
    grouped = not v2 or method == "group_limited_greedy"
    groups, keep = (cfg["n_group"], cfg["topk_group"]) if grouped else (1, 1)
    counts = [("n_routed_experts", experts, 1), ("num_experts_per_tok", top_k, 1),
              ("moe_intermediate_size", size, 1), ("n_shared_experts", shared, 0),
              ("n_group", groups, 1), ("topk_group", keep, 1)]
    if family == "glm4_moe_lite":
        kinds = cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
        if len(kinds) != layers or set(kinds) - {"dense", "sparse"}:
            raise ModelLoadError(f"{arch} mlp_layer_types must list 'dense' or 'sparse' for "
                                 f"each of its {layers} layers, not {kinds!r}")
        moe_layers = tuple(int(kind == "sparse") for kind in kinds)
    else:
        dense = cfg.get("first_k_dense_replace") or 0
        counts.append(("first_k_dense_replace", dense, 0))
        moe_layers = tuple(int(i >= dense) for i in range(layers))
        if cfg.get("moe_layer_freq", 1) != 1:
            raise ModelLoadError(f"{arch} with moe_layer_freq {cfg['moe_layer_freq']!r} is not "
                                 "supported (transformers puts experts in every layer past "
                                 "first_k_dense_replace; the released models' is 1)")
    expert_counts(arch, tuple(counts), top_k, experts)
    if experts % groups or keep > groups or top_k > keep * (experts // groups):
        raise ModelLoadError(f"{arch} n_group {groups} / topk_group {keep} do not divide "
                             f"{experts} experts into groups holding {top_k} of them")
    scoring = cfg.get("scoring_func", "softmax" if v2 else "sigmoid")
    if scoring != ("softmax" if v2 else "sigmoid"):
        raise ModelLoadError(f"{arch} with scoring_func {scoring!r} is not supported "
                             f"(transformers' {arch} scores experts by "
                             f"{'softmax' if v2 else 'sigmoid'})")
    if v2 and method not in ("greedy", "group_limited_greedy"):
        raise ModelLoadError(f"{arch} with topk_method {method!r} is not supported: "
                             "transformers' DeepSeek-V2 router has greedy and "
                             "group_limited_greedy")
    if v2 and cfg.get("norm_topk_prob"):
        raise ModelLoadError(f"{arch} with norm_topk_prob true is not supported: "
                             "transformers' DeepSeek-V2 router does not rescale the top k "
                             "(DeepSeek's own code does; the released V2 models have it off)")
    return {"num_experts": experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": size, "shared_expert_intermediate_size": size * shared,
            "expert_gating": "softmax" if v2 else "sigmoid", "expert_selection_bias": not v2,
            "expert_groups": (groups, keep), "expert_group_by_max": v2,
            "expert_norm_eps": 0.0 if v2 else 1e-20,
            "norm_topk_prob": not v2 and bool(cfg.get("norm_topk_prob")),
            "routed_scaling_factor": routed_scale(cfg, arch), "moe_layers": moe_layers}
