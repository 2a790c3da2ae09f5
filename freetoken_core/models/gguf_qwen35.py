"""Qwen3.5 GGUF files (``general.architecture`` ``qwen35``), Qwen3.5-MoE's (``qwen35moe``) and
Qwen3-Next's (``qwen3next``), as llama.cpp's converter writes them (``conversion/qwen.py``
``Qwen3_5TextModel`` / ``Qwen3_5MoeTextModel`` over ``Qwen3NextModel``, ``Qwen3NextModel``
over ``Qwen2MoeModel``) and its ``src/models/qwen35.cpp``, ``qwen35moe.cpp`` and
``qwen3next.cpp`` read them: the metadata as the Hugging Face config keys ``config_qwen3_5``
reads, the tensor names, and the converter's changes to the tensors undone
(:func:`hf_weights`), so ``qwen3_5.py`` gets transformers' tensors.

Metadata: ``ssm.group_count`` the linear layers' key heads, ``ssm.time_step_rank`` their value
heads, ``ssm.state_size`` the key head size, ``ssm.inner_size`` the value heads' total size,
``ssm.conv_kernel``; ``attention.recurrent_layers`` a bool a block (true: Gated DeltaNet),
else every ``full_attention_interval``-th layer (4) attention; ``rope.dimension_count`` the
rotated part of a head (``partial_rotary_factor``) and ``rope.dimension_sections`` its
interleaved multimodal sections (a text token has one position in all of them: plain RoPE
where they cover every rotated pair); ``block_count`` counts the multi-token-prediction
blocks too (``nextn_predict_layers``, last; their tensors are not read).

Tensors, as the converter changes them:
- every RMSNorm but the linear attention's gated one is stored as ``1 + w`` (``w`` here);
- ``A_log`` is stored as ``ssm_a = -exp(A_log)`` (``A_log = log(-ssm_a)`` here), ``dt_bias``
  as ``ssm_dt.bias``, ``conv1d.weight`` ``[channels, 1, kernel]`` squeezed to 2-d (F32);
- where a key head serves several value heads, the value heads are stored tiled (``[k0 v0,
  k1 v0, ..., k0 v1, ...]`` for ggml's broadcast) instead of grouped by key head
  (transformers'): the v rows of ``attn_qkv``, the rows of ``attn_gate`` (z), ``ssm_beta``
  (b), ``ssm_alpha`` (a), ``ssm_a``, ``ssm_dt``, the v channels of ``ssm_conv1d`` and the
  columns of ``ssm_out``. They are left so (the config's ``linear_value_heads_tiled``): the
  layer pairs value head ``j`` with key head ``j mod key heads`` (``gated_deltanet``), which
  computes what transformers computes with the heads in its order, every weight the file's
  blocks as they are;
- the attention's ``attn_q`` holds each head's query and output gate side by side, as
  transformers' ``q_proj`` does (unchanged).

The MoE files (:func:`moe_config`): every block's MLP is ``expert_count`` experts of
``expert_feed_forward_length`` (else ``feed_forward_length`` over the experts used),
``expert_used_count`` a token by the softmax of the router's logits (``ffn_gate_inp``, F32),
the top k renormalized (llama.cpp's ``norm_w``, as transformers' Qwen3.5-MoE and Qwen3-Next
with their default ``norm_topk_prob``), beside a shared expert of
``expert_shared_feed_forward_length`` (else ``feed_forward_length``) gated by the sigmoid of
``ffn_gate_inp_shexp`` (``[1, hidden]``, F32): ``moe.SparseMoE``. The converter splits
transformers' fused ``experts.gate_up_proj`` into ``ffn_gate_exps`` and ``ffn_up_exps`` (a
fused ``ffn_gate_up_exps``, gate rows first, is read too); each expert's slice is its 2-d
weight, blocks as they are. Qwen3.5-MoE's linear layers are Qwen3.5's (value heads tiled).
Qwen3-Next's are not tiled (``Qwen3NextModel`` has no reordering: value heads grouped by key
head, as transformers'); the converter splits its ``in_proj_qkvz`` (rows grouped per key
head) into ``attn_qkv`` (q, k, v of all heads) and ``attn_gate`` (z), which are then
Qwen3.5's ``in_proj_qkv`` / ``in_proj_z``, and writes ``in_proj_ba`` as it is
(``ssm_ba``: per key head its value heads' b, then their a; older files' ``ssm_in`` is
``in_proj_qkvz`` as it is): ``gated_deltanet.unfuse_qwen3_next`` splits them as it does a
checkpoint's. llama.cpp's qwen3next needs every block's router, so a file has no dense
layers (transformers' ``mlp_only_layers``); no rope sections (plain RoPE).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.gguf_reader import array_field, field, require

# A block's tensors, by their names under ``blk.{i}.`` (the multi-token-prediction blocks'
# ``nextn.*`` named so that they can be left out).
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",  # (query and gate, each head's side by side)
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    **{f"nextn.{n}.weight": f"nextn.{n}.weight" for n in (
        "eh_proj", "embed_tokens", "enorm", "hnorm", "shared_head_head", "shared_head_norm")},
}
# The MoE files' experts (module docstring), ``{e}`` the expert (gguf_weights' naming).
_EXPERTS = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    **{f"ffn_{p}_exps.weight": f"mlp.experts.{{e}}.{p}_proj.weight"
       for p in ("gate", "up", "down", "gate_up")},
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    **{f"ffn_{p}_shexp.weight": f"mlp.shared_expert.{p}_proj.weight"
       for p in ("gate", "up", "down")},
}
_MOE_TENSORS = {**{k: v for k, v in LAYER_TENSORS.items() if not k.startswith("ffn_")},
                **_EXPERTS}
# Each architecture's block tensors (gguf_weights' table), and a tensor every layer has.
LAYER_TENSORS_BY_ARCH = {
    "qwen35": LAYER_TENSORS,
    "qwen35moe": _MOE_TENSORS,
    "qwen3next": {**{k: v for k, v in _MOE_TENSORS.items() if k not in (
        "ssm_beta.weight", "ssm_alpha.weight")},
                  "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
                  "ssm_in.weight": "linear_attn.in_proj_qkvz.weight"},  # (older files')
}
EVERY_LAYER = {"qwen35": "mlp.down_proj.weight", "qwen35moe": "mlp.gate.weight",
               "qwen3next": "mlp.gate.weight"}
QWEN35_ARCHS, QWEN35_MOE = tuple(EVERY_LAYER), ("qwen35moe", "qwen3next")
# The norms stored as 1 + w (transformers' Qwen3_5RMSNorm; not linear_attn.norm).
_PLUS_ONE = ("input_layernorm.weight", "post_attention_layernorm.weight",
             "self_attn.q_norm.weight", "self_attn.k_norm.weight")


def _positive(reader: Any, key: str) -> int:
    value = require(reader, key)
    if not isinstance(value, (int, np.integer)) or int(value) < 1:
        raise ModelLoadError(f"GGUF {key} must be a positive integer, not {value!r}; "
                             "re-export the model with llama.cpp")
    return int(value)


def qwen35_config(reader: Any, config: dict[str, Any], rope_dim: int,
                  arch: str = "qwen35") -> dict[str, Any]:
    """The Hugging Face config keys of an ``arch`` file (``qwen35``, ``qwen35moe`` or
    ``qwen3next``: module docstring), over the common ones in ``config``; ``rope_dim`` its
    ``rope.dimension_count``."""
    p = arch + "."
    blocks = config["num_hidden_layers"]
    mtp = int(field(reader, p + "nextn_predict_layers", 0))
    layers = blocks - mtp
    if not 0 <= mtp < blocks:
        raise ModelLoadError(f"GGUF {p}nextn_predict_layers {mtp} leaves no layers of the "
                             f"{blocks} blocks ({p}block_count)")
    recurrent = array_field(reader, p + "attention.recurrent_layers")
    if recurrent is not None:
        if len(recurrent) != blocks:
            raise ModelLoadError(f"GGUF {p}attention.recurrent_layers has {len(recurrent)} "
                                 f"values for {blocks} blocks")
        linear = [bool(r) for r in recurrent[:layers]]
    else:
        interval = _positive(reader, p + "full_attention_interval") if (
            p + "full_attention_interval" in reader.fields) else 4
        linear = [(i + 1) % interval != 0 for i in range(layers)]
    key_heads = _positive(reader, p + "ssm.group_count")
    value_heads = _positive(reader, p + "ssm.time_step_rank")
    inner = _positive(reader, p + "ssm.inner_size")
    if inner % value_heads:
        raise ModelLoadError(f"GGUF {p}ssm.inner_size {inner} does not split into "
                             f"{value_heads} value heads ({p}ssm.time_step_rank)")
    head_dim = config["head_dim"]
    if int(field(reader, p + "attention.value_length", head_dim)) != head_dim:
        raise ModelLoadError(f"GGUF {p}attention.value_length "
                             f"{field(reader, p + 'attention.value_length')} != "
                             f"{p}attention.key_length {head_dim}")
    if not 0 < rope_dim <= head_dim or rope_dim % 2:
        raise ModelLoadError(f"GGUF {p}rope.dimension_count {rope_dim} must be an even number "
                             f"of the {head_dim} dimensions of a head")
    _check_sections(reader, rope_dim, p)
    for key, unscaled in (("rope.scaling.type", "none"), ("rope.scaling.factor", 1.0),
                          ("rope.scale_linear", 1.0)):
        if field(reader, p + key, unscaled) != unscaled:
            raise ModelLoadError(f"GGUF {p}{key} {field(reader, p + key)!r}: FreeToken runs "
                                 "Qwen3.5 files with its default rope only")
    partial = rope_dim / head_dim
    return {
        "model_type": "qwen3_5_text",
        **(moe_config(reader, arch, config) if arch != "qwen35" else {}),
        "num_hidden_layers": layers,
        "layer_types": ["linear_attention" if r else "full_attention" for r in linear],
        "linear_num_key_heads": key_heads,
        "linear_num_value_heads": value_heads,
        "linear_key_head_dim": _positive(reader, p + "ssm.state_size"),
        "linear_value_head_dim": inner // value_heads,
        "linear_conv_kernel_dim": _positive(reader, p + "ssm.conv_kernel"),
        # (the converter's order, kept: module docstring; Qwen3-Next's are not tiled)
        "linear_value_heads_tiled": arch != "qwen3next",
        "partial_rotary_factor": partial,
        "rope_parameters": {"rope_type": "default", "rope_theta": config["rope_theta"],
                            "partial_rotary_factor": partial},
        "rms_norm_eps": float(field(reader, p + "attention.layer_norm_rms_epsilon", 1e-6)),
    }


def moe_config(reader: Any, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """A ``qwen35moe`` / ``qwen3next`` file's experts (module docstring) as the keys of
    transformers' ``Qwen3_5MoeTextConfig`` / ``Qwen3NextConfig``; the routing llama.cpp's
    graph computes for them checked to be what transformers computes."""
    p = arch + "."
    experts = _positive(reader, p + "expert_count")
    used = _positive(reader, p + "expert_used_count")
    if used > experts:
        raise ModelLoadError(f"GGUF {p}expert_used_count {used} exceeds {p}expert_count "
                             f"{experts}")
    dense = config["intermediate_size"]  # (feed_forward_length; 0 where the file has none)
    size = int(field(reader, p + "expert_feed_forward_length", 0)) or dense // used
    shared = int(field(reader, p + "expert_shared_feed_forward_length", 0)) or dense
    if size < 1 or shared < 1:
        raise ModelLoadError(f"GGUF {arch} file lacks {p}expert_feed_forward_length or "
                             f"{p}expert_shared_feed_forward_length (and {p}"
                             "feed_forward_length, llama.cpp's fallback); re-export the model")
    gating = int(field(reader, p + "expert_gating_func", 1))
    scale = float(field(reader, p + "expert_weights_scale", 0.0))
    if gating != 1 or scale not in (0.0, 1.0):
        raise ModelLoadError(f"GGUF {p}expert_gating_func {gating} / expert_weights_scale "
                             f"{scale}: {arch} routes by the softmax (1), unscaled")
    out: dict[str, Any] = {
        "model_type": "qwen3_next" if arch == "qwen3next" else "qwen3_5_moe_text",
        "num_experts": experts, "num_experts_per_tok": used, "moe_intermediate_size": size,
        "shared_expert_intermediate_size": shared, "norm_topk_prob": True,
        "intermediate_size": dense or size}
    if arch == "qwen3next":  # (every layer's MLP sparse: llama.cpp's qwen3next)
        out.update(decoder_sparse_step=1, mlp_only_layers=[])
    return out


def _check_sections(reader: Any, rope_dim: int, p: str) -> None:
    """llama.cpp's interleaved multimodal rope (``ggml_mrope_cache_init``, ``is_imrope``)
    turns pair ``i`` at the time, height or width position (a text token's one position) where
    its sector ``s = i % sum(sections)`` is below ``3 * sections[s % 3]``, else at the fourth
    (0 for text: not turning); FreeToken turns them all, so the sections must cover them."""
    sections = array_field(reader, p + "rope.dimension_sections")
    if sections is None:
        return
    values = [int(s) for s in list(sections)[:4]]
    total = sum(values)
    left = [i for i in range(rope_dim // 2) if total == 0
            or (i % total) >= 3 * (values + [0, 0, 0])[(i % total) % 3]]
    if left:
        raise ModelLoadError(f"GGUF {p}rope.dimension_sections {values} leave {len(left)} of "
                             f"the {rope_dim // 2} rotated pairs out (from pair {left[0]}); "
                             "FreeToken serves files whose sections cover them all")


def hf_weights(reader: Any, weights: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """``weights`` (a ``qwen35``, ``qwen35moe`` or ``qwen3next`` file's, under the Hugging
    Face names of :data:`LAYER_TENSORS_BY_ARCH`) as transformers' checkpoint holds them: the
    module docstring's changes undone; the multi-token-prediction blocks' tensors left
    out."""
    import torch

    out: dict[str, Any] = {}
    for name, w in weights.items():
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and int(parts[2]) >= num_layers:
            continue  # (a multi-token-prediction block)
        if name == "model.norm.weight" or name.endswith(_PLUS_ONE):
            w = w - 1.0
        elif name.endswith(".A_log"):
            if not bool(torch.all(w <= 0)):
                raise ModelLoadError(f"GGUF tensor {name} (ssm_a) holds values above 0; llama.cpp "
                                     "stores -exp(A_log) there - re-export the model")
            w = torch.log(-w)
        elif name.endswith(".conv1d.weight") and not isinstance(w, torch.Tensor):
            w = w.dequantize()
        out[name] = w
    return out
