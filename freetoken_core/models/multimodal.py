"""Vision-language checkpoints served for text: the language model inside Qwen2-VL,
Qwen2.5-VL, Qwen3-VL (and -MoE), Gemma 3 (4B and up), Mistral 3 (Mistral Small 3.1/3.2,
Ministral 3) and Llama 4 (Scout, Maverick) directories, as ``llama-server`` serves their GGUF
files without a projector file.

Their config.json nests the language model's keys under ``text_config`` (older Qwen2-VL ones
keep them at the top) and their safetensors hold it under ``model.language_model.`` or
``language_model.model.`` beside the vision tower and projector, which are not read. On text
the language model computes what it computes alone: Qwen's multimodal RoPE gives every
section the same position for a text token (``mrope_section`` then changes nothing), Gemma 3's
bidirectional attention covers image tokens only. (Gemma 3n's text tokens are embedded by the
language model alone: only the ids from its ``embed_vision`` / ``embed_audio`` vocabulary
offsets on, its image and audio tokens, are not.) Requests with image parts are refused by
the server (only text content parts)."""

from __future__ import annotations

from typing import Any

from freetoken_core.errors import ModelLoadError

# The wrapper class -> the ``text_config.model_type`` its config class gives by default.
WRAPPERS = {
    "Qwen2VLForConditionalGeneration": "qwen2_vl_text",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl_text",
    "Qwen3VLForConditionalGeneration": "qwen3_vl_text",
    "Qwen3VLMoeForConditionalGeneration": "qwen3_vl_moe_text",
    "Qwen3_5ForConditionalGeneration": "qwen3_5_text",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe_text",
    "Gemma3ForConditionalGeneration": "gemma3_text",
    "Gemma4ForConditionalGeneration": "gemma4_text",
    "Gemma3nForConditionalGeneration": "gemma3n_text",
    "Mistral3ForConditionalGeneration": "mistral",
    "Llama4ForConditionalGeneration": "llama4_text",
}
# ``text_config.model_type`` -> the causal-LM class FreeToken builds for it.
TEXT_MODELS = {
    "qwen2_vl_text": "Qwen2ForCausalLM",
    "qwen2_5_vl_text": "Qwen2ForCausalLM",
    "qwen3_vl_text": "Qwen3ForCausalLM",
    "qwen3_vl_moe_text": "Qwen3MoeForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma4_text": "Gemma4ForCausalLM",
    "gemma3n_text": "Gemma3nForCausalLM",
    "mistral": "MistralForCausalLM",
    "ministral3": "Ministral3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "llama4_text": "Llama4ForCausalLM",
}
# Keys of the wrapper's config that are the language model's (the wrapper's value wins).
_SHARED_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "quantization_config")
_WRAPPER_KEYS = frozenset({"architectures", "text_config", "vision_config",
                           "tie_word_embeddings", *_SHARED_KEYS})
_FORWARDS_TIE = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
# Weight-name prefixes: the language model's, renamed to a causal LM's; the rest not read.
_RENAMES = (("model.language_model.", "model."), ("language_model.model.", "model."),
            ("language_model.lm_head.", "lm_head."))
_SKIPPED = ("model.visual.", "visual.", "vision_tower.", "model.vision_tower.",
            "multi_modal_projector.", "model.multi_modal_projector.",
            "model.audio_tower.", "model.embed_vision.", "model.embed_audio.",  # (Gemma 4's, 3n's)
            "vision_model.")  # (Llama 4's)


def wrapper_of(cfg: dict[str, Any]) -> str | None:
    """The vision-language class config.json names, None for a causal LM."""
    return next((a for a in cfg.get("architectures") or [] if a in WRAPPERS), None)


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` itself for a causal LM; for a vision-language checkpoint, the config.json of its
    language model as a causal LM (an unknown ``text_config.model_type`` refused naming it)."""
    wrapper = wrapper_of(cfg)
    if wrapper is None:
        return cfg
    nested = cfg.get("text_config")
    if isinstance(nested, dict):
        text = dict(nested)
    else:  # (Qwen2-VL's first configs: the language model's keys at the top)
        text = {k: v for k, v in cfg.items() if k not in ("vision_config", "architectures")}
        text["model_type"] = WRAPPERS[wrapper]
    model_type = text.get("model_type") or WRAPPERS[wrapper]
    if model_type not in TEXT_MODELS:
        raise ModelLoadError(
            f"{wrapper} with text_config.model_type {model_type!r} is not supported; "
            f"FreeToken serves the language model of these when it is one of "
            f"{', '.join(sorted(TEXT_MODELS))}")
    text.update({key: cfg[key] for key in _SHARED_KEYS if key in cfg})
    if "tie_word_embeddings" in cfg:
        # transformers ties the head by the wrapper's key; Qwen2-VL's and Qwen2.5-VL's config
        # classes forward a true of text_config's (where configs saved before v5 kept it)
        text["tie_word_embeddings"] = bool(cfg["tie_word_embeddings"] or (
            wrapper in _FORWARDS_TIE and text.get("tie_word_embeddings")))
    for key in ("rope_scaling", "rope_parameters"):
        rope = text.get(key)
        if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "mrope":
            # (the first Qwen2-VL configs' name for default frequencies in sections)
            text[key] = {k: v for k, v in rope.items() if k != "type"} | {"rope_type": "default"}
    if model_type == "qwen3_vl_moe_text":
        # transformers' Qwen3-VL-MoE always renormalizes the top k; its default 60 experts
        text["norm_topk_prob"] = True
        text.setdefault("num_experts", text.get("num_local_experts", 60))
    text["architectures"] = [TEXT_MODELS[model_type]]
    return text


def with_overrides(cfg: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with ``overrides`` (``--hf-overrides``) applied: into a vision-language config's
    ``text_config``, but for the keys that are the wrapper's own (its classes, sub-configs and
    the keys whose top-level value wins)."""
    nested = cfg.get("text_config")
    if wrapper_of(cfg) is None or not isinstance(nested, dict):
        return {**cfg, **overrides}
    own = {k: v for k, v in overrides.items() if k in _WRAPPER_KEYS}
    text = {k: v for k, v in overrides.items() if k not in _WRAPPER_KEYS}
    return {**cfg, **own, "text_config": {**nested, **text}}


def released_experts(weights: dict[str, Any], hidden: int, size: int) -> None:
    """Qwen3-VL-MoE's fused experts as released, ``gate_up_proj`` ``[experts, hidden, 2 x
    size]`` and ``down_proj`` ``[experts, size, hidden]``, transposed in place to
    transformers 5's ``[experts, 2 x size, hidden]`` / ``[experts, hidden, size]`` (which
    moe.py reads), where a tensor is not already so (transformers' ``check_dims``)."""
    for name, (rows, cols) in (("gate_up_proj", (2 * size, hidden)), ("down_proj",
                                                                        (hidden, size))):
        for key in [k for k in weights if k.endswith("mlp.experts." + name)]:
            w = weights[key]
            if w.dim() == 3 and tuple(w.shape[1:]) == (cols, rows) != (rows, cols):
                weights[key] = w.transpose(1, 2).contiguous()


def text_weight_name(name: str) -> str | None:
    """A vision-language checkpoint's tensor ``name`` as the language model's (a causal LM's
    name), None for the vision tower's and projector's; other names unchanged."""
    for prefix, replacement in _RENAMES:
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    if name.startswith(_SKIPPED):
        return None
    return name
