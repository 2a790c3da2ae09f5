"""GLM-4.5 GGUF files (``general.architecture`` ``glm4moe``: GLM-4.5, GLM-4.5-Air, GLM-4.6),
as llama.cpp's converter writes them (``conversion/glm.py`` ``Glm4MoeModel``) and its
``src/models/glm4-moe.cpp`` reads them: the metadata as the Hugging Face config keys
``config_moe.glm4_moe_fields`` reads, and the tensor names. The converter writes the
checkpoint's tensors as they are (q/k rows unpermuted: llama.cpp rotates glm4moe in NEOX
pairs, transformers' ``rotate_half`` over the first ``rope.dimension_count`` dimensions of a
head), stacks each layer's experts into 3-d tensors, and writes:

- ``block_count``: the model's layers *plus* its ``nextn_predict_layers`` multi-token-
  prediction layers (``blk.{n}`` on, with ``nextn.*`` tensors beside a whole block), which
  llama.cpp runs only to draft tokens and FreeToken, as transformers, does not run (they get
  the checkpoint's names, ``model.layers.{n}.*``, which ``Glm4MoeForCausalLM`` drops);
- ``rope.dimension_count``: the rotated part of a head (transformers'
  ``partial_rotary_factor``, 0.5);
- ``expert_count``, ``expert_used_count``, ``expert_feed_forward_length``,
  ``expert_shared_count`` (``n_shared_experts`` ungated shared experts, ``ffn_*_shexp``, of
  ``expert_feed_forward_length`` times that count), ``expert_group_count`` /
  ``expert_group_used_count`` (``n_group`` / ``topk_group``, default 1),
  ``leading_dense_block_count`` (``first_k_dense_replace``, default 0: llama.cpp's),
  ``expert_gating_func`` 2 (sigmoid; llama.cpp takes 0 or none as sigmoid too; the rest is
  refused in ``gguf_families.moe_config``), ``expert_weights_scale``
  (``routed_scaling_factor``; 0 or none: 1), ``expert_weights_norm`` (``norm_topk_prob``;
  none: off, as llama.cpp reads it) and the router's selection bias
  ``exp_probs_b.bias`` (``e_score_correction_bias``).
"""

from __future__ import annotations

import re
from typing import Any

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.gguf_name_parts import (
    ATTENTION,
    MLP,
    MOE,
    SELECTION_BIAS,
    SHARED_EXPERTS,
)
from freetoken_core.models.gguf_reader import array_field, field, require

_P = "glm4moe."
_NEXTN = re.compile(r"^blk\.(\d+)\.nextn\.")
# The multi-token-prediction layers' own tensors (the checkpoint's names; not read: the
# model drops every layer past its own, ``glm4_moe.drop_extra_layers``).
NEXTN_TENSORS = {
    "nextn.eh_proj.weight": "eh_proj.weight",
    "nextn.embed_tokens.weight": "embed_tokens.weight",
    "nextn.enorm.weight": "enorm.weight",
    "nextn.hnorm.weight": "hnorm.weight",
    "nextn.shared_head_head.weight": "shared_head.head.weight",
    "nextn.shared_head_norm.weight": "shared_head.norm.weight",
}
# A block's tensors, by their names under ``blk.{i}.`` (``{e}``: an expert of a 3-d tensor).
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    **ATTENTION, **MLP, **MOE, **SELECTION_BIAS, **SHARED_EXPERTS,
    "ffn_gate_up_exps.weight": "mlp.experts.{e}.gate_up_proj.weight",  # (--fuse-gate-up)
    **NEXTN_TENSORS,
}


def glm4moe_config(reader: Any, rope_fraction: float) -> dict[str, Any]:
    """The config keys of a ``glm4moe`` file's layers and attention (module docstring):
    ``num_hidden_layers`` without the prediction layers, the rotated fraction of each head,
    q/k norms where the file has them (GLM-4.5's; GLM-4.5-Air has none). M-RoPE files
    (``rope.dimension_sections``: GLM-4.5V's language model) are refused."""
    if array_field(reader, _P + "rope.dimension_sections") is not None or field(
            reader, _P + "rope.dimension_sections") is not None:
        raise ModelLoadError("GGUF glm4moe with glm4moe.rope.dimension_sections (M-RoPE, the "
                             "GLM-4.5V vision models) is not supported; FreeToken runs the "
                             "text-only GLM-4.5 files (GLM-4.5, GLM-4.5-Air, GLM-4.6)")
    blocks = int(require(reader, _P + "block_count"))
    nextn = int(field(reader, _P + "nextn_predict_layers", 0))
    if not 0 <= nextn < blocks:
        raise ModelLoadError(f"GGUF {_P}nextn_predict_layers {nextn} must be at least 0 and "
                             f"fewer than {_P}block_count {blocks} (the prediction layers "
                             "come after the model's own)")
    names = {t.name for t in reader.tensors}
    if nextn and "blk.0.attn_norm.weight" not in names:
        raise ModelLoadError("GGUF glm4moe file holds the multi-token-prediction layers alone "
                             "(the converter's --mtp-only, mtp-*.gguf); serve the model's "
                             "main GGUF file")
    early = sorted(n for n in names if (m := _NEXTN.match(n)) and int(m.group(1)) < blocks - nextn)
    if early:
        raise ModelLoadError(f"GGUF tensor {early[0]!r} belongs to a multi-token-prediction "
                             f"layer, but {_P}nextn_predict_layers ({nextn}) of "
                             f"{_P}block_count ({blocks}) make its block one of the model's; "
                             "the file's metadata is inconsistent - re-export the model")
    return {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
            "num_hidden_layers": blocks - nextn, "num_nextn_predict_layers": nextn,
            "partial_rotary_factor": rope_fraction,
            "use_qk_norm": "blk.0.attn_q_norm.weight" in names}


def glm4moe_experts(reader: Any, config: dict[str, Any], experts: int, used: int,
                    prefix: str = _P) -> dict[str, Any]:
    """The experts' config keys of a ``glm4moe`` file (module docstring; a ``dots1`` file's
    are the same keys under its ``prefix``), beside ``moe_config``'s ``num_experts_per_tok``
    and ``routed_scaling_factor``: llama.cpp requires ``expert_shared_count``; its
    ``expert_feed_forward_length`` may be a number a layer, which FreeToken takes where
    every sparse layer's is the same."""
    layers = config["num_hidden_layers"]
    dense = int(field(reader, prefix + "leading_dense_block_count", 0))
    if not 0 <= dense <= layers:
        raise ModelLoadError(f"GGUF {prefix}leading_dense_block_count {dense} is not between 0 "
                             f"and the {layers} layers")
    size = _expert_size(reader, dense, layers, prefix) or config["intermediate_size"] // used
    groups = int(field(reader, prefix + "expert_group_count", 1)) or 1
    keep = int(field(reader, prefix + "expert_group_used_count", 1)) or 1
    if experts % groups or not 1 <= keep <= groups:
        raise ModelLoadError(f"GGUF {prefix}expert_group_count {groups} / "
                             f"expert_group_used_count {keep}: the {experts} experts must "
                             "split into equal groups, of which 1 to all are used")
    return {"n_routed_experts": experts, "moe_intermediate_size": size,
            "n_shared_experts": int(require(reader, prefix + "expert_shared_count")),
            "n_group": groups, "topk_group": keep, "first_k_dense_replace": dense,
            "norm_topk_prob": bool(field(reader, prefix + "expert_weights_norm", False))}


def _expert_size(reader: Any, dense: int, layers: int, prefix: str) -> int:
    """``expert_feed_forward_length``: the file's number, or the one number of every sparse
    layer's in its array; 0 where the file has none."""
    key = prefix + "expert_feed_forward_length"
    sizes = array_field(reader, key)
    if sizes is None:
        return int(field(reader, key, 0))
    sparse = {int(s) for s in list(sizes)[dense:layers]}
    if len(sparse) > 1:
        raise ModelLoadError(f"GGUF {key} differs between the sparse layers "
                             f"({sorted(sparse)}); FreeToken runs experts of one size")
    return sparse.pop() if sparse else 0
