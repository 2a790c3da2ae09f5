"""A GGUF file's metadata as the Hugging Face config and generation config it describes
(used by ``freetoken_core.models.gguf``), read as llama.cpp reads each key (the file itself
is read by ``gguf_reader``)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.gguf_reader import array_field, field, require, token_count

ARCH = "llama"


# general.architecture -> the Hugging Face class FreeToken builds for it.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "mistral3": "Ministral3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",  # (OLMo 3's files too: Olmo3ForCausalLM where they slide)
}
# A llama file with experts (llama.expert_count > 0) is Mixtral's.
MIXTRAL = "MixtralForCausalLM"


def architecture(reader: Any) -> str:
    """The file's ``general.architecture``, checked against :data:`ARCHITECTURES`."""
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported; FreeToken runs GGUF files of "
            f"{', '.join(sorted(ARCHITECTURES))}")
    return str(arch)


def rope_scaling(reader: Any, arch: str = ARCH) -> dict[str, Any] | None:
    """Map ``{arch}.rope.scaling.*`` (or the older ``rope.scale_linear``) to ``rope_scaling``."""
    kind = field(reader, f"{arch}.rope.scaling.type")
    factor = field(reader, f"{arch}.rope.scaling.factor")
    if kind is None and field(reader, f"{arch}.rope.scale_linear") is not None:
        kind, factor = "linear", field(reader, f"{arch}.rope.scale_linear")
    if kind in (None, "none") or factor is None or float(factor) == 1.0:
        return None
    scaling: dict[str, Any] = {"rope_type": str(kind), "factor": float(factor)}
    original = field(reader, f"{arch}.rope.scaling.original_context_length")
    if kind == "yarn" and original is None:  # llama.cpp's n_ctx_orig_yarn: the trained length
        original = field(reader, f"{arch}.context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    attn_factor = field(reader, f"{arch}.rope.scaling.attn_factor")
    if kind == "yarn" and attn_factor is not None:
        # llama.cpp: YaRN's 0.1 ln(factor) + 1, times the file's attention factor
        scaling["attention_factor"] = float(attn_factor) * (
            0.1 * math.log(float(factor)) + 1.0 if float(factor) > 1 else 1.0)
    for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        value = field(reader, f"{arch}.rope.scaling.{key}")
        if kind == "yarn" and value is not None:
            scaling[name] = float(value)
    return scaling


# The 1-d float32 tensors that hold rotary frequency factors (llama.cpp's LLM_TENSOR_ROPE_FREQS
# and LLM_TENSOR_ROPE_FACTORS_LONG / _SHORT), by architecture: read into the config's
# ``rope_scaling`` (:func:`rope_factor_scaling`), not into the weights.
ROPE_FACTOR_TENSORS = {
    "llama": ("rope_freqs.weight",),
    "smollm3": ("rope_freqs.weight",),
    "phi3": ("rope_factors_long.weight", "rope_factors_short.weight"),
}


def factor_tensor(reader: Any, name: str, count: int) -> list[float] | None:
    """The ``count`` values of the 1-d F32 tensor ``name``, or ``None`` if the file has no
    such tensor. Any other type or length is an error naming the tensor (llama.cpp's rope
    takes its frequency factors as float32 only)."""
    tensor = next((t for t in reader.tensors if t.name == name), None)
    if tensor is None:
        return None
    from gguf import GGMLQuantizationType

    dims = [int(d) for d in tensor.shape.tolist()]
    if int(tensor.tensor_type) != 0 or dims != [count]:
        try:
            type_name = GGMLQuantizationType(int(tensor.tensor_type)).name
        except ValueError:
            type_name = f"ggml type {int(tensor.tensor_type)}"
        raise ModelLoadError(
            f"GGUF tensor {name!r} holds rotary frequency factors: it must be F32 of shape "
            f"[{count}] (half the rotary dimensions), not {type_name} of shape {dims[::-1]}; "
            "re-export the model with llama.cpp")
    if tensor.data is None or np.asarray(tensor.data).nbytes != 4 * count:
        raise ModelLoadError(f"GGUF tensor {name!r} (F32, shape [{count}]) is cut short: the "
                             "file is truncated or corrupt - re-download it")
    values = np.asarray(tensor.data).view(np.float32).reshape(-1)
    if not np.all(np.isfinite(values)) or np.any(values <= 0):
        raise ModelLoadError(f"GGUF tensor {name!r} holds rotary frequency factors, which must "
                             "be finite and positive; re-export the model")
    return [float(v) for v in values]


def rope_factor_scaling(reader: Any, arch: str, rotary_dim: int,
                        scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """``rope_scaling`` with the file's rotary frequency factors, as llama.cpp applies them
    (``ggml_rope_ext``'s ``freq_factors``: pair ``i`` turns at ``base^(-2i/d) / factor[i]``).

    * llama's (and smollm3's) ``rope_freqs.weight`` (llama 3.1 and later: the converter's
      llama3 scaling, computed once): type ``factors`` with those ``factors`` (and a linear
      ``factor`` where the metadata also has one);
    * phi3's ``rope_factors_long`` / ``_short`` (LongRoPE: Phi-3 128k, Phi-3.5, Phi-4-mini):
      transformers' ``longrope`` with ``long_factor`` / ``short_factor``, the
      ``rope.scaling.attn_factor`` (llama.cpp's default 1 where it is missing) and
      ``rope.scaling.original_context_length`` (llama.cpp's ``n_ctx_orig_yarn``: the long
      factors apply where the context limit exceeds it).
    ``scaling`` (the metadata's, :func:`rope_scaling`) is returned where there are none."""
    names = ROPE_FACTOR_TENSORS.get(arch, ())
    values = [factor_tensor(reader, name, rotary_dim // 2) for name in names]
    if all(v is None for v in values):
        return scaling
    if len(names) == 1:  # one set for every position
        out: dict[str, Any] = {"rope_type": "factors", "factors": values[0]}
        if scaling is not None:
            if scaling["rope_type"] != "linear":
                raise ModelLoadError(
                    f"GGUF with rope_freqs.weight and rope scaling {scaling['rope_type']!r}: "
                    "FreeToken combines the frequency factors with linear scaling only")
            out["factor"] = scaling["factor"]
        return out
    if any(v is None for v in values):
        missing = names[values.index(None)]
        raise ModelLoadError(f"GGUF has {names[1 - values.index(None)]!r} but not {missing!r}; "
                             "LongRoPE needs both - re-export the model with llama.cpp")
    original = field(reader, f"{arch}.rope.scaling.original_context_length")
    if original is None:
        raise ModelLoadError(f"GGUF with LongRoPE factors lacks "
                             f"'{arch}.rope.scaling.original_context_length'; re-export the "
                             "model with llama.cpp")
    return {"rope_type": "longrope", "long_factor": values[0], "short_factor": values[1],
            "attention_factor": float(field(reader, f"{arch}.rope.scaling.attn_factor", 1.0)),
            "original_max_position_embeddings": int(original)}


def build_config(reader: Any) -> dict[str, Any]:
    """The ``config.json`` dict of the Hugging Face model the GGUF metadata describes."""
    arch = architecture(reader)
    p = f"{arch}."
    hidden = int(require(reader, p + "embedding_length"))
    heads = int(require(reader, p + "attention.head_count"))
    kv_heads = int(field(reader, p + "attention.head_count_kv", heads))
    head_dim = int(field(reader, p + "attention.key_length", hidden // heads))
    rope_dim = int(field(reader, p + "rope.dimension_count", head_dim))
    # Partial rotary (Phi-4-mini: the first 3/4 of each head; GLM-4: half): llama.cpp's
    # rotation of the first rope_dim dimensions is transformers' partial_rotary_factor.
    if rope_dim != head_dim and not (arch in ("phi3", "glm4") and 0 < rope_dim < head_dim
                                     and rope_dim % 2 == 0):
        raise ModelLoadError(
            f"GGUF {p}rope.dimension_count {rope_dim} != head_dim {head_dim} (partial rotary) "
            "is supported for phi3 and glm4 only; use a GGUF whose rotary embedding covers "
            "the whole head")
    names = {t.name for t in reader.tensors}
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(require(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(require(reader, p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(field(reader, p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(field(reader, p + "context_length", 2048)),
        "vocab_size": embedding_rows(reader) or token_count(reader),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    if arch == "gemma3":
        config.update(_gemma3_config(reader, config))
    if arch == "gemma2":
        config.update(_gemma2_config(reader, config))
    if arch == "phi3" and rope_dim != head_dim:
        config["partial_rotary_factor"] = rope_dim / head_dim
    if arch == "glm4":
        config.update(_glm4_config(reader, rope_dim / head_dim, names))
    if arch == "olmo2":
        config.update(_olmo_config(reader, config))
    if arch == "smollm3":  # llama.cpp: every 4th layer without RoPE (n_no_rope_layer_step)
        config["no_rope_layer_interval"] = 4
    if arch == "granite":
        config.update(_granite_config(reader, head_dim))
    config.update(_moe_config(reader, arch, config))
    if arch == "gpt-oss":
        config.update(_gpt_oss_config(reader, config))
    config.update(special_token_ids(reader))
    scaling = rope_factor_scaling(reader, arch, rope_dim, rope_scaling(reader, arch))
    if arch == "mistral3":
        scaling = _mistral3_rope(reader, config, scaling)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _gemma3_config(reader: Any, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's keys beyond the common ones, as llama.cpp reads them (src/llama-model.cpp):
    every 6th layer global, the others sliding; local rope base 10,000; the query scaled by
    1/sqrt(head_dim), except the 62-layer 27B (1/sqrt(hidden / heads))."""
    layers = config["num_hidden_layers"]
    window = field(reader, "gemma3.attention.sliding_window")
    scalar = config["head_dim"]
    if layers == 62:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    return {
        "model_type": "gemma3_text",
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": float(field(reader, "gemma3.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(field(reader, "gemma3.rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": scalar,
        "sliding_window": int(window) if window is not None else None,
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                        for i in range(layers)],
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }


def _mistral3_rope(reader: Any, config: dict[str, Any], scaling: dict[str, Any] | None
                   ) -> dict[str, Any] | None:
    """Ministral 3's rope parameters as llama.cpp reads a ``mistral3`` file
    (``LLM_ARCH_MISTRAL3``): YaRN with cos and sin left unscaled (its graph's attention factor
    cancels YaRN's, as transformers' ``mscale`` = ``mscale_all_dim`` = 1 does), and the
    attention temperature ``attention.temperature_scale`` (transformers'
    ``llama_4_scaling_beta``) in steps of the original context length. Its
    mixture-of-experts files are refused."""
    if int(field(reader, "mistral3.expert_count", 0)):
        raise ModelLoadError("GGUF mistral3 with experts (mistral3.expert_count) is not "
                             "supported; FreeToken runs the dense Ministral 3 / Devstral files")
    if scaling is not None and scaling["rope_type"] == "yarn":
        scaling = {**scaling, "attention_factor": 1.0}
    beta = float(field(reader, "mistral3.attention.temperature_scale", 0.0))
    if not beta:
        return scaling
    length = int(field(reader, "mistral3.rope.scaling.original_context_length", 0)) or (
        (scaling or {}).get("original_max_position_embeddings")
        or config["max_position_embeddings"])
    return {**(scaling or {"rope_type": "default"}), "llama_4_scaling_beta": beta,
            "original_max_position_embeddings": int(length)}


def _olmo_config(reader: Any, config: dict[str, Any]) -> dict[str, Any]:
    """An ``olmo2`` file as llama.cpp reads it: OLMo 2, or OLMo 3 where it has
    ``attention.sliding_window`` (its converter writes both as ``olmo2``): then
    ``attention.sliding_window_pattern`` says which layers slide (a flag a layer, or a period
    n: every n-th layer global; default 4), and the sliding layers' rope is unscaled, of
    base ``rope.freq_base_swa`` (default the global layers')."""
    window = field(reader, "olmo2.attention.sliding_window")
    if not window:
        return {"model_type": "olmo2"}
    layers = config["num_hidden_layers"]
    key = "olmo2.attention.sliding_window_pattern"
    flags = array_field(reader, key)
    if flags is not None:
        if len(flags) != layers:
            raise ModelLoadError(f"GGUF {key} has {len(flags)} flags for {layers} layers")
        sliding = [bool(flag) for flag in flags]
    else:
        period = int(field(reader, key, 4))
        sliding = [period == 0 or i % period < period - 1 for i in range(layers)]
    base = config["rope_theta"]
    return {"architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3",
            "sliding_window": int(window),
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
            "rope_parameters": {"sliding_attention": {
                "rope_type": "default",
                "rope_theta": float(field(reader, "olmo2.rope.freq_base_swa", base))}}}


def _glm4_config(reader: Any, factor: float, names: set[str]) -> dict[str, Any]:
    """GLM-4's keys as llama.cpp reads them: the rotated fraction of each head (written
    always: transformers' default is 0.5), biases on q/k/v. Refused: M-RoPE files (the
    vision models' converter writes ``rope.dimension_sections`` and NEOX-permuted q/k) and
    NextN prediction layers (GLM-OCR), which the text model here does not run."""
    if field(reader, "glm4.rope.dimension_sections") is not None:
        raise ModelLoadError("GGUF glm4 with glm4.rope.dimension_sections (M-RoPE, the "
                             "GLM-4V vision models) is not supported; FreeToken runs the "
                             "text-only GLM-4 files (GLM-4-0414, GLM-Z1)")
    if int(field(reader, "glm4.nextn_predict_layers", 0)):
        raise ModelLoadError("GGUF glm4 with glm4.nextn_predict_layers (NextN prediction "
                             "layers) is not supported")
    return {"partial_rotary_factor": factor,
            "attention_bias": "blk.0.attn_q.bias" in names}


def _gemma2_config(reader: Any, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's keys as llama.cpp reads them (src/llama-model.cpp ``LLM_ARCH_GEMMA2``):
    every other layer sliding, the first included (its SWA pattern of 2), over
    ``attention.sliding_window`` keys (default 4096); the scores softcapped at
    ``attn_logit_softcapping`` (default 50) and the logits at ``final_logit_softcapping``
    (default 30); the query scaled by 1/sqrt(head_dim) (``attention.key_length``), except
    the 46-layer 27B's 1/sqrt(hidden / heads), transformers' ``query_pre_attn_scalar``."""
    layers = config["num_hidden_layers"]
    scalar = config["head_dim"]
    if layers == 46:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    return {
        "model_type": "gemma2",
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": float(field(reader, "gemma2.attention.layer_norm_rms_epsilon", 1e-6)),
        "query_pre_attn_scalar": scalar,
        "sliding_window": int(field(reader, "gemma2.attention.sliding_window", 4096)),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                        for i in range(layers)],
        "attn_logit_softcapping": float(field(reader, "gemma2.attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": float(field(reader, "gemma2.final_logit_softcapping",
                                               30.0)),
    }


def _granite_config(reader: Any, head_dim: int) -> dict[str, Any]:
    """Granite's multipliers as llama.cpp reads them (src/models/granite.cpp): a missing or
    zero key is none (the attention scale then Llama's ``head_dim ** -0.5``)."""
    if field(reader, "granite.rope.scaling.finetuned", True) is False:
        raise ModelLoadError("GGUF granite without rotary embedding "
                             "(granite.rope.scaling.finetuned false) is not supported")

    def scale(key: str, default: float) -> float:
        value = float(field(reader, f"granite.{key}", 0.0))
        return value if value != 0.0 else default

    return {"embedding_multiplier": scale("embedding_scale", 1.0),
            "residual_multiplier": scale("residual_scale", 1.0),
            "attention_multiplier": scale("attention.scale", head_dim ** -0.5),
            "logits_scaling": scale("logit_scale", 1.0)}


def _moe_config(reader: Any, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """The experts of a mixture-of-experts file, as llama.cpp reads them: ``qwen3moe``
    (``expert_feed_forward_length`` each, else the dense length over the experts used),
    ``qwen2moe`` (the same, and a shared expert of ``expert_shared_feed_forward_length``) and
    ``llama`` with ``expert_count`` > 0 (Mixtral; experts of ``feed_forward_length``), every
    layer sparse, softmax routing with the top k renormalized (llama.cpp passes ``norm_w =
    true`` for qwen3moe and llama, false for qwen2moe), times ``expert_weights_scale`` where
    the file has one. Empty for a dense file. Shared experts of other families and gating
    other than softmax are refused."""
    p = f"{arch}."
    experts = int(field(reader, p + "expert_count", 0))
    if arch not in ("llama", "qwen3moe", "qwen2moe") or (arch == "llama" and experts == 0):
        return {}
    used = _experts_used(reader, arch, experts)
    shared = int(field(reader, p + "expert_shared_feed_forward_length", 0))
    if arch != "qwen2moe" and (int(field(reader, p + "expert_shared_count", 0)) or shared):
        raise ModelLoadError(f"GGUF {arch} with shared experts is not supported")
    gating = int(field(reader, p + "expert_gating_func", 1))
    if gating != 1:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise ModelLoadError(f"GGUF {p}expert_gating_func {gating} is not supported "
                             "(FreeToken routes with softmax, 1)")
    scale = float(field(reader, p + "expert_weights_scale", 0.0))
    out: dict[str, Any] = {"num_experts_per_tok": used, "norm_topk_prob": arch != "qwen2moe",
                           "routed_scaling_factor": scale if scale else 1.0}
    if arch == "llama":
        return {**out, "architectures": [MIXTRAL], "model_type": "mixtral",
                "num_local_experts": experts}
    size = int(field(reader, p + "expert_feed_forward_length", 0)) or (
        config["intermediate_size"] // used)
    if arch == "qwen2moe":
        # (llama.cpp: the dense length where the file has no shared length)
        out.update(model_type="qwen2_moe",
                   shared_expert_intermediate_size=shared or config["intermediate_size"],
                   qkv_bias=config["attention_bias"])
    else:
        out["model_type"] = "qwen3_moe"
    return {**out, "num_experts": experts, "moe_intermediate_size": size,
            "decoder_sparse_step": 1, "mlp_only_layers": []}


def _experts_used(reader: Any, arch: str, experts: int) -> int:
    """``{arch}.expert_used_count``, checked against the file's ``experts``."""
    used = int(field(reader, f"{arch}.expert_used_count", 0))
    if experts < 1 or not 1 <= used <= experts:
        raise ModelLoadError(f"GGUF {arch}.expert_count {experts} / expert_used_count {used}: "
                             "a mixture of experts needs 1 <= used <= count")
    return used


def _gpt_oss_config(reader: Any, config: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's keys as llama.cpp reads them (``LLM_ARCH_OPENAI_MOE``): experts of
    ``expert_feed_forward_length``, the even layers sliding-window ones (its SWA pattern
    of 2) of ``attention.sliding_window`` keys, biases on the attention's projections
    (transformers' ``attention_bias``), the clamped SwiGLU's limit 7 and slope 1.702
    (llama.cpp's ``LLM_FFN_SWIGLU_OAI_MOE`` constants)."""
    experts = int(field(reader, "gpt-oss.expert_count", 0))
    used = _experts_used(reader, "gpt-oss", experts)
    window = field(reader, "gpt-oss.attention.sliding_window")
    if window is None:
        raise ModelLoadError("GGUF gpt-oss lacks 'gpt-oss.attention.sliding_window'; "
                             "re-export the model with llama.cpp")
    layers = config["num_hidden_layers"]
    return {"model_type": "gpt_oss", "num_local_experts": experts,
            "num_experts_per_tok": used,
            "intermediate_size": int(field(reader, "gpt-oss.expert_feed_forward_length",
                                           config["intermediate_size"])),
            "sliding_window": int(window),
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                            for i in range(layers)],
            "attention_bias": True, "swiglu_limit": 7.0, "swiglu_alpha": 1.702}


def embedding_rows(reader: Any) -> int:
    """Rows of ``token_embd.weight`` (= the model's vocab size), 0 if the tensor is missing.

    This equals the number of tokens for ordinary files; when a vocabulary is padded, the
    weights (not the token list) decide the size ``LlamaForCausalLM`` must be built with.
    """
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[-1])
    return 0


def special_token_ids(reader: Any) -> dict[str, int]:
    """``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` present in the GGUF metadata."""
    ids: dict[str, int] = {}
    for hf_key, gguf_key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ):
        value = field(reader, gguf_key)
        if value is not None:
            ids[hf_key] = int(value)
    return ids


def generation_config(config: dict[str, Any]) -> dict[str, Any]:
    """The ``generation_config.json`` dict: the special token ids of ``config``."""
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {key: config[key] for key in keys if key in config}

