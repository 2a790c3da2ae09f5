"""The mixture-of-experts families' ``ModelConfig`` fields (Qwen3-MoE, Qwen2-MoE, Mixtral,
OLMoE, Granite MoE, gpt-oss, GLM-4.5), read from config.json as transformers' config classes
read them (their defaults where a key is left out), a value FreeToken cannot run refused
naming its key (``config.ModelConfig.from_dict`` calls them)."""

from __future__ import annotations

import math
from typing import Any

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config_fields import layer_windows_from


def moe_fields(cfg: dict[str, Any], arch: str, family: str) -> dict[str, Any]:
    """The mixture of experts as transformers' configs read it: Qwen3-MoE's (and Qwen2-MoE's,
    with its shared expert of ``shared_expert_intermediate_size``)
    ``num_experts`` (``num_local_experts`` as transformers 5 saves it),
    ``moe_intermediate_size``, ``norm_topk_prob`` (default False) and its dense layers
    (``mlp_only_layers``, and every layer but each ``decoder_sparse_step``-th); Mixtral's
    ``num_local_experts`` of ``intermediate_size``, every layer sparse, top k always
    renormalized. Both: ``num_experts_per_tok`` of them, softmax routing, SwiGLU experts.
    A key config.json leaves out takes transformers' default; a bad value is named."""
    layers = cfg["num_hidden_layers"]
    qwen = family in ("qwen3_moe", "qwen2_moe")
    qwen2 = family == "qwen2_moe"
    if family == "olmoe":
        return _olmoe_fields(cfg, arch)
    if family == "granitemoe":
        return _granitemoe_fields(cfg, arch)
    # (transformers' defaults where config.json leaves a key out)
    experts = cfg.get("num_experts", cfg.get("num_local_experts", 60 if qwen2 else 128)) if (
        qwen) else cfg.get("num_local_experts", 8)
    top_k = cfg.get("num_experts_per_tok", (4 if qwen2 else 8) if qwen else 2)
    size = cfg.get("moe_intermediate_size", 1408 if qwen2 else 768) if qwen else cfg.get(
        "intermediate_size")
    shared = cfg.get("shared_expert_intermediate_size", 5632) if qwen2 else 0
    expert_counts(arch, (("num_experts" if qwen else "num_local_experts", experts, 1),
                          ("num_experts_per_tok", top_k, 1),
                          ("moe_intermediate_size" if qwen else "intermediate_size", size, 1),
                          ("shared_expert_intermediate_size", shared, 0)), top_k, experts)
    flags: tuple[int, ...] = ()
    if qwen:
        step = cfg.get("decoder_sparse_step") or 1
        dense = set(cfg.get("mlp_only_layers") or ())
        flags = tuple(int(i not in dense and (i + 1) % step == 0) for i in range(layers))
    return {"num_experts": experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": size,
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)) if qwen else True,
            "routed_scaling_factor": routed_scale(cfg, arch),
            "shared_expert_intermediate_size": shared,
            "moe_layers": flags if 0 in flags else ()}


def _olmoe_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """OLMoE's experts as transformers' ``OlmoeConfig`` reads them: ``num_experts`` (64) of
    ``intermediate_size`` each (every layer sparse), ``num_experts_per_tok`` (8), softmax
    routing with the top k renormalized where ``norm_topk_prob`` (default off); its
    ``clip_qkv`` (null in the released models) is refused."""
    experts, top_k = cfg.get("num_experts", 64), cfg.get("num_experts_per_tok", 8)
    size = cfg.get("intermediate_size", 2048)
    expert_counts(arch, (("num_experts", experts, 1), ("num_experts_per_tok", top_k, 1),
                          ("intermediate_size", size, 1)), top_k, experts)
    if cfg.get("clip_qkv") is not None:
        raise ModelLoadError(f"{arch} with clip_qkv {cfg['clip_qkv']!r} is not supported "
                             "(the released OLMoE models have none)")
    return {"num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": size,
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "routed_scaling_factor": routed_scale(cfg, arch)}


def _granitemoe_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """Granite MoE's experts as transformers' ``GraniteMoeConfig`` reads them:
    ``num_local_experts`` (8) of ``intermediate_size`` each (every layer sparse),
    ``num_experts_per_tok`` (2) weighted by the softmax of their router logits (its
    ``GraniteMoeTopKRouter``)."""
    experts, top_k = cfg.get("num_local_experts", 8), cfg.get("num_experts_per_tok", 2)
    size = cfg.get("intermediate_size", 1024)
    expert_counts(arch, (("num_local_experts", experts, 1), ("num_experts_per_tok", top_k, 1),
                          ("intermediate_size", size, 1)), top_k, experts)
    return {"num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": size,
            "expert_gating": "softmax_weight", "routed_scaling_factor": routed_scale(cfg, arch)}


def routed_scale(cfg: dict[str, Any], arch: str) -> float:
    """The routing weights' multiplier (``routed_scaling_factor``; a GGUF file's
    ``expert_weights_scale``), default 1."""
    scale = cfg.get("routed_scaling_factor", 1.0)
    if not isinstance(scale, int | float) or not math.isfinite(scale) or scale <= 0:
        raise ModelLoadError(f"{arch} routed_scaling_factor must be a positive number, "
                             f"not {scale!r}")
    return float(scale)


def expert_counts(arch: str, counts: tuple[tuple[str, Any, int], ...], top_k: int,
                   experts: int) -> None:
    """Each ``(key, value, least)`` an integer of at least ``least``, and no more experts a
    token than there are."""
    for key, value, low in counts:
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ModelLoadError(f"{arch} {key} must be an integer >= {low}, not {value!r}")
    if top_k > experts:
        raise ModelLoadError(f"{arch} num_experts_per_tok {top_k} exceeds its {experts} "
                             "experts")


def gpt_oss_fields(cfg: dict[str, Any], rope_scaling: dict[str, Any] | None
                    ) -> dict[str, Any]:
    """gpt-oss's fields as transformers' ``GptOssConfig`` reads them (its defaults where
    config.json leaves a key out): ``num_local_experts`` experts of ``intermediate_size``,
    ``num_experts_per_tok`` of them weighted by the softmax of their router logits (the
    router and the experts with biases), the clamped SwiGLU (``swiglu_limit``,
    ``swiglu_alpha``), a sink per attention head, and ``layer_types``: sliding-window
    layers attend to their last ``sliding_window`` keys (default: alternating, the first
    sliding). The rope is YaRN's (``rope_scaling`` / ``rope_parameters``)."""
    arch, layers = "GptOssForCausalLM", cfg["num_hidden_layers"]
    experts = cfg.get("num_local_experts", 128)
    top_k = cfg.get("num_experts_per_tok", 4)
    size = cfg.get("intermediate_size", 2880)
    expert_counts(arch, (("num_local_experts", experts, 1), ("num_experts_per_tok", top_k, 1),
                          ("intermediate_size", size, 1)), top_k, experts)
    limit, alpha = cfg.get("swiglu_limit", 7.0), cfg.get("swiglu_alpha", 1.702)
    for key, value in (("swiglu_limit", limit), ("swiglu_alpha", alpha)):
        if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise ModelLoadError(f"{arch} {key} must be a positive number, not {value!r}")
    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if rope_scaling is not None and rope_scaling["rope_type"] != "yarn":
        raise ModelLoadError(f"{arch} with rope type {rope_scaling['rope_type']!r} is not "
                             "supported (its checkpoints use yarn)")
    return {"num_experts": experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": size, "expert_gating": "softmax_weight",
            "expert_bias": True, "swiglu_limit": float(limit), "swiglu_alpha": float(alpha),
            "attention_sinks": True,
            "layer_windows": layer_windows_from(arch, layer_types, layers,
                                            cfg.get("sliding_window", 128))}


def quantized_experts(arch: str, family: str, quantization: Any) -> bool:
    """Whether config.json's ``quantization_config`` says the experts are MXFP4 (gpt-oss's
    released checkpoints); any other quantization (GPTQ, AWQ, FP8, bitsandbytes, ...) is
    refused here, naming it, rather than met later as weights of unknown names."""
    if quantization is None:
        return False
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if method == "mxfp4" and family == "gpt_oss":
        return True
    raise ModelLoadError(
        f"{arch} with quantization_config.quant_method {method!r} is not supported: FreeToken "
        "reads float safetensors (and gpt-oss's MXFP4 experts) from a directory; serve a "
        "GGUF file of the model (any common quant type) or its unquantized checkpoint")


# Glm4MoeConfig's defaults that differ from what config.py assumes for a key left out.
GLM4_MOE_DEFAULTS = {"vocab_size": 151_552, "hidden_size": 4096, "intermediate_size": 10_944,
                     "num_hidden_layers": 46, "num_attention_heads": 96,
                     "num_key_value_heads": 8, "max_position_embeddings": 131_072,
                     "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


def glm4_moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """GLM-4.5's fields as transformers' ``Glm4MoeConfig`` reads them: RoPE on the first
    ``partial_rotary_factor`` (0.5) of each head (NEOX pairs within it), q/k norms where
    ``use_qk_norm``; past the first ``first_k_dense_replace`` (1) layers,
    ``n_routed_experts`` (128) experts of ``moe_intermediate_size`` (1408),
    ``num_experts_per_tok`` (8) a token chosen by sigmoid scores plus the router's
    ``e_score_correction_bias`` among the best ``topk_group`` of ``n_group`` groups (1 of 1),
    their sigmoids rescaled to sum to 1 where ``norm_topk_prob`` (on) times
    ``routed_scaling_factor`` (1), and ``n_shared_experts`` (1) ungated shared experts."""
    arch, layers = "Glm4MoeForCausalLM", cfg["num_hidden_layers"]
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))
    experts, top_k = cfg.get("n_routed_experts", 128), cfg.get("num_experts_per_tok", 8)
    size, shared = cfg.get("moe_intermediate_size", 1408), cfg.get("n_shared_experts", 1)
    groups, keep = cfg.get("n_group", 1), cfg.get("topk_group", 1)
    dense = cfg.get("first_k_dense_replace", 1)
    return {"partial_rotary_factor": partial, **grouped_experts(
        arch, cfg, layers, (experts, top_k, size, shared, groups, keep, dense),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)))}


def grouped_experts(arch: str, cfg: dict[str, Any], layers: int, counts: tuple[Any, ...],
                    norm_topk_prob: bool) -> dict[str, Any]:
    """DeepSeek-V3's routing as GLM-4.5 and dots1 configure it: ``counts`` (experts, a
    token's, their width, shared experts, groups, groups kept, leading dense layers) each
    checked, experts chosen by sigmoid scores plus the selection bias among the best groups,
    rescaled where ``norm_topk_prob``."""
    experts, top_k, size, shared, groups, keep, dense = counts
    expert_counts(arch, (("n_routed_experts", experts, 1), ("num_experts_per_tok", top_k, 1),
                         ("moe_intermediate_size", size, 1), ("n_shared_experts", shared, 0),
                         ("n_group", groups, 1), ("topk_group", keep, 1),
                         ("first_k_dense_replace", dense, 0)), top_k, experts)
    if experts % groups or keep > groups or top_k > keep * (experts // groups):
        raise ModelLoadError(f"{arch} n_group {groups} / topk_group {keep} do not divide "
                             f"{experts} experts into groups holding {top_k} of them")
    return {"num_experts": experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": size, "shared_expert_intermediate_size": size * shared,
            "expert_gating": "sigmoid", "expert_selection_bias": True,
            "expert_groups": (groups, keep), "expert_norm_eps": 1e-20,
            "norm_topk_prob": norm_topk_prob, "routed_scaling_factor": routed_scale(cfg, arch),
            "moe_layers": tuple(int(i >= dense) for i in range(layers))}


# MiniMaxM2Config's defaults that differ from what config.py assumes for a key left out.
MINIMAX_M2_DEFAULTS = {"vocab_size": 200_064, "hidden_size": 3072, "intermediate_size": 1536,
                       "num_hidden_layers": 62, "num_attention_heads": 48,
                       "num_key_value_heads": 8, "head_dim": 128,
                       "max_position_embeddings": 196_608, "bos_token_id": 200_034,
                       "eos_token_id": 200_020, "tie_word_embeddings": False}


def minimax_m2_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """MiniMax-M2's fields as transformers' ``MiniMaxM2Config`` reads them: RMSNorms over all
    the heads' queries and keys before the rotation, RoPE on the first ``rotary_dim`` (or
    ``partial_rotary_factor`` of each head; default all) in NEOX pairs; every layer's MLP
    ``num_local_experts`` (256) experts of ``intermediate_size``, ``num_experts_per_tok``
    (8) chosen by sigmoid scores plus the block's ``e_score_correction_bias``, their
    sigmoids rescaled to sum to 1. The released configs' switches of other variants
    (``scoring_func`` other than sigmoid, ``use_routing_bias`` off, shared experts,
    ``qk_norm_type`` other than ``per_layer``) are refused, naming them."""
    arch = "MiniMaxM2ForCausalLM"
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rotary = cfg.get("rotary_dim")
    partial = (rotary / cfg["head_dim"] if rotary else
               rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    experts, top_k = cfg.get("num_local_experts", 256), cfg.get("num_experts_per_tok", 8)
    size = cfg.get("intermediate_size")
    expert_counts(arch, (("num_local_experts", experts, 1), ("num_experts_per_tok", top_k, 1),
                         ("intermediate_size", size, 1)), top_k, experts)
    for key, good in (("scoring_func", "sigmoid"), ("use_routing_bias", True),
                      ("qk_norm_type", "per_layer"), ("use_qk_norm", True),
                      ("shared_intermediate_size", 0)):
        if cfg.get(key, good) != good:
            raise ModelLoadError(f"{arch} with {key} {cfg[key]!r} is not supported "
                                 f"(transformers' MiniMax-M2 computes {key} {good!r})")
    return {"partial_rotary_factor": float(partial), "num_experts": experts,
            "num_experts_per_tok": top_k, "moe_intermediate_size": size,
            "expert_gating": "sigmoid", "expert_selection_bias": True,
            "norm_topk_prob": True}


# Dots1Config's defaults that differ from what config.py assumes for a key left out.
DOTS1_DEFAULTS = {"vocab_size": 152_064, "hidden_size": 4608, "intermediate_size": 10_944,
                  "num_hidden_layers": 62, "num_attention_heads": 32,
                  "tie_word_embeddings": False}


def dots1_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """dots.llm1's fields as transformers' ``Dots1Config`` reads them: Qwen3's attention
    (per-head q/k norms, whole-head rotary), past the first ``first_k_dense_replace`` (0)
    layers ``n_routed_experts`` experts of ``moe_intermediate_size`` (1408), a token's
    ``num_experts_per_tok`` chosen by sigmoid scores plus the router's
    ``e_score_correction_bias`` among the best ``topk_group`` of ``n_group`` groups (1 of 1),
    rescaled where ``norm_topk_prob`` (off) times ``routed_scaling_factor`` (1), beside
    ``n_shared_experts`` shared experts; the layers ``layer_types`` names sliding (default:
    from ``max_window_layers`` on, where ``sliding_window`` is set) attend to the last
    ``sliding_window`` keys. The expert counts have no default (transformers' None)."""
    arch, layers = "Dots1ForCausalLM", cfg["num_hidden_layers"]
    experts, top_k = cfg.get("n_routed_experts"), cfg.get("num_experts_per_tok")
    size, shared = cfg.get("moe_intermediate_size", 1408), cfg.get("n_shared_experts")
    groups, keep = cfg.get("n_group") or 1, cfg.get("topk_group") or 1
    dense = cfg.get("first_k_dense_replace") or 0
    experts_fields = grouped_experts(
        arch, cfg, layers, (experts, top_k, size, shared, groups, keep, dense),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
    window = cfg.get("sliding_window", 4096)
    kinds = cfg.get("layer_types") or [
        "sliding_attention" if window is not None and i >= cfg.get("max_window_layers", 62)
        else "full_attention" for i in range(layers)]
    if len(kinds) != layers or set(kinds) - {"sliding_attention", "full_attention"}:
        raise ModelLoadError(f"{arch} layer_types must name each of its {layers} layers "
                             f"sliding_attention or full_attention, not {kinds!r}")
    if "sliding_attention" in kinds and not (isinstance(window, int) and window > 0):
        raise ModelLoadError(f"{arch} has sliding_attention layers but sliding_window "
                             f"{window!r}")
    return {**experts_fields,
            "layer_windows": tuple(window if kind == "sliding_attention" else None
                                   for kind in kinds) if "sliding_attention" in kinds else ()}
