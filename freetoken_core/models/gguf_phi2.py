"""A ``phi2`` GGUF file (Phi-1, Phi-1.5, Phi-2: llama.cpp's converter ``Phi2Model``, its
graph ``src/models/phi2.cpp``) as the Hugging Face ``PhiForCausalLM`` it describes: its
keys beyond the common ones (:func:`phi2_config`) and its tensor names
(:data:`LAYER_TENSORS`, :data:`GLOBAL_TENSORS`: the names ``models/phi.py`` reads)."""

from __future__ import annotations

import math
from typing import Any

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.gguf_reader import field, require

# A block's tensors: one LayerNorm (with a bias) feeding attention and the MLP, q/k/v apart
# (a transformers checkpoint's) or fused (``attn_qkv``: Phi's original checkpoints' ``Wqkv``,
# rows q, k then v), every linear with a bias, the MLP not gated (``ffn_up``, ``ffn_down``).
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_norm.bias": "input_layernorm.bias",
    **{f"attn_{p}.{kind}": f"self_attn.{p}_proj.{kind}"
       for p in ("q", "k", "v", "qkv") for kind in ("weight", "bias")},
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_down.bias": "mlp.down_proj.bias",
}
# Beyond every family's (gguf_names._GLOBAL: the final norm's bias is there): the head's bias.
GLOBAL_TENSORS = {"output.bias": "lm_head.bias"}


def phi2_config(reader: Any, head_dim: int, rope_dim: int) -> dict[str, Any]:
    """A ``phi2`` file's keys as llama.cpp reads them: the LayerNorms' eps
    ``attention.layer_norm_epsilon`` (required), GELU (the tanh approximation: transformers'
    ``gelu_new``), the first ``rope.dimension_count`` dimensions of each head rotated
    (``partial_rotary_factor``), and no rope scaling (its converter writes none; a file
    with ``rope.scaling.type`` is refused)."""
    kind = field(reader, "phi2.rope.scaling.type")
    if kind not in (None, "none"):
        raise ModelLoadError(f"GGUF phi2 with phi2.rope.scaling.type {kind!r} is not "
                             "supported; FreeToken runs Phi's default rope")
    factor = rope_dim / head_dim
    if int(head_dim * factor) != rope_dim:  # (the fraction's float just below it)
        factor = math.nextafter(factor, math.inf)
    return {"model_type": "phi", "hidden_act": "gelu_new",
            "layer_norm_eps": float(require(reader, "phi2.attention.layer_norm_epsilon")),
            "partial_rotary_factor": factor, "qk_layernorm": False}
