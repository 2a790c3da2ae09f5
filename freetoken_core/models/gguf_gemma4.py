"""Gemma 4 GGUF files (``general.architecture`` ``gemma4``), as llama.cpp's converter writes
them (``conversion/gemma.py`` ``Gemma4Model``) and its ``src/models/gemma4.cpp`` reads them:
the metadata as the Hugging Face config keys ``config_gemma4`` reads, and the tensor names.

- ``attention.sliding_window_pattern``: a bool a layer, true where it slides (over
  ``attention.sliding_window`` keys); ``attention.key_length`` the global layers' head size,
  ``key_length_swa`` the sliding layers'; ``attention.head_count_kv`` a number or a number
  a layer (the global layers' fewer KV heads); a global layer without ``attn_v`` takes its
  values from the key projection (``attention_k_eq_v``);
- ``rope.freq_base`` the global layers' base, ``rope.freq_base_swa`` the sliding layers'
  (else the global one, as llama.cpp reads it);
  the global layers' proportional rope is ``rope_freqs.weight``, a factor a pair (1 for the
  pairs that turn, 1e30 for the others: ``gguf_metadata.rope_factor_scaling``);
- ``attention.shared_kv_layers``, ``embedding_length_per_layer_input`` (PLE, with
  ``per_layer_token_embd`` / ``per_layer_model_proj`` / ``per_layer_proj_norm``),
  ``feed_forward_length`` a number or a number a layer (E2B's double-wide MLPs of its shared
  layers), the experts' ``expert_count`` / ``expert_used_count`` /
  ``expert_feed_forward_length``, ``final_logit_softcapping``.
The norms are stored as the checkpoint has them (``x * w``: nothing added, unlike Gemma 3's).
"""

from __future__ import annotations

from typing import Any

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.gguf_name_parts import ATTENTION, GEMMA_NORMS, MLP, MOE
from freetoken_core.models.gguf_reader import array_field, field, require

# Tensors outside the blocks.
GLOBAL_TENSORS = {
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}
# A block's tensors, by their names under ``blk.{i}.`` (``{e}``: an expert of a 3-d tensor).
LAYER_TENSORS = {
    **GEMMA_NORMS, **ATTENTION, **MLP, **MOE,
    "layer_output_scale.weight": "layer_scalar",
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "ffn_gate_up_exps.weight": "mlp.experts.{e}.gate_up_proj.weight",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
}


def per_layer(reader: Any, key: str, layers: int, default: Any = None) -> list[int]:
    """``key`` a layer: the file's array, or its one number for every layer."""
    values = array_field(reader, key)
    if values is None:
        value = require(reader, key) if default is None else field(reader, key, default)
        return [int(value)] * layers
    if len(values) != layers:
        raise ModelLoadError(f"GGUF {key} has {len(values)} values for {layers} layers")
    return [int(v) for v in values]


def gemma4_config(reader: Any, config: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """The Hugging Face config keys of a ``gemma4`` file (module docstring), over the common
    ones in ``config``."""
    p = "gemma4."
    layers = config["num_hidden_layers"]
    pattern = array_field(reader, p + "attention.sliding_window_pattern")
    if pattern is None or len(pattern) != layers:
        raise ModelLoadError(f"GGUF {p}attention.sliding_window_pattern must hold a bool for "
                             f"each of the {layers} layers; re-export the model with llama.cpp")
    types = ["sliding_attention" if bool(s) else "full_attention" for s in pattern]
    full_dim = int(require(reader, p + "attention.key_length"))
    swa_dim = int(require(reader, p + "attention.key_length_swa"))
    for key, want in (("attention.value_length", full_dim),
                      ("attention.value_length_swa", swa_dim),
                      ("rope.dimension_count_swa", swa_dim)):
        if int(field(reader, p + key, want)) != want:
            raise ModelLoadError(f"GGUF {p}{key} {field(reader, p + key)} != {want}: "
                                 "FreeToken runs Gemma 4 files whose heads are as wide for keys "
                                 "and values and whose sliding layers rotate the whole head")
    kv_heads = per_layer(reader, p + "attention.head_count_kv", layers,
                         config["num_attention_heads"])
    shared = int(field(reader, p + "attention.shared_kv_layers", 0))
    stores = range(layers - shared)
    full = [i for i in stores if types[i] == "full_attention"]
    without_v = [i for i in stores if f"blk.{i}.attn_v.weight" not in names]
    if without_v and (without_v != full):
        raise ModelLoadError(f"GGUF gemma4 layers {without_v} have no attn_v; FreeToken takes "
                             "the values from the keys on every global layer or none "
                             "(transformers' attention_k_eq_v)")
    sliding = next((i for i, t in enumerate(types) if t == "sliding_attention"), 0)
    kv_swa = kv_heads[sliding]
    overrides = {str(i): {"head_dim": full_dim if t == "full_attention" else swa_dim,
                          "num_key_value_heads": kv_heads[i]}
                 for i, t in enumerate(types)
                 if (t == "full_attention" and full_dim != swa_dim) or kv_heads[i] != kv_swa}
    ff = per_layer(reader, p + "feed_forward_length", layers)
    out: dict[str, Any] = {
        "model_type": "gemma4_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "intermediate_size": ff[0],
        "use_double_wide_mlp": ff != [ff[0]] * layers,
        "head_dim": swa_dim,
        "num_key_value_heads": kv_swa,
        "per_layer_config": overrides,
        "attention_k_eq_v": bool(without_v),
        "layer_types": types,
        "sliding_window": int(field(reader, p + "attention.sliding_window", 512)),
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default",
                                  # (llama.cpp: the global base where the
                                  # file has no sliding one)
                                  "rope_theta": float(field(reader, p + "rope.freq_base_swa",
                                                            config["rope_theta"]))},
            "full_attention": {"rope_type": "default", "rope_theta": config["rope_theta"]}},
        "num_kv_shared_layers": shared,
        "hidden_size_per_layer_input": int(field(reader, p + "embedding_length_per_layer_input",
                                                 0)),
        "final_logit_softcapping": field(reader, p + "final_logit_softcapping"),
        "rms_norm_eps": float(field(reader, p + "attention.layer_norm_rms_epsilon", 1e-6)),
    }
    experts = int(field(reader, p + "expert_count", 0))
    if experts:
        out.update(enable_moe_block=True, num_experts=experts,
                   top_k_experts=int(require(reader, p + "expert_used_count")),
                   moe_intermediate_size=int(require(reader,
                                                     p + "expert_feed_forward_length")))
    return out
