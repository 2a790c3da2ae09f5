"""Granite 4 GGUF files, as llama.cpp's converter writes them (``conversion/granite.py``
``GraniteHybridModel`` over ``Mamba2Model`` and ``GraniteMoeModel``) and its
``src/models/granite-hybrid.cpp`` reads them: the metadata as the Hugging Face config keys
``config_granite4`` reads, the tensor names, and the converter's changes to the tensors undone
(:func:`hf_weights`), so ``granite_hybrid.py`` gets transformers' tensors.

The hybrids (granite-4.0-h-micro, -h-tiny, -h-small) are ``general.architecture``
``granitehybrid``; a Granite 4 without Mamba-2 layers (granite-4.0-micro) is written as a
``granite`` file (``granitemoe`` with experts), served as Granite 3 is (the same model), its
``attention.head_count_kv`` an array of one value a layer (:func:`kv_head_count`).

Metadata (``granitehybrid.``): ``attention.head_count_kv`` a number a layer, 0 for a Mamba-2
layer (llama.cpp: recurrent where it is 0); ``ssm.time_step_rank`` the Mamba heads,
``ssm.inner_size`` their total size (2 x hidden: ``mamba_expand``), ``ssm.group_count``,
``ssm.state_size``, ``ssm.conv_kernel``; ``rope.scaling.finetuned`` whether the attention
layers rotate (llama.cpp's switch, default true; the converter writes false for every
hybrid, whatever its ``position_embedding_type``, and then a context length of 2^20); Granite's
multipliers ``embedding_scale``, ``residual_scale``, ``attention.scale``, ``logit_scale`` (a
missing or zero one is none); ``expert_count`` / ``expert_used_count`` (experts of
``feed_forward_length``; softmax over the top k, renormalized: transformers' softmax of the top
k logits) and ``expert_shared_feed_forward_length`` the shared MLP's size (else
``feed_forward_length``: the dense hybrids'). The Mamba-2 chunk size is not stored; the
chunked scan is the recurrence, so the default's result is the file's.

Tensors, as the converter changes them:
- ``A_log`` is stored as ``ssm_a = -exp(A_log)`` ``[heads, 1]`` (``log(-ssm_a)`` here), ``D``
  as ``ssm_d`` ``[heads, 1]``, ``dt_bias`` as ``ssm_dt.bias``, ``conv1d.weight``
  ``[channels, 1, kernel]`` squeezed to ``[channels, kernel]``, the gated norm's weight
  reshaped to ``[groups, inner / groups]`` (flattened here);
- the attention's q/k rows permuted for llama.cpp's rotary pairs (``LlamaModel.permute``,
  undone by ``gguf_weights`` as for llama files, rotating or not);
- the experts' fused ``input_linear`` split into ``ffn_gate_exps`` / ``ffn_up_exps``, the shared
  MLP's into ``ffn_gate_shexp`` / ``ffn_up_shexp`` (``ffn_gate`` / ``ffn_up`` /
  ``ffn_down`` without experts): read as the shared MLP's gate and up, one linear again.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.gguf_reader import array_field, field, require

P = "granitehybrid."
# A block's tensors, by their names under ``blk.{i}.`` (``{e}``: an expert of a 3-d tensor).
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"attn_{p}.{kind}": f"self_attn.{p}_proj.{kind}" for p in "qkv"
       for kind in ("weight", "bias")},
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ssm_in.weight": "mamba.in_proj.weight",
    "ssm_conv1d.weight": "mamba.conv1d.weight",
    "ssm_conv1d.bias": "mamba.conv1d.bias",
    "ssm_dt.bias": "mamba.dt_bias",
    "ssm_a": "mamba.A_log",
    "ssm_d": "mamba.D",
    "ssm_norm.weight": "mamba.norm.weight",
    "ssm_out.weight": "mamba.out_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.{e}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{e}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{e}.down_proj.weight",
    # the shared MLP: ``shexp`` beside experts, the plain MLP's names without
    "ffn_gate_shexp.weight": "shared_mlp.gate_proj.weight",
    "ffn_up_shexp.weight": "shared_mlp.up_proj.weight",
    "ffn_down_shexp.weight": "shared_mlp.output_linear.weight",
    "ffn_gate.weight": "shared_mlp.gate_proj.weight",
    "ffn_up.weight": "shared_mlp.up_proj.weight",
    "ffn_down.weight": "shared_mlp.output_linear.weight",
}

def kv_head_count(reader: Any, arch: str, heads: int) -> int:
    """``{arch}.attention.head_count_kv``: a number, or (llama.cpp's per-layer form, which
    Granite 4's converter writes) one a layer, all the same but the 0s of a ``granitehybrid``
    file's Mamba-2 layers; ``heads`` where the key is missing."""
    key = f"{arch}.attention.head_count_kv"
    values = array_field(reader, key)
    if values is None:
        return int(field(reader, key, heads))
    counts = {int(v) for v in values} - ({0} if arch == "granitehybrid" else set())
    if len(counts) > 1 or (not counts and arch != "granitehybrid"):
        raise ModelLoadError(f"GGUF {key} {[int(v) for v in values]}: FreeToken runs files "
                             "whose attention layers all have the same KV heads")
    return counts.pop() if counts else heads


def positive(reader: Any, key: str) -> int:
    """The file's ``key``, required, a positive integer."""
    value = require(reader, key)
    if not isinstance(value, (int, np.integer)) or int(value) < 1:
        raise ModelLoadError(f"GGUF {key} must be a positive integer, not {value!r}; "
                             "re-export the model with llama.cpp")
    return int(value)


def granite4_config(reader: Any, config: dict[str, Any]) -> dict[str, Any]:
    """The Hugging Face config keys (``GraniteMoeHybridConfig``'s) of a ``granitehybrid``
    file (module docstring), over the common ones in ``config``."""
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    per_layer = array_field(reader, P + "attention.head_count_kv")
    if per_layer is None:
        per_layer = [config["num_key_value_heads"]] * layers
    if len(per_layer) != layers:
        raise ModelLoadError(f"GGUF {P}attention.head_count_kv has {len(per_layer)} values "
                             f"for {layers} blocks")
    heads = positive(reader, P + "ssm.time_step_rank")
    inner = positive(reader, P + "ssm.inner_size")
    if inner % heads or inner % hidden:
        raise ModelLoadError(f"GGUF {P}ssm.inner_size {inner} must split into the "
                             f"{heads} Mamba heads ({P}ssm.time_step_rank) and be a multiple "
                             f"of the hidden size {hidden}")

    def scale(key: str, default: float) -> float:
        value = float(field(reader, P + key, 0.0))
        return value if value != 0.0 else default

    out: dict[str, Any] = {
        "model_type": "granitemoehybrid",
        "layer_types": ["mamba" if int(kv) == 0 else "attention" for kv in per_layer],
        "mamba_n_heads": heads, "mamba_d_head": inner // heads,
        "mamba_expand": inner // hidden,
        "mamba_n_groups": positive(reader, P + "ssm.group_count"),
        "mamba_d_state": positive(reader, P + "ssm.state_size"),
        "mamba_d_conv": positive(reader, P + "ssm.conv_kernel"),
        "position_embedding_type": ("rope" if field(reader, P + "rope.scaling.finetuned", True)
                                    else "nope"),
        "embedding_multiplier": scale("embedding_scale", 1.0),
        "residual_multiplier": scale("residual_scale", 1.0),
        "attention_multiplier": scale("attention.scale", config["head_dim"] ** -0.5),
        "logits_scaling": scale("logit_scale", 1.0),
        "shared_intermediate_size": int(field(reader, P + "expert_shared_feed_forward_length",
                                              0)) or config["intermediate_size"],
        "num_local_experts": 0,
    }
    experts = int(field(reader, P + "expert_count", 0))
    if experts:
        used = int(field(reader, P + "expert_used_count", 0))
        if not 1 <= used <= experts:
            raise ModelLoadError(f"GGUF {P}expert_count {experts} / expert_used_count {used}: "
                                 "a mixture of experts needs 1 <= used <= count")
        weights_scale = float(field(reader, P + "expert_weights_scale", 0.0))
        if weights_scale not in (0.0, 1.0):
            raise ModelLoadError(f"GGUF {P}expert_weights_scale {weights_scale}: FreeToken "
                                 "runs Granite 4 files whose expert weights are unscaled")
        out.update(num_local_experts=experts, num_experts_per_tok=used)
    return out


def hf_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """``weights`` (a ``granitehybrid`` file's, under the Hugging Face names of
    :data:`LAYER_TENSORS`; or a ``falcon-h1`` file's, whose converter changes its mixers'
    tensors alike: ``gguf_falcon_h1``) as transformers' checkpoint holds the Mamba-2 layers' small
    tensors (module docstring): float32 tensors of transformers' shapes, ``A_log`` from
    ``ssm_a``."""
    import torch

    out: dict[str, Any] = {}
    for name, w in weights.items():
        tail = name.rsplit(".mamba.", 1)[-1] if ".mamba." in name else ""
        if tail in ("A_log", "D", "norm.weight", "conv1d.weight"):
            if not isinstance(w, torch.Tensor):
                w = w.dequantize()
            if tail != "conv1d.weight":
                w = w.reshape(-1)
            if tail == "A_log":
                if not bool(torch.all(w < 0)):
                    raise ModelLoadError(f"GGUF tensor {name} (ssm_a) holds values of 0 or "
                                         "above; llama.cpp stores -exp(A_log) there - "
                                         "re-export the model")
                w = torch.log(-w)
        out[name] = w
    return out
