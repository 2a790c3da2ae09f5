"""GGUF tensor names as the Hugging Face names FreeToken's models read, per architecture
family (``gguf_weights.read_gguf_weights`` maps every tensor of a file through
:func:`hf_name`), built from the parts most families share (``gguf_name_parts``); the newer
families' tables are their own modules': ``gguf_gemma4``, ``gguf_gemma3n``, ``gguf_qwen35``,
``gguf_lfm2``, ``gguf_granite4``, ``gguf_glm4moe``, ``gguf_deepseek2``, ``gguf_llama4``,
``gguf_falcon_h1``, ``gguf_phi2``,
``gguf_nemotron_h``, ``gguf_ernie_hunyuan``)."""

from __future__ import annotations

import re

from freetoken_core.models import (
    gguf_deepseek2,
    gguf_ernie_hunyuan,
    gguf_falcon_h1,
    gguf_gemma3n,
    gguf_gemma4,
    gguf_glm4moe,
    gguf_granite4,
    gguf_lfm2,
    gguf_llama4,
    gguf_nemotron_h,
    gguf_phi2,
    gguf_qwen35,
)
from freetoken_core.models.gguf_name_parts import (
    ATTENTION,
    GEMMA_NORMS,
    GLOBAL,
    LLAMA_NORMS,
    MLP,
    MOE,
    SELECTION_BIAS,
    SHARED_EXPERTS,
)

# GGUF tensor name -> Hugging Face name, per architecture family; ``{i}`` is the layer.
# Qwen2-MoE's shared expert and its gate (1-d in the file: ``[hidden]``).
_SHARED_EXPERT = {
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
# gpt-oss's: biases on the attention's projections, a sink per head, a router with a bias,
# experts with biases (``ffn_gate_up_exps``: gate and up in one tensor, as llama.cpp's
# converter can write them).
_GPT_OSS = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    **ATTENTION,
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_sinks.weight": "self_attn.sinks",
    **MOE,
    "ffn_gate_inp.bias": "mlp.gate.bias",
    "ffn_gate_exps.bias": "mlp.experts.{e}.gate_proj.bias",
    "ffn_up_exps.bias": "mlp.experts.{e}.up_proj.bias",
    "ffn_down_exps.bias": "mlp.experts.{e}.down_proj.bias",
    "ffn_gate_up_exps.weight": "mlp.experts.{e}.gate_up_proj.weight",
    "ffn_gate_up_exps.bias": "mlp.experts.{e}.gate_up_proj.bias",
}
# OLMo 2's and EXAONE 4's: norms after attention and MLP, none before.
_POST_NORMED = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    **ATTENTION, **MLP,
}
_LAYER_TENSORS: dict[str, dict[str, str]] = {
    "llama": {**LLAMA_NORMS, **ATTENTION, **MLP, **MOE},  # (Mixtral: llama with experts)
    "smollm3": {**LLAMA_NORMS, **ATTENTION, **MLP},
    "mistral3": {**LLAMA_NORMS, **ATTENTION, **MLP},
    "olmo2": _POST_NORMED,  # (no input norms; q/k norms over all heads)
    "exaone4": _POST_NORMED,  # (OLMo 2's, with q/k norms per head)
    "granite": {**LLAMA_NORMS, **ATTENTION, **MLP},
    "granitemoe": {**LLAMA_NORMS, **ATTENTION, **MOE},
    "exaone": {**LLAMA_NORMS, **ATTENTION, **MLP},  # (q/k unpermuted: not PERMUTED_QK)
    "arcee": {**LLAMA_NORMS, **ATTENTION, **MLP},  # (no ffn_gate: ReLU² of ffn_up)
    "apertus": {  # (per-head q/k norms, q/k unpermuted; no ffn_gate: xIELU of ffn_up)
        **LLAMA_NORMS, **ATTENTION, "attn_output.bias": "self_attn.o_proj.bias",
        "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
    },
    "starcoder2": {  # (LayerNorms and linears with biases; no ffn_gate: GELU of ffn_up)
        **LLAMA_NORMS, "attn_norm.bias": "input_layernorm.bias",
        "ffn_norm.bias": "post_attention_layernorm.bias", **ATTENTION,
        "attn_output.bias": "self_attn.o_proj.bias", **MLP,
        "ffn_up.bias": "mlp.up_proj.bias", "ffn_down.bias": "mlp.down_proj.bias",
    },
    "seed_oss": {  # (its converter names the MLP's input norm as a post-attention norm)
        "attn_norm.weight": "input_layernorm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        **ATTENTION, **MLP,
    },
    # (Cohere's parallel blocks: one norm; Command R+'s q/k norms [heads, head_dim])
    "command-r": {"attn_norm.weight": "input_layernorm.weight", **ATTENTION, **MLP},
    "cohere2": {"attn_norm.weight": "input_layernorm.weight", **ATTENTION, **MLP},
    "qwen2": {**LLAMA_NORMS, **ATTENTION, **MLP},
    "qwen3": {**LLAMA_NORMS, **ATTENTION, **MLP},
    "qwen3moe": {**LLAMA_NORMS, **ATTENTION, **MLP, **MOE},
    "olmoe": {**LLAMA_NORMS, **ATTENTION, **MOE},  # (q/k norms over all heads)
    "hunyuan-dense": {**LLAMA_NORMS, **ATTENTION, **MLP},  # (q/k normed after rope)
    "hunyuan-moe": gguf_ernie_hunyuan.HUNYUAN_MOE_TENSORS,
    "ernie4_5-moe": gguf_ernie_hunyuan.ERNIE4_5_MOE_TENSORS,
    "qwen2moe": {**LLAMA_NORMS, **ATTENTION, **MLP, **MOE, **_SHARED_EXPERT},
    "gpt-oss": _GPT_OSS,
    "gemma3": {**GEMMA_NORMS, **ATTENTION, **MLP},
    "gemma4": gguf_gemma4.LAYER_TENSORS,
    "gemma3n": gguf_gemma3n.LAYER_TENSORS,
    **gguf_qwen35.LAYER_TENSORS_BY_ARCH,  # (qwen35, qwen35moe, qwen3next: hf_weights)
    **dict.fromkeys(gguf_lfm2.ARCHITECTURES, gguf_lfm2.LAYER_TENSORS),
    "granitehybrid": gguf_granite4.LAYER_TENSORS,  # (and its hf_weights)
    "falcon-h1": gguf_falcon_h1.LAYER_TENSORS,  # (and its hf_weights)
    **dict.fromkeys(gguf_nemotron_h.ARCHITECTURES, gguf_nemotron_h.LAYER_TENSORS),
    "glm4moe": gguf_glm4moe.LAYER_TENSORS,
    "deepseek2": gguf_deepseek2.LAYER_TENSORS,
    # (q/k norms over all heads, [heads x head_dim]; the router's selection bias)
    "minimax-m2": {**LLAMA_NORMS, **ATTENTION, **MOE, **SELECTION_BIAS},
    # (Qwen3's attention, GLM-4.5's experts: its dense layers, shared experts, selection bias)
    "dots1": {**LLAMA_NORMS, **ATTENTION, **MLP, **MOE, **SELECTION_BIAS, **SHARED_EXPERTS},
    "phi2": gguf_phi2.LAYER_TENSORS,  # (q/k/v apart or fused; biases; no ffn_gate)
    "llama4": gguf_llama4.LAYER_TENSORS,
    "gemma2": {**GEMMA_NORMS, **{k: v for k, v in ATTENTION.items() if "_norm" not in k},
               **MLP},  # (no q/k norms)
    "glm4": {
        "attn_norm.weight": "input_layernorm.weight",
        "post_attention_norm.weight": "post_self_attn_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "post_ffw_norm.weight": "post_mlp_layernorm.weight",
        **ATTENTION,
        "ffn_up.weight": "mlp.gate_up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    },
    # (llama.cpp's converter writes ERNIE 4.5's biases where use_bias gives it them; its
    # graph leaves attn_output.bias out and does not load the MLP's: FreeToken computes the
    # model as transformers does, every bias the file has)
    "ernie4_5": {
        **LLAMA_NORMS, **{k: v for k, v in ATTENTION.items() if "_norm" not in k},
        "attn_output.bias": "self_attn.o_proj.bias", **MLP,
        **{f"ffn_{p}.bias": f"mlp.{p}_proj.bias" for p in ("gate", "up", "down")},
    },
    "phi3": {
        **LLAMA_NORMS,
        "attn_qkv.weight": "self_attn.qkv_proj.weight",
        "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_up.weight": "mlp.gate_up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    },
}
# The architectures whose converter (LlamaModel's) stores q/k rows permuted for llama.cpp's
# interleaved rotary pairs.
PERMUTED_QK = frozenset({"llama", "smollm3", "granite", "granitemoe", "mistral3", "arcee",
                         "granitehybrid", *gguf_nemotron_h.ARCHITECTURES})
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
# The out projections of the token mixers other than attention (a layer must have one of
# them or attention's o_proj): Qwen3.5's linear attention, LFM2's convolution, Granite 4's
# Mamba-2; Nemotron-H's one mixer a block (Mamba-2, attention, MLP or experts).
MIXER_OUTPUTS = ("linear_attn.out_proj.weight", "conv.out_proj.weight",
                 "mamba.out_proj.weight",
                 *(f"mixer.{m}.weight" for m in ("out_proj", "o_proj", "down_proj",
                                                  "shared_experts.down_proj")))



def hf_name(arch: str, gguf_name: str) -> str | None:
    """The Hugging Face name of tensor ``gguf_name`` of an ``arch`` file; ``None`` if the
    family has no such tensor."""
    if gguf_name in GLOBAL:
        return GLOBAL[gguf_name]
    if arch == "gemma4" and gguf_name in gguf_gemma4.GLOBAL_TENSORS:
        return gguf_gemma4.GLOBAL_TENSORS[gguf_name]
    if arch == "gemma3n" and gguf_name in gguf_gemma3n.GLOBAL_TENSORS:
        return gguf_gemma3n.GLOBAL_TENSORS[gguf_name]
    if arch in gguf_lfm2.ARCHITECTURES and gguf_name in gguf_lfm2.GLOBAL_TENSORS:
        return gguf_lfm2.GLOBAL_TENSORS[gguf_name]
    if arch == "phi2" and gguf_name in gguf_phi2.GLOBAL_TENSORS:
        return gguf_phi2.GLOBAL_TENSORS[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    if match and match.group(2) in _LAYER_TENSORS[arch]:
        return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[arch][match.group(2)]}"
    return None
