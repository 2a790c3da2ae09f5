"""Gemma 3n GGUF files (``general.architecture`` ``gemma3n``), as llama.cpp's converter writes
them (``conversion/gemma.py`` ``Gemma3NModel``): the metadata as the Hugging Face config keys
``config_gemma3n`` reads, and the tensor names.

- ``attention.sliding_window_pattern``: a bool a layer, true where it slides (over
  ``attention.sliding_window`` keys); a number ``n`` (every ``n``-th layer global) or none
  (5) as llama.cpp reads it; ``rope.freq_base`` the global layers' base,
  ``rope.freq_base_swa`` the sliding layers' (llama.cpp's 10,000 where absent);
- ``feed_forward_length`` a number or a number a layer; ``attention.head_count_kv`` one;
- ``altup.num_inputs``, ``altup.active_idx``, ``embedding_length_per_layer_input``,
  ``attention.shared_kv_layers``: required (llama.cpp's graph assumes E2B's and E4B's values
  instead; FreeToken reads the file's); the LAuReL rank is ``laurel_l``'s rows;
- ``activation_sparsity_scale``: a layer's sparsity as the converter stores it, its standard
  normal quantile (``-inf`` for a dense layer), turned back into the sparsity
  (float32 round trip: transformers' quantile of it is the file's value);
- ``final_logit_softcapping`` (30 where absent, llama.cpp's).
The AltUp projections are one 3-d tensor each (``altup_proj``, ``altup_unembd_proj``: a
slice a copy); the per-layer embedding has a row a token (the converter pads the checkpoint's
with zero rows up to the vocabulary: its ``vocab_size_per_layer_input`` is not in the file,
so those tokens get zeros, as in llama.cpp, where transformers gives them token 0's row). The
norms are stored as the checkpoint has them (``x * w``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.gguf_gemma4 import per_layer
from freetoken_core.models.gguf_name_parts import ATTENTION, GEMMA_NORMS, MLP
from freetoken_core.models.gguf_reader import array_field, field, require

# Tensors outside the blocks (``{e}``: a copy's slice of a 3-d tensor).
GLOBAL_TENSORS = {
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
    "altup_proj.weight": "model.altup_projections.{e}.weight",
    "altup_unembd_proj.weight": "model.altup_unembed_projections.{e}.weight",
}
# A block's tensors, by their names under ``blk.{i}.``.
LAYER_TENSORS = {
    **GEMMA_NORMS, **ATTENTION, **MLP,
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
    "altup_correct_coef.weight": "altup.correction_coefs.weight",
    "altup_correct_scale.weight": "altup.correct_output_scale",
    "altup_predict_coef.weight": "altup.prediction_coefs.weight",
    "altup_router.weight": "altup.modality_router.weight",
    "altup_router_norm.weight": "altup.router_norm.weight",
    "laurel_l.weight": "laurel.linear_left.weight",
    "laurel_r.weight": "laurel.linear_right.weight",
    "laurel_post_norm.weight": "laurel.post_laurel_norm.weight",
}


def gemma3n_config(reader: Any, config: dict[str, Any]) -> dict[str, Any]:
    """The Hugging Face config keys of a ``gemma3n`` file (module docstring), over the common
    ones in ``config``."""
    p = "gemma3n."
    layers = config["num_hidden_layers"]
    head_dim = config["head_dim"]
    if int(field(reader, p + "attention.value_length", head_dim)) != head_dim:
        raise ModelLoadError(f"GGUF {p}attention.value_length "
                             f"{field(reader, p + 'attention.value_length')} != key_length "
                             f"{head_dim}: Gemma 3n's keys and values are as wide")
    kv_heads = per_layer(reader, p + "attention.head_count_kv", layers,
                         config["num_attention_heads"])
    if len(set(kv_heads)) != 1:
        raise ModelLoadError(f"GGUF {p}attention.head_count_kv {kv_heads}: Gemma 3n's layers "
                             "have one count of KV heads")
    shapes = {t.name: [int(d) for d in t.shape.tolist()] for t in reader.tensors}
    table, laurel = (shapes.get(name) for name in ("per_layer_token_embd.weight",
                                                   "blk.0.laurel_l.weight"))
    if table is None or laurel is None:
        raise ModelLoadError("GGUF gemma3n file without per_layer_token_embd.weight or "
                             "blk.0.laurel_l.weight; re-export the model with llama.cpp")
    return {
        "model_type": "gemma3n_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "intermediate_size": per_layer(reader, p + "feed_forward_length", layers),
        "num_key_value_heads": kv_heads[0],
        "layer_types": _layer_types(reader, layers),
        "sliding_window": int(require(reader, p + "attention.sliding_window")),
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": float(
                field(reader, p + "rope.freq_base_swa", 10_000.0))},
            "full_attention": {"rope_type": "default", "rope_theta": config["rope_theta"]}},
        "num_kv_shared_layers": int(require(reader, p + "attention.shared_kv_layers")),
        "hidden_size_per_layer_input": int(require(reader,
                                                   p + "embedding_length_per_layer_input")),
        "vocab_size_per_layer_input": table[-1],
        "altup_num_inputs": int(require(reader, p + "altup.num_inputs")),
        "altup_active_idx": int(require(reader, p + "altup.active_idx")),
        "altup_correct_scale": True,  # (llama.cpp's graph always scales)
        "laurel_rank": laurel[-1],
        "activation_sparsity_pattern": _sparsity(reader, p + "activation_sparsity_scale",
                                                 layers),
        "final_logit_softcapping": float(field(reader, p + "final_logit_softcapping", 30.0)),
        "rms_norm_eps": float(field(reader, p + "attention.layer_norm_rms_epsilon", 1e-6)),
    }


def _layer_types(reader: Any, layers: int) -> list[str]:
    """Each layer's type from ``attention.sliding_window_pattern`` (module docstring)."""
    key = "gemma3n.attention.sliding_window_pattern"
    pattern = array_field(reader, key)
    if pattern is None:
        n = int(field(reader, key, 5))
        pattern = [n == 0 or i % n < n - 1 for i in range(layers)]
    if len(pattern) != layers:
        raise ModelLoadError(f"GGUF {key} has {len(pattern)} values for {layers} layers")
    return ["sliding_attention" if bool(s) else "full_attention" for s in pattern]


def _sparsity(reader: Any, key: str, layers: int) -> list[float]:
    """Each layer's activation sparsity from its standard normal quantile (the file's), the
    float32 nearest the normal's distribution function at it."""
    quantiles = array_field(reader, key)
    if quantiles is None or len(quantiles) != layers or any(
            math.isnan(float(q)) or float(q) == math.inf for q in quantiles):
        raise ModelLoadError(f"GGUF {key} must hold a quantile (-inf where dense) for each of "
                             f"the {layers} layers; re-export the model with llama.cpp")
    return [float(np.float32(0.5 * math.erfc(-float(q) / math.sqrt(2)))) for q in quantiles]
