"""A GGUF file's metadata as the Hugging Face config and generation config it describes
(used by ``freetoken_core.models.gguf``), read as llama.cpp reads each key (the file itself
is read by ``gguf_reader``)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.gguf_apertus import apertus_config
from freetoken_core.models.gguf_deepseek2 import deepseek2_config
from freetoken_core.models.gguf_ernie_hunyuan import ernie4_5_moe_config, hunyuan_moe_config
from freetoken_core.models.gguf_falcon_h1 import falcon_h1_config
from freetoken_core.models.gguf_families import (
    cohere_config,
    exaone4_config,
    gemma2_config,
    gemma3_config,
    glm4_config,
    gpt_oss_config,
    granite_config,
    mistral3_rope,
    moe_config,
    olmo_config,
    starcoder2_config,
    text_architecture,
    text_rope_sections,
)
from freetoken_core.models.gguf_gemma3n import gemma3n_config
from freetoken_core.models.gguf_gemma4 import gemma4_config
from freetoken_core.models.gguf_glm4moe import glm4moe_config
from freetoken_core.models.gguf_granite4 import granite4_config, kv_head_count
from freetoken_core.models.gguf_lfm2 import ARCHITECTURES as LFM2_ARCHITECTURES
from freetoken_core.models.gguf_lfm2 import lfm2_config
from freetoken_core.models.gguf_llama4 import llama4_config
from freetoken_core.models.gguf_nemotron_h import ARCHITECTURES as NEMOTRON_H
from freetoken_core.models.gguf_nemotron_h import nemotron_h_config
from freetoken_core.models.gguf_phi2 import phi2_config
from freetoken_core.models.gguf_qwen35 import QWEN35_ARCHS, QWEN35_MOE, qwen35_config
from freetoken_core.models.gguf_reader import field, require, token_count

ARCH = "llama"


# general.architecture -> the Hugging Face class FreeToken builds for it.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gemma4": "Gemma4ForCausalLM",
    "gemma3n": "Gemma3nForCausalLM",
    "qwen35": "Qwen3_5ForCausalLM",
    "qwen35moe": "Qwen3_5MoeForCausalLM", "qwen3next": "Qwen3NextForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "phi2": "PhiForCausalLM",  # (Phi-1, Phi-1.5, Phi-2: gguf_phi2.py)
    "smollm3": "SmolLM3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "granitehybrid": "GraniteMoeHybridForCausalLM",  # (Granite 4's hybrids: gguf_granite4)
    "falcon-h1": "FalconH1ForCausalLM",  # (gguf_falcon_h1)
    **dict.fromkeys(NEMOTRON_H, "NemotronHForCausalLM"),  # (and nemotron_h_moe: gguf_nemotron_h)
    "qwen3moe": "Qwen3MoeForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "glm4moe": "Glm4MoeForCausalLM",
    "minimax-m2": "MiniMaxM2ForCausalLM",
    "dots1": "Dots1ForCausalLM",
    "deepseek2": "DeepseekV3ForCausalLM",  # (or V2's: gguf_deepseek2, by the experts' scoring)
    "mistral3": "Ministral3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",  # (OLMo 3's files too: Olmo3ForCausalLM where they slide)
    "exaone4": "Exaone4ForCausalLM",
    "exaone": "ExaoneForCausalLM",
    "seed_oss": "SeedOssForCausalLM",
    "arcee": "ArceeForCausalLM",
    "starcoder2": "Starcoder2ForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "hunyuan-dense": "HunYuanDenseV1ForCausalLM",
    "hunyuan-moe": "HunYuanMoEV1ForCausalLM",  # (gguf_ernie_hunyuan)
    "ernie4_5": "Ernie4_5ForCausalLM",
    "ernie4_5-moe": "Ernie4_5_MoeForCausalLM",  # (gguf_ernie_hunyuan)
    "command-r": "CohereForCausalLM",
    "cohere2": "Cohere2ForCausalLM",
    "apertus": "ApertusForCausalLM",  # (xIELU's scalars in metadata: gguf_apertus)
    "llama4": "Llama4ForCausalLM",  # (gguf_llama4.py)
    **LFM2_ARCHITECTURES,  # (lfm2, lfm2moe: gguf_lfm2.py)
    # the language models of vision-language files (gguf_families.TEXT_ARCHITECTURES)
    "qwen2vl": "Qwen2ForCausalLM",
    "qwen3vl": "Qwen3ForCausalLM",
    "qwen3vlmoe": "Qwen3MoeForCausalLM",
}


def architecture(reader: Any) -> str:
    """The file's ``general.architecture``, checked against :data:`ARCHITECTURES`."""
    arch = field(reader, "general.architecture")
    if arch == "clip":  # (llama.cpp's mmproj files: a vision tower and projector)
        raise ModelLoadError(
            "this GGUF file is a multimodal projector (general.architecture 'clip', an "
            "mmproj file), not a language model; serve the model's main GGUF file (FreeToken "
            "serves vision-language models for text)")
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
    "exaone4": ("rope_freqs.weight",),
    "exaone": ("rope_freqs.weight",),
    "arcee": ("rope_freqs.weight",),
    "apertus": ("rope_freqs.weight",),
    "gemma4": ("rope_freqs.weight",),  # (its global layers' proportional rope)
    "llama4": ("rope_freqs.weight",),
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
    p = f"{arch}."  # (the file's keys; arch's tensors and computation: text_architecture)
    hidden = int(require(reader, p + "embedding_length"))
    heads = int(require(reader, p + "attention.head_count"))
    if arch == "deepseek2":  # (its key length is the latent cache's: gguf_deepseek2)
        names = {t.name for t in reader.tensors}
        return {**deepseek2_config(reader, hidden, heads,
                                   embedding_rows(reader) or token_count(reader), names),
                **special_token_ids(reader)}
    # (head_count_kv, feed_forward_length: a number a layer too)
    layered = arch in ("gemma4", "gemma3n") or arch in LFM2_ARCHITECTURES or arch in NEMOTRON_H
    kv_heads = heads if layered else kv_head_count(reader, arch, heads)  # (or one a layer)
    head_dim = int(field(reader, p + "attention.key_length", hidden // heads))
    rope_dim = (head_dim if arch in NEMOTRON_H  # (no positions: the converter's key is moot)
                else int(field(reader, p + "rope.dimension_count", head_dim)))
    # Partial rotary (Phi-4-mini: the first 3/4 of each head; GLM-4, GLM-4.5: half; Qwen3.5:
    # a quarter, checked in qwen35_config): llama.cpp's rotation of the first rope_dim
    # dimensions is transformers' partial_rotary_factor.
    partial = ("phi3", "glm4", "glm4moe", "minimax-m2", "phi2")
    if rope_dim != head_dim and arch not in QWEN35_ARCHS and not (
            arch in partial and 0 < rope_dim < head_dim and rope_dim % 2 == 0):
        raise ModelLoadError(
            f"GGUF {p}rope.dimension_count {rope_dim} != head_dim {head_dim} (partial rotary) "
            f"is supported for {', '.join(partial)} and the qwen35 families only; use a GGUF "
            "whose rotary embedding covers the whole head")
    if arch not in QWEN35_ARCHS:  # (its interleaved sections: qwen35_config)
        text_rope_sections(reader, arch, rope_dim)
    names = {t.name for t in reader.tensors}
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": text_architecture(arch),
        "hidden_size": hidden,
        "intermediate_size": 0 if layered else int((field if arch in QWEN35_MOE else require)(
            reader, p + "feed_forward_length") or 0),  # (qwen35moe's: none, qwen35_config)
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
        config.update(gemma3_config(reader, config))
    if arch == "gemma2":
        config.update(gemma2_config(reader, config))
    if arch == "gemma4":
        config.update(gemma4_config(reader, config, names))
    if arch == "gemma3n":
        config.update(gemma3n_config(reader, config))
    if arch in QWEN35_ARCHS:  # (qwen35, qwen35moe, qwen3next)
        config.update(qwen35_config(reader, config, rope_dim, arch))
    if arch in LFM2_ARCHITECTURES:
        config.update(lfm2_config(reader, arch, config, names))
    if arch == "granitehybrid":
        config.update(granite4_config(reader, config))
    if arch == "minimax-m2":  # (its config's rotary_dim; experts: moe_config)
        config["rotary_dim"] = rope_dim
    if arch == "falcon-h1":
        config.update(falcon_h1_config(reader, names))
    if arch in NEMOTRON_H:
        config.update(nemotron_h_config(reader, arch, config))
    if arch == "phi3" and rope_dim != head_dim:
        config["partial_rotary_factor"] = rope_dim / head_dim
    if arch == "phi2":  # (LayerNorms, biases, GELU, partial rotary)
        config.update(phi2_config(reader, head_dim, rope_dim))
    if arch == "glm4":
        config.update(glm4_config(reader, rope_dim / head_dim, names))
    if arch == "glm4moe":  # (gguf_glm4moe: its layers without the MTP ones; experts below)
        config.update(glm4moe_config(reader, rope_dim / head_dim))
    if arch == "olmo2":
        config.update(olmo_config(reader, config))
    if arch == "exaone4":
        config.update(exaone4_config(reader, config))
    if arch == "ernie4_5":  # (transformers' use_bias: biases where the file has them)
        config["use_bias"] = config["attention_bias"]
    if arch == "ernie4_5-moe":  # (experts, their layers, no biases: gguf_ernie_hunyuan)
        config.update(ernie4_5_moe_config(reader, config, names))
    if arch == "hunyuan-moe":
        config.update(hunyuan_moe_config(reader, config, names))
    if arch == "apertus":
        config.update(apertus_config(reader, config))
    if arch == "arcee":  # (llama.cpp's LLM_FFN_RELU_SQR on ffn_up alone)
        config["hidden_act"] = "relu2"
    if arch == "starcoder2":  # (LayerNorms, biases, a GELU MLP; no window unless the key)
        config.update(starcoder2_config(reader, config))
    if arch in ("command-r", "cohere2"):
        config.update(cohere_config(reader, arch, config, names))
    if arch == "smollm3":  # llama.cpp: every 4th layer without RoPE (n_no_rope_layer_step)
        config["no_rope_layer_interval"] = 4
    if arch in ("granite", "granitemoe"):
        config.update(granite_config(reader, arch, head_dim))
    if arch == "llama4":
        config.update(llama4_config(reader, config))
    config.update(moe_config(reader, arch, config))
    if arch == "gpt-oss":
        config.update(gpt_oss_config(reader, config))
    config.update(special_token_ids(reader))
    scaling = rope_factor_scaling(reader, arch, rope_dim, rope_scaling(reader, arch))
    if arch == "mistral3":
        scaling = mistral3_rope(reader, config, scaling)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


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

