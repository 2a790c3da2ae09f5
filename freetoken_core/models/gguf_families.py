"""Each architecture family's GGUF keys beyond the common ones, read as llama.cpp reads them,
as the Hugging Face config keys they stand for (``gguf_metadata.build_config`` calls them);
a value FreeToken cannot run is refused naming its key."""

from __future__ import annotations

from typing import Any

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.gguf_glm4moe import glm4moe_experts
from freetoken_core.models.gguf_reader import array_field, field, require

# A llama file with experts (llama.expert_count > 0) is Mixtral's.
MIXTRAL = "MixtralForCausalLM"
# The language models of vision-language files (their vision tower is llama.cpp's separate
# mmproj file): the architecture whose tensors and computation each is, on text. Their
# multimodal RoPE (rope.dimension_sections) gives a text token one position in every
# section: plain RoPE over the sections (text_rope_sections).
TEXT_ARCHITECTURES = {"qwen2vl": "qwen2", "qwen3vl": "qwen3", "qwen3vlmoe": "qwen3moe"}


def text_architecture(arch: str) -> str:
    """The architecture whose tensors and computation ``arch``'s are (itself but for
    :data:`TEXT_ARCHITECTURES`)."""
    return TEXT_ARCHITECTURES.get(arch, arch)


def text_rope_sections(reader: Any, arch: str, rope_dim: int) -> None:
    """Check a vision-language file's ``rope.dimension_sections`` cover the rotated
    dimensions: llama.cpp gives pairs past them the fourth section's position (0 for text),
    which FreeToken does not compute."""
    sections = array_field(reader, f"{arch}.rope.dimension_sections")
    if sections is None:
        return
    covered = 2 * sum(int(s) for s in list(sections)[:3])
    if covered != rope_dim:
        raise ModelLoadError(
            f"GGUF {arch}.rope.dimension_sections {list(map(int, sections))} cover {covered} "
            f"of the {rope_dim} rotated dimensions; FreeToken serves vision-language files "
            "whose first three sections cover them all")


def gemma3_config(reader: Any, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's keys beyond the common ones, as llama.cpp reads them (src/llama-model.cpp):
    every 6th layer global, the others sliding; local rope base 10,000; the query scaled by
    1/sqrt(head_dim), except the 62-layer 27B (1/sqrt(hidden / heads))."""
    layers = config["num_hidden_layers"]
    window = field(reader, "gemma3.attention.sliding_window")
    return {
        **_gemma_keys(reader, "gemma3", config, 62),
        "model_type": "gemma3_text",
        "rope_theta": float(field(reader, "gemma3.rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": 10_000.0,
        "sliding_window": int(window) if window is not None else None,
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                        for i in range(layers)],
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }


def mistral3_rope(reader: Any, config: dict[str, Any], scaling: dict[str, Any] | None
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


def olmo_config(reader: Any, config: dict[str, Any]) -> dict[str, Any]:
    """An ``olmo2`` file as llama.cpp reads it: OLMo 2, or OLMo 3 where it has
    ``attention.sliding_window`` (its converter writes both as ``olmo2``): then
    ``attention.sliding_window_pattern`` says which layers slide (a flag a layer, or a period
    n: every n-th layer global; default 4), and the sliding layers' rope is unscaled, of
    base ``rope.freq_base_swa`` (default the global layers')."""
    window = field(reader, "olmo2.attention.sliding_window")
    if not window:
        return {"model_type": "olmo2"}
    base = config["rope_theta"]
    return {"architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3",
            "sliding_window": int(window),
            "layer_types": _layer_types(reader, "olmo2", config["num_hidden_layers"]),
            "rope_parameters": {"sliding_attention": {
                "rope_type": "default",
                "rope_theta": float(field(reader, "olmo2.rope.freq_base_swa", base))}}}


def exaone4_config(reader: Any, config: dict[str, Any]) -> dict[str, Any]:
    """An ``exaone4`` file as llama.cpp reads it (src/models/exaone4.cpp): sliding-window
    layers where the file has ``attention.sliding_window`` or 64 layers (the 32B; llama.cpp
    applies the window to 64-layer files only, and the converter writes the key only for
    checkpoints that have one, as the 32B), with ``attention.sliding_window_pattern`` as
    OLMo 3's (default: every 4th layer global) and a window of 4,096 where the key is
    missing; then only the sliding layers rotate, with base ``rope.freq_base_swa`` (default
    the file's base). Without: every layer global and rotated."""
    layers = config["num_hidden_layers"]
    window = field(reader, "exaone4.attention.sliding_window")
    if not window and layers != 64:
        return {"sliding_window": None}
    return {"sliding_window": int(window or 4096),
            "layer_types": _layer_types(reader, "exaone4", layers),
            "rope_theta": float(field(reader, "exaone4.rope.freq_base_swa",
                                      config["rope_theta"]))}


def cohere_config(reader: Any, arch: str, config: dict[str, Any], names: set[str]
                  ) -> dict[str, Any]:
    """A ``command-r`` or ``cohere2`` file as llama.cpp reads it (src/models/command-r.cpp,
    cohere2.cpp): the LayerNorms' eps ``attention.layer_norm_epsilon`` (required), the
    logits times ``logit_scale`` (cohere2: required; command-r: none where it is missing or
    0), and Command R+'s per-head q/k norms where the file has them (llama.cpp reads them in, and
    requires them of, 64-layer files only). cohere2: the sliding layers over
    ``attention.sliding_window`` keys (required) as ``attention.sliding_window_pattern``
    says (the converter writes none: every 4th layer global), rotated with the file's
    ``rope.freq_base`` (its graph ignores ``rope.freq_base_swa``); the global layers not
    rotated."""
    p = f"{arch}."
    scale = float(require(reader, p + "logit_scale") if arch == "cohere2"
                  else field(reader, p + "logit_scale", 0.0))
    out: dict[str, Any] = {
        "model_type": "cohere" if arch == "command-r" else "cohere2",
        "layer_norm_eps": float(require(reader, p + "attention.layer_norm_epsilon")),
        "logit_scale": scale or 1.0,
    }
    if arch == "command-r":
        out["use_qk_norm"] = "blk.0.attn_q_norm.weight" in names
    else:
        out.update(sliding_window=int(require(reader, p + "attention.sliding_window")),
                   layer_types=_layer_types(reader, arch, config["num_hidden_layers"]))
    return out


def starcoder2_config(reader: Any, config: dict[str, Any]) -> dict[str, Any]:
    """A ``starcoder2`` file as llama.cpp reads it (src/models/starcoder2.cpp): LayerNorms of
    eps ``attention.layer_norm_epsilon``, biases where the file has them, GELU-tanh, and no
    sliding window (its converter writes none and its graph has none) unless the file has
    ``attention.sliding_window``."""
    return {"norm_epsilon": float(require(reader, "starcoder2.attention.layer_norm_epsilon")),
            "use_bias": config["attention_bias"], "hidden_act": "gelu_pytorch_tanh",
            "sliding_window": field(reader, "starcoder2.attention.sliding_window")}


def _layer_types(reader: Any, arch: str, layers: int) -> list[str]:
    """Each layer's type from ``{arch}.attention.sliding_window_pattern`` as llama.cpp's
    ``load_swa_pattern`` reads it: a flag a layer (true: sliding), or a period n (layer i
    slides where i % n < n - 1; 0: all slide), default 4."""
    key = f"{arch}.attention.sliding_window_pattern"
    flags = array_field(reader, key)
    if flags is not None:
        if len(flags) != layers:
            raise ModelLoadError(f"GGUF {key} has {len(flags)} flags for {layers} layers")
        sliding = [bool(flag) for flag in flags]
    else:
        period = int(field(reader, key, 4))
        sliding = [period == 0 or i % period < period - 1 for i in range(layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def glm4_config(reader: Any, factor: float, names: set[str]) -> dict[str, Any]:
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


def gemma2_config(reader: Any, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's keys as llama.cpp reads them (src/llama-model.cpp ``LLM_ARCH_GEMMA2``):
    every other layer sliding, the first included (its SWA pattern of 2), over
    ``attention.sliding_window`` keys (default 4096); the scores softcapped at
    ``attn_logit_softcapping`` (default 50) and the logits at ``final_logit_softcapping``
    (default 30); the query scaled by 1/sqrt(head_dim) (``attention.key_length``), except
    the 46-layer 27B's 1/sqrt(hidden / heads), transformers' ``query_pre_attn_scalar``."""
    layers = config["num_hidden_layers"]
    return {
        **_gemma_keys(reader, "gemma2", config, 46),
        "model_type": "gemma2",
        "sliding_window": int(field(reader, "gemma2.attention.sliding_window", 4096)),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                        for i in range(layers)],
        "attn_logit_softcapping": float(field(reader, "gemma2.attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": float(field(reader, "gemma2.final_logit_softcapping",
                                               30.0)),
    }


def _gemma_keys(reader: Any, arch: str, config: dict[str, Any], wide_layers: int
                ) -> dict[str, Any]:
    """Gemma 2's and 3's common keys: GELU-tanh, the norms' epsilon, and the query scaled by
    1/sqrt(head_dim), except the 27B's (``wide_layers`` layers: 46 or 62) 1/sqrt(hidden /
    heads), transformers' ``query_pre_attn_scalar``."""
    scalar = config["head_dim"]
    if config["num_hidden_layers"] == wide_layers:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "query_pre_attn_scalar": scalar,
    }


def granite_config(reader: Any, arch: str, head_dim: int) -> dict[str, Any]:
    """Granite's (and Granite MoE's) multipliers as llama.cpp reads them
    (src/models/granite.cpp): a missing or zero key is none (the attention scale then
    Llama's ``head_dim ** -0.5``)."""
    if field(reader, f"{arch}.rope.scaling.finetuned", True) is False:
        raise ModelLoadError(f"GGUF {arch} without rotary embedding "
                             f"({arch}.rope.scaling.finetuned false) is not supported")

    def scale(key: str, default: float) -> float:
        value = float(field(reader, f"{arch}.{key}", 0.0))
        return value if value != 0.0 else default

    return {"embedding_multiplier": scale("embedding_scale", 1.0),
            "residual_multiplier": scale("residual_scale", 1.0),
            "attention_multiplier": scale("attention.scale", head_dim ** -0.5),
            "logits_scaling": scale("logit_scale", 1.0)}


def moe_config(reader: Any, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """The experts of a mixture-of-experts file, as llama.cpp reads them: ``qwen3moe``
    (``expert_feed_forward_length`` each, else the dense length over the experts used),
    ``qwen2moe`` (the same, and a shared expert of ``expert_shared_feed_forward_length``),
    ``llama`` with ``expert_count`` > 0 (Mixtral; experts of ``feed_forward_length``) and
    ``olmoe`` and ``granitemoe`` (experts of ``feed_forward_length``), every layer sparse,
    softmax routing with the top k renormalized (llama.cpp passes ``norm_w = true`` for
    qwen3moe, llama and granitemoe, false for qwen2moe and olmoe), times
    ``expert_weights_scale`` where
    the file has one; ``glm4moe`` (sigmoid gating, ungated shared experts, groups:
    ``gguf_glm4moe.glm4moe_experts``); ``minimax-m2`` (sigmoid gating with the selection
    bias ``exp_probs_b.bias``, rescaled, experts of ``expert_feed_forward_length``);
    ``dots1`` (glm4moe's keys and routing). Empty for a dense file. Shared experts of other
    families and gating other than each family's (softmax; glm4moe's sigmoid) are refused."""
    p = f"{arch}."
    experts = int(field(reader, p + "expert_count", 0))
    kind = text_architecture(arch)
    if kind not in ("llama", "qwen3moe", "qwen2moe", "olmoe", "granitemoe", "glm4moe",
                    "minimax-m2", "dots1") or (
            kind == "llama" and experts == 0):
        return {}
    used = _experts_used(reader, arch, experts)
    shared = int(field(reader, p + "expert_shared_feed_forward_length", 0))
    if kind not in ("qwen2moe", "glm4moe", "dots1") and (
            int(field(reader, p + "expert_shared_count", 0)) or shared):
        raise ModelLoadError(f"GGUF {arch} with shared experts is not supported")
    # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX (1); glm4moe's SIGMOID (2, or 0)
    sigmoid = kind in ("glm4moe", "minimax-m2", "dots1")
    gating = int(field(reader, p + "expert_gating_func", 0 if sigmoid else 1))
    if gating not in ((2, 0) if sigmoid else (1,)):
        raise ModelLoadError(f"GGUF {p}expert_gating_func {gating} is not supported "
                             f"(FreeToken routes {arch} with "
                             f"{'sigmoid, 2' if sigmoid else 'softmax, 1'})")
    scale = float(field(reader, p + "expert_weights_scale", 0.0))
    out: dict[str, Any] = {"num_experts_per_tok": used,
                           "norm_topk_prob": kind not in ("qwen2moe", "olmoe"),
                           "routed_scaling_factor": scale if scale else 1.0}
    if kind == "minimax-m2":  # (experts of expert_feed_forward_length in every layer)
        size = int(field(reader, p + "expert_feed_forward_length", 0))
        return {**out, "num_local_experts": experts,
                "intermediate_size": size or config["intermediate_size"]}
    if sigmoid:  # (glm4moe's keys; dots1's the same under its prefix)
        return {**out, **glm4moe_experts(reader, config, experts, used, p)}
    if kind == "llama":
        return {**out, "architectures": [MIXTRAL], "model_type": "mixtral",
                "num_local_experts": experts}
    if kind == "olmoe":  # (experts of feed_forward_length, as llama.cpp's olmoe.cpp)
        return {**out, "num_experts": experts}
    if kind == "granitemoe":  # (the same; the softmax of the top k: renormalized, norm_w)
        return {**out, "num_local_experts": experts}
    size = int(field(reader, p + "expert_feed_forward_length", 0)) or (
        config["intermediate_size"] // used)
    if kind == "qwen2moe":
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


def gpt_oss_config(reader: Any, config: dict[str, Any]) -> dict[str, Any]:
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
