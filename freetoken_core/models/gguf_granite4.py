"""Granite 4 GGUF files, as llama.cpp's converter writes them (``conversion/granite.py``
``GraniteHybridModel`` over ``Mamba2Model`` and ``GraniteMoeModel``) and its
``src/models/granite-hybrid.cpp`` reads them: the metadata as the Hugging Face config keys
``config_granite4`` reads, the tensor names, and the converter's changes to the tensors undone
(the Mamba-2 mixers' by ``gguf_mamba2.hf_mamba2_weights``), so ``granite_hybrid.py`` gets
transformers' tensors.

The hybrids (granite-4.0-h-micro, -h-tiny, -h-small) are ``general.architecture``
``granitehybrid``; a Granite 4 without Mamba-2 layers (granite-4.0-micro) is written as a
``granite`` file (``granitemoe`` with experts), served as Granite 3 is (the same model), its
``attention.head_count_kv`` an array of one value a layer (:func:`kv_head_count`).

Metadata (``granitehybrid.``): ``attention.head_count_kv`` a number a layer, 0 for a Mamba-2
layer (llama.cpp: recurrent where it is 0); the Mamba-2 shape from ``ssm.*``
(``gguf_mamba2.ssm_shape``; ``ssm.inner_size`` is 2 x hidden: ``mamba_expand``);
``rope.scaling.finetuned`` whether the attention
layers rotate (llama.cpp's switch, default true; the converter writes false for every
hybrid, whatever its ``position_embedding_type``, and then a context length of 2^20); Granite's
multipliers ``embedding_scale``, ``residual_scale``, ``attention.scale``, ``logit_scale`` (a
missing or zero one is none); ``expert_count`` / ``expert_used_count`` (experts of
``feed_forward_length``; softmax over the top k, renormalized: transformers' softmax of the top
k logits) and ``expert_shared_feed_forward_length`` the shared MLP's size (else
``feed_forward_length``: the dense hybrids').

Tensors, as the converter changes them:
- the Mamba-2 mixers' small tensors (``gguf_mamba2.hf_mamba2_weights``: ``-exp(A_log)``, the
  reshapes);
- the attention's q/k rows permuted for llama.cpp's rotary pairs (``LlamaModel.permute``,
  undone by ``gguf_weights`` as for llama files, rotating or not);
- the experts' fused ``input_linear`` split into ``ffn_gate_exps`` / ``ffn_up_exps``, the shared
  MLP's into ``ffn_gate_shexp`` / ``ffn_up_shexp`` (``ffn_gate`` / ``ffn_up`` /
  ``ffn_down`` without experts): read as the shared MLP's gate and up, one linear again.
"""

from __future__ import annotations

from typing import Any

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.gguf_mamba2 import ssm_shape
from freetoken_core.models.gguf_reader import array_field, field

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
    ssm = ssm_shape(reader, P)
    if ssm.inner % hidden:
        raise ModelLoadError(f"GGUF {P}ssm.inner_size {ssm.inner} must be a multiple of the "
                             f"hidden size {hidden} ({P}embedding_length)")

    def scale(key: str, default: float) -> float:
        value = float(field(reader, P + key, 0.0))
        return value if value != 0.0 else default

    out: dict[str, Any] = {
        "model_type": "granitemoehybrid",
        "layer_types": ["mamba" if int(kv) == 0 else "attention" for kv in per_layer],
        "mamba_n_heads": ssm.heads, "mamba_d_head": ssm.head_dim,
        "mamba_expand": ssm.inner // hidden, "mamba_n_groups": ssm.groups,
        "mamba_d_state": ssm.state, "mamba_d_conv": ssm.conv,
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
