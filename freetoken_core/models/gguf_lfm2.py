"""LFM2 and LFM2-MoE GGUF files (``general.architecture`` ``lfm2`` / ``lfm2moe``), as
llama.cpp's converter writes them (``conversion/lfm2.py`` ``LFM2Model`` / ``LFM2MoeModel``)
and its ``src/models/lfm2.cpp`` / ``lfm2moe.cpp`` read them: the metadata as the Hugging Face
config keys ``config_lfm2`` reads, and the tensor names. What the converter changes, undone:

- which layers are attention: ``attention.head_count_kv`` is a number a layer, 0 for a
  convolution layer (llama.cpp's ``is_recr``), the KV heads of the attention layers else;
- ``shortconv.l_cache`` is ``conv_L_cache``; each ``blk.{i}.shortconv.conv.weight`` is the
  checkpoint's ``[hidden, 1, kernel]`` squeezed to ``[hidden, kernel]`` (``short_conv`` takes
  either); ``shortconv.in_proj`` / ``out_proj`` are ``conv.in_proj`` / ``out_proj``. No
  file has their biases (``conv_bias``, false in the released models: the converter's
  squeeze fails on the convolution's 1-d bias, and llama.cpp's graph has none);
- the final norm (``model.embedding_norm``) is ``token_embd_norm.weight``;
- ``attention.layer_norm_rms_epsilon`` is ``norm_eps`` (required, as llama.cpp reads it);
  ``feed_forward_length`` the dense MLPs' width (``block_auto_adjust_ff_dim`` applied);
- LFM2-MoE: ``leading_dense_block_count`` is ``num_dense_layers`` (0 where absent, as
  llama.cpp), ``expert_count`` / ``expert_used_count`` / ``expert_feed_forward_length``,
  ``expert_gating_func`` 2 (sigmoid); the router ``ffn_gate_inp``, the experts stacked in
  3-d ``ffn_{gate,up,down}_exps`` and the selection bias ``exp_probs_b.bias`` (the
  checkpoint's ``expert_bias``). llama.cpp renormalizes the chosen experts' sigmoids and
  scales them by nothing (the converter writes no ``routed_scaling_factor``): the config's
  ``norm_topk_prob`` and a scale of 1.
A sliding window (LFM2.5's audio tokenizer) and non-causal files (LFM2's embedding models)
are refused.
"""

from __future__ import annotations

from typing import Any

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.gguf_gemma4 import per_layer
from freetoken_core.models.gguf_name_parts import ATTENTION, LLAMA_NORMS, MLP, MOE, SELECTION_BIAS
from freetoken_core.models.gguf_reader import field, require

ARCHITECTURES = {"lfm2": "Lfm2ForCausalLM", "lfm2moe": "Lfm2MoeForCausalLM"}

# Tensors outside the blocks.
GLOBAL_TENSORS = {"token_embd_norm.weight": "model.norm.weight"}
# A block's tensors, by their names under ``blk.{i}.`` (``{e}``: an expert of a 3-d tensor),
# as FreeToken's LFM2 reads them (weight_names.py's renames of the checkpoint's).
LAYER_TENSORS = {
    **LLAMA_NORMS, **ATTENTION,
    "shortconv.conv.weight": "conv.conv.weight",
    "shortconv.in_proj.weight": "conv.in_proj.weight",
    "shortconv.out_proj.weight": "conv.out_proj.weight",
    **MLP, **MOE, **SELECTION_BIAS,
}
_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def lfm2_config(reader: Any, arch: str, config: dict[str, Any],
                names: set[str]) -> dict[str, Any]:
    """The Hugging Face config keys of an ``lfm2`` / ``lfm2moe`` file (module docstring),
    over the common ones in ``config``."""
    p = f"{arch}."
    layers = config["num_hidden_layers"]
    kv = per_layer(reader, p + "attention.head_count_kv", layers)
    types = ["conv" if n == 0 else "full_attention" for n in kv]
    kv_heads = sorted({n for n in kv if n})
    if len(kv_heads) > 1 or any(n < 0 for n in kv):
        raise ModelLoadError(f"GGUF {p}attention.head_count_kv {kv}: FreeToken runs LFM2 files "
                             "whose attention layers have one number of KV heads (0 for a "
                             "convolution layer)")
    if int(field(reader, p + "attention.sliding_window", 0)) > 0:
        raise ModelLoadError(f"GGUF {p}attention.sliding_window: FreeToken runs LFM2 files "
                             "whose attention layers see every earlier token")
    if not bool(field(reader, p + "attention.causal", True)):
        raise ModelLoadError(f"GGUF {p}attention.causal is false (an embedding model); "
                             "FreeToken serves causal language models")
    kernel = int(require(reader, p + "shortconv.l_cache"))
    if kernel < 2:
        raise ModelLoadError(f"GGUF {p}shortconv.l_cache {kernel} must be at least 2")
    out: dict[str, Any] = {
        "model_type": "lfm2" if arch == "lfm2" else "lfm2_moe",
        "layer_types": types,
        "num_key_value_heads": kv_heads[0] if kv_heads else config["num_attention_heads"],
        "conv_L_cache": kernel,
        "intermediate_size": int(require(reader, p + "feed_forward_length")),
        "rms_norm_eps": float(require(reader, p + "attention.layer_norm_rms_epsilon")),
    }
    if arch == "lfm2":
        return out
    dense = int(field(reader, p + "leading_dense_block_count", 0))
    gating = int(require(reader, p + "expert_gating_func"))
    if gating != _SIGMOID:
        raise ModelLoadError(f"GGUF {p}expert_gating_func {gating} is not supported: LFM2-MoE "
                             f"routes by sigmoid scores ({_SIGMOID})")
    sizes = per_layer(reader, p + "expert_feed_forward_length", layers)
    if len(set(sizes[dense:])) > 1:
        raise ModelLoadError(f"GGUF {p}expert_feed_forward_length {sizes}: FreeToken runs "
                             "experts of one width")
    return {**out, "num_dense_layers": dense,
            "num_experts": int(require(reader, p + "expert_count")),
            "num_experts_per_tok": int(require(reader, p + "expert_used_count")),
            "moe_intermediate_size": sizes[-1],
            "use_expert_bias": any(n.endswith("exp_probs_b.bias") for n in names),
            "norm_topk_prob": True, "routed_scaling_factor": 1.0}
