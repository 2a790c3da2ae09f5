"""transformers' config-class defaults of the families whose config.json may leave keys out
that ``config.ModelConfig.from_dict`` would otherwise read with Llama's defaults (EXAONE 3,
ERNIE 4.5, Seed-OSS, StarCoder2, OLMoE, Hunyuan dense; Cohere's are in ``cohere_config.py``),
and their keys under the names it reads.

EXAONE 3.0 and 3.5 (``ExaoneForCausalLM``) are Llama as transformers computes them (its
``ExaoneConfig`` is a ``LlamaConfig``, the class a ``LlamaForCausalLM``) under other names:
config.json's ``num_layers``, ``layer_norm_epsilon`` and ``activation_function``
(``ExaoneConfig.attribute_map``) here, the checkpoints' GPT-2 tensor names in
``weight_names.py``. llama.cpp's converter writes ``exaone`` files with Llama's tensor names,
the q/k rows as the checkpoint has them (half-offset pairs, unlike its ``llama`` files) and
EXAONE 3.5's Llama 3 rope scaling as ``rope_freqs`` factors."""

from __future__ import annotations

from typing import Any

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config_fields import rope_kind

# transformers' Ernie4_5Config defaults that differ from what ModelConfig.from_dict assumes
# for a key left out (head_dim 128, not hidden / heads; 2 KV heads, not one a query head).
_ERNIE4_5_DEFAULTS = {"head_dim": 128, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
                      "max_position_embeddings": 131072, "tie_word_embeddings": True,
                      "use_bias": False, "bos_token_id": 1, "eos_token_id": 2}


def ernie4_5_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """ERNIE 4.5's config.json with transformers' ``Ernie4_5Config`` defaults where a key is
    left out (its rope base 500,000 where neither ``rope_theta`` nor ``rope_parameters``
    gives one), and ``use_bias`` (every linear but the head) as ``attention_bias`` (the q/k/v
    biases; the o and MLP biases are read where the checkpoint has them). Only the default
    rope: the released checkpoints scale none."""
    out = with_defaults(cfg, _ERNIE4_5_DEFAULTS, 500_000.0)
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    params = params if isinstance(params, dict) else {}
    if rope_kind(params) != "default":
        arch = next(iter(cfg.get("architectures") or []), "Ernie4_5ForCausalLM")
        raise ModelLoadError(f"{arch} with rope type {rope_kind(params)!r} is not supported "
                             "(its checkpoints use the default rope)")
    out["attention_bias"] = bool(out["use_bias"])
    return out


# Ernie4_5_MoeConfig's (its keys moe_num_experts / moe_k: num_experts / num_experts_per_tok)
_ERNIE4_5_MOE_DEFAULTS = {"vocab_size": 103_424, "hidden_size": 2560, "intermediate_size": 12_288,
                          "num_hidden_layers": 28, "num_attention_heads": 20,
                          "num_key_value_heads": 4, "moe_intermediate_size": 1536,
                          "moe_k": 6, "moe_num_experts": 64, "moe_num_shared_experts": 2,
                          "moe_layer_start_index": 1, "moe_layer_end_index": -1,
                          "moe_layer_interval": 1}


def ernie4_5_moe_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """ERNIE 4.5 MoE's config.json as :func:`ernie4_5_config` reads ERNIE 4.5's, with
    ``Ernie4_5_MoeConfig``'s defaults where it leaves keys out."""
    return ernie4_5_config({**_ERNIE4_5_MOE_DEFAULTS, **cfg})


def ernie4_5_moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """ERNIE 4.5 MoE's experts (ERNIE-4.5-21B-A3B, 300B-A47B), as transformers reads them: in
    each ``moe_layer_interval``-th layer from ``moe_layer_start_index`` to
    ``moe_layer_end_index`` (-1: the last), ``moe_num_experts`` experts of
    ``moe_intermediate_size``, ``moe_k`` a token chosen by their softmax probabilities plus
    the router's ``e_score_correction_bias`` and weighted by the probabilities rescaled to sum
    to 1, beside ``moe_num_shared_experts`` shared experts (one SwiGLU MLP that many times as
    wide, not gated)."""
    arch, layers = "Ernie4_5_MoeForCausalLM", cfg["num_hidden_layers"]
    keys = ("moe_num_experts", "moe_k", "moe_intermediate_size", "moe_num_shared_experts",
            "moe_layer_start_index", "moe_layer_interval")
    for key in keys:
        value = cfg[key]
        if not isinstance(value, int) or value < (0 if key in (
                "moe_num_shared_experts", "moe_layer_start_index") else 1):
            raise ModelLoadError(f"{arch} {key} must be a positive integer, not {value!r}")
    experts, top_k = cfg["moe_num_experts"], cfg["moe_k"]
    if top_k > experts:
        raise ModelLoadError(f"{arch} moe_k {top_k} exceeds moe_num_experts {experts}")
    end = cfg["moe_layer_end_index"]
    end = layers - 1 if end == -1 else end
    start, step = cfg["moe_layer_start_index"], cfg["moe_layer_interval"]
    return {"num_experts": experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": cfg["moe_intermediate_size"], "norm_topk_prob": True,
            "shared_expert_intermediate_size": (cfg["moe_intermediate_size"]
                                                * cfg["moe_num_shared_experts"]),
            "expert_selection_bias": True,
            "moe_layers": tuple(int((i + 1) % step == 0 and start <= i <= end)
                                for i in range(layers))}


# transformers' SeedOssConfig defaults that differ from what config.py assumes.
_SEED_OSS_DEFAULTS = {"vocab_size": 155136, "hidden_size": 4096, "intermediate_size": 27648,
                      "num_hidden_layers": 64, "num_attention_heads": 80,
                      "num_key_value_heads": 8, "head_dim": 128, "attention_bias": True,
                      "max_position_embeddings": 524288, "bos_token_id": 0, "eos_token_id": 2}


def seed_oss_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Seed-OSS's config.json with transformers' ``SeedOssConfig`` defaults where a key is
    left out: Llama's computation with q/k/v biases (``attention_bias``, default on) and the o
    projection's where the checkpoint has one (``attention_out_bias``)."""
    return with_defaults(cfg, _SEED_OSS_DEFAULTS)


# transformers' Starcoder2Config defaults that differ from what config.py assumes.
_STARCODER2_DEFAULTS = {"vocab_size": 49152, "hidden_size": 3072, "intermediate_size": 12288,
                        "num_hidden_layers": 30, "num_attention_heads": 24,
                        "num_key_value_heads": 2, "max_position_embeddings": 4096,
                        "bos_token_id": 50256, "eos_token_id": 50256,
                        "tie_word_embeddings": True, "use_bias": True}


def starcoder2_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """StarCoder2's config.json with transformers' ``Starcoder2Config`` defaults where a key
    is left out, under the names config.py reads: ``norm_epsilon`` (default 1e-5) as the
    norms' eps, ``use_bias`` (every linear but the head) as ``attention_bias``."""
    out = with_defaults(cfg, _STARCODER2_DEFAULTS)
    out["rms_norm_eps"] = out.get("norm_epsilon", 1e-5)
    out["attention_bias"] = bool(out["use_bias"])
    return out


# transformers' OlmoeConfig defaults that differ from what config.py assumes.
_OLMOE_DEFAULTS = {"vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 2048,
                   "num_hidden_layers": 16, "num_attention_heads": 16,
                   "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                   "eos_token_id": 50279}


def olmoe_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """OLMoE's config.json with transformers' ``OlmoeConfig`` defaults where a key is left
    out (its experts' keys: ``config_moe.moe_fields``)."""
    return with_defaults(cfg, _OLMOE_DEFAULTS)


# transformers' HunYuanDenseV1Config defaults that differ from what config.py assumes.
_HUNYUAN_DEFAULTS = {"vocab_size": 290943, "hidden_size": 4096, "intermediate_size": 11008,
                     "num_hidden_layers": 32, "num_attention_heads": 32,
                     "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2}


def hunyuan_dense_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Hunyuan dense's config.json with transformers' ``HunYuanDenseV1Config`` defaults
    where a key is left out, its rope as transformers computes it: the checkpoints' type
    ``dynamic`` with a fixed ``alpha`` is NTK-alpha scaling (``HunYuanDenseV1RotaryEmbedding``),
    the default rope of base ``rope_theta * alpha ** (head_dim / (head_dim - 2))``, as
    llama.cpp's converter writes it; dynamic NTK without ``alpha`` (the base moving with the
    context) is refused."""
    arch = (cfg.get("architectures") or ["HunYuanDenseV1ForCausalLM"])[0]
    out = with_defaults(cfg, _HUNYUAN_DEFAULTS)
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    params = dict(params) if isinstance(params, dict) else {}
    kind = rope_kind(params)
    theta = cfg.get("rope_theta") or params.get("rope_theta") or 10000.0
    if kind == "dynamic" and params.get("alpha"):
        dim = out.get("head_dim") or out["hidden_size"] // out["num_attention_heads"]
        theta = float(theta) * float(params["alpha"]) ** (dim / (dim - 2))
    elif kind != "default":
        raise ModelLoadError(f"{arch} with rope type {kind!r} is not supported (its "
                             "checkpoints use dynamic with a fixed alpha)")
    out.pop("rope_scaling", None)
    out["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    out["rope_theta"] = theta
    return out


def hunyuan_moe_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Hunyuan MoE's config.json (``HunYuanMoEV1Config``: Hunyuan-A13B) as
    :func:`hunyuan_dense_config` reads the dense model's (its rope the same), and its
    experts: ``num_experts`` (1) of ``intermediate_size`` in every layer, ``moe_topk`` (1) a
    token by their softmax probabilities rescaled to sum to 1, beside a shared SwiGLU MLP of
    ``intermediate_size`` (``shared_mlp``, not gated); per-layer expert counts refused."""
    out = hunyuan_dense_config(cfg)
    experts, top_k = cfg.get("num_experts", 1), cfg.get("moe_topk", 1)
    for key, value in (("num_experts", experts), ("moe_topk", top_k)):
        if not isinstance(value, int) or value < 1:
            raise ModelLoadError(f"HunYuanMoEV1ForCausalLM {key} must be one positive integer "
                                 f"for every layer, not {value!r}")
    if top_k > experts:
        raise ModelLoadError(f"HunYuanMoEV1ForCausalLM moe_topk {top_k} exceeds num_experts "
                             f"{experts}")
    out.update(num_experts=experts, moe_topk=top_k)
    return out


def hunyuan_moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Hunyuan MoE's experts (:func:`hunyuan_moe_config`) as ``ModelConfig`` fields."""
    return {"num_experts": cfg["num_experts"], "num_experts_per_tok": cfg["moe_topk"],
            "norm_topk_prob": True, "moe_intermediate_size": cfg["intermediate_size"],
            "shared_expert_intermediate_size": cfg["intermediate_size"]}


def with_defaults(cfg: dict[str, Any], defaults: dict[str, Any], theta: float | None = None
                  ) -> dict[str, Any]:
    """``cfg`` with a config class's ``defaults`` where it leaves keys out, and its rope base
    ``theta`` (transformers' ``default_theta``) where neither ``rope_theta`` nor the rope
    parameters give one."""
    out = {**defaults, **cfg}
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if theta is not None and cfg.get("rope_theta") is None and not (
            isinstance(params, dict) and params.get("rope_theta") is not None):
        out["rope_theta"] = theta
    return out


# ExaoneConfig.attribute_map: the released config.json's key -> transformers' name.
_EXAONE_KEYS = {"num_layers": "num_hidden_layers", "layer_norm_epsilon": "rms_norm_eps",
                "activation_function": "hidden_act"}
# ExaoneConfig's defaults where config.json leaves a key out (and its ``default_theta``,
# 500,000), for the keys config.py reads with other defaults.
_EXAONE_DEFAULTS = {"vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 14336,
                    "num_hidden_layers": 32, "num_attention_heads": 32,
                    "num_key_value_heads": 8, "max_position_embeddings": 4096,
                    "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 361}


def exaone_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` (an ``ExaoneForCausalLM`` config.json) under transformers' key names, with
    ``ExaoneConfig``'s defaults where it leaves keys out (a transformers name wins over its
    alias where both are given)."""
    out = {_EXAONE_KEYS.get(key, key): value for key, value in cfg.items() if key in _EXAONE_KEYS}
    out.update({key: value for key, value in cfg.items() if key not in _EXAONE_KEYS})
    return with_defaults(out, _EXAONE_DEFAULTS, 500_000.0)
