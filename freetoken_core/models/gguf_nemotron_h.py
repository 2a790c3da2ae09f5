"""Nemotron-H GGUF files, as llama.cpp's converter writes them (``conversion/nemotron.py``
``NemotronHModel`` over Granite 4's ``GraniteHybridModel``) and its
``src/models/nemotron-h.cpp`` reads them: ``general.architecture`` ``nemotron_h``
(Nemotron-H, Nemotron Nano 2) or, where the checkpoint has experts, ``nemotron_h_moe``
(Nemotron 3 Nano). The metadata becomes the Hugging Face config keys ``config_nemotron_h``
reads, the tensors transformers' (``nemotron_h.py``).

Metadata (``{arch}.``):
- the blocks' kinds from two arrays of a value a block (llama.cpp's rule):
  ``attention.head_count_kv`` and ``feed_forward_length`` both 0, Mamba-2; only
  ``feed_forward_length`` 0, attention; else the ReLU² MLP of that length (``-``), or the
  experts where ``expert_count`` is not 0 (``E``);
- the attention's ``attention.head_count``, ``key_length`` and the attention blocks' one KV
  head count; no positions (the converter writes a meaningless ``rope.dimension_count``,
  hidden / heads, and a context length of 2^20); ``attention.scale`` other than
  1/sqrt(key_length) is refused;
- ``attention.layer_norm_epsilon`` (the converter writes the config's ``layer_norm_epsilon``
  there; an ``attention.layer_norm_rms_epsilon`` wins, as in llama.cpp);
- the Mamba-2 shape from ``ssm.*`` (``gguf_mamba2.ssm_shape``);
- the experts: ``expert_count``, ``expert_used_count``, ``expert_feed_forward_length`` (else
  the blocks' ``feed_forward_length`` over the experts used, llama.cpp's fallback),
  ``expert_shared_feed_forward_length`` the shared expert's, ``expert_weights_norm``
  (``norm_topk_prob``; none: off, as llama.cpp reads it), ``expert_weights_scale``
  (``routed_scaling_factor``; 0 or none: 1), ``expert_group_count`` /
  ``expert_group_used_count`` (``n_group`` / ``topk_group``); sigmoid scores plus the
  selection bias ``exp_probs_b.bias`` (``e_score_correction_bias``), as llama.cpp's graph
  computes them whatever ``expert_gating_func`` says. ``moe_latent_size`` (Nemotron 3 Super's
  latent projection), a number of experts used or an expert size a block (Puzzle's) are
  refused;
- ``nextn_predict_layers``: the multi-token-prediction block the converter appends to
  ``block_count`` (its tensors beside a whole block's), which transformers and FreeToken do
  not run: dropped.

Tensors, as the converter changes them: the Mamba-2 mixers' small tensors
(``gguf_mamba2.hf_mamba2_weights``); the attention's q/k rows permuted for llama.cpp's rotary
pairs (``LlamaModel.permute``: the scores of attention without positions do not change, but
the rows are put back, ``gguf_weights``, so the model holds transformers' tensors); each
block's experts stacked into ``ffn_up_exps`` / ``ffn_down_exps`` (read an expert at a time).
"""

from __future__ import annotations

import math
import re
from typing import Any

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.gguf_mamba2 import hf_mamba2_weights, ssm_shape
from freetoken_core.models.gguf_reader import array_field, field, require

ARCHITECTURES = ("nemotron_h", "nemotron_h_moe")
_MTP = "mtp."  # (the prediction block's own tensors, dropped with it: hf_weights)
# A block's tensors, by their names under ``blk.{i}.`` (transformers' under
# ``model.layers.{i}.``; ``{e}``: an expert of a 3-d tensor).
LAYER_TENSORS = {
    "attn_norm.weight": "norm.weight",
    **{f"ssm_{g}": f"mixer.{h}" for g, h in (
        ("in.weight", "in_proj.weight"), ("conv1d.weight", "conv1d.weight"),
        ("conv1d.bias", "conv1d.bias"), ("dt.bias", "dt_bias"), ("a", "A_log"), ("d", "D"),
        ("norm.weight", "norm.weight"), ("out.weight", "out_proj.weight"))},
    **{f"attn_{g}.weight": f"mixer.{h}_proj.weight" for g, h in (
        ("q", "q"), ("k", "k"), ("v", "v"), ("output", "o"))},
    "attn_output.bias": "mixer.o_proj.bias",
    **{f"ffn_{p}.{kind}": f"mixer.{p}_proj.{kind}" for p in ("up", "down")
       for kind in ("weight", "bias")},
    "ffn_gate_inp.weight": "mixer.gate.weight",
    "exp_probs_b.bias": "mixer.gate.e_score_correction_bias",
    "ffn_up_exps.weight": "mixer.experts.{e}.up_proj.weight",
    "ffn_down_exps.weight": "mixer.experts.{e}.down_proj.weight",
    "ffn_up_shexp.weight": "mixer.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mixer.shared_experts.down_proj.weight",
    # the prediction block's (its attention's and experts' names are the ones above)
    **{f"nextn.{n}.weight": f"{_MTP}{n}.weight"
       for n in ("enorm", "hnorm", "eh_proj", "shared_head_norm")},
    "post_attention_norm.weight": _MTP + "post_attention_norm.weight",
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def nemotron_h_config(reader: Any, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """The Hugging Face config keys (``NemotronHConfig``'s) of an ``arch`` file (module
    docstring), over the common ones in ``config``."""
    p = f"{arch}."
    blocks = config["num_hidden_layers"]
    nextn = int(field(reader, p + "nextn_predict_layers", 0))
    if not 0 <= nextn < blocks:
        raise ModelLoadError(f"GGUF {p}nextn_predict_layers {nextn} must be at least 0 and "
                             f"fewer than {p}block_count {blocks} (the prediction block comes "
                             "after the model's own)")
    if nextn and not any(t.name == "blk.0.attn_norm.weight" for t in reader.tensors):
        raise ModelLoadError(f"GGUF {arch} file holds the multi-token-prediction block alone "
                             "(the converter's --mtp, mtp-*.gguf); serve the model's main "
                             "GGUF file")
    layers = blocks - nextn
    kv, ff = (_per_block(reader, p + key, blocks)[:layers]
              for key in ("attention.head_count_kv", "feed_forward_length"))
    experts = int(field(reader, p + "expert_count", 0))
    types = ["linear_attention" if k == 0 and f == 0 else "full_attention" if f == 0
             else "moe" if experts else "mlp" for k, f in zip(kv, ff)]
    kv_heads = {k for k, t in zip(kv, types) if t == "full_attention"}
    sizes = {f for f, t in zip(ff, types) if t in ("mlp", "moe")}
    if len(kv_heads) > 1 or (len(sizes) > 1 and not experts):
        key = "attention.head_count_kv" if len(kv_heads) > 1 else "feed_forward_length"
        raise ModelLoadError(f"GGUF {p}{key} {kv if len(kv_heads) > 1 else ff}: FreeToken runs "
                             "files whose attention blocks all have the same KV heads and "
                             "whose MLP blocks are all of one size")
    head_dim = config["head_dim"]
    scale = float(field(reader, p + "attention.scale", 0.0))
    if scale and not math.isclose(scale, head_dim ** -0.5, rel_tol=1e-6):
        raise ModelLoadError(f"GGUF {p}attention.scale {scale}: FreeToken runs Nemotron-H's "
                             f"attention scaled by 1/sqrt({p}attention.key_length)")
    eps = field(reader, p + "attention.layer_norm_rms_epsilon")
    ssm = ssm_shape(reader, p)
    out: dict[str, Any] = {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
        "layers_block_type": types, "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads.pop() if kv_heads else config["num_attention_heads"],
        "intermediate_size": next(iter(sizes)) if sizes and not experts else 0,
        "rms_norm_eps": float(eps if eps is not None else
                              require(reader, p + "attention.layer_norm_epsilon")),
        "mamba_num_heads": ssm.heads, "mamba_head_dim": ssm.head_dim, "n_groups": ssm.groups,
        "ssm_state_size": ssm.state, "conv_kernel": ssm.conv}
    if experts:
        out.update(_experts(reader, p, experts, sizes))
    return out


def _per_block(reader: Any, key: str, blocks: int) -> list[int]:
    """``key``'s value of each of the ``blocks`` blocks: its array (which must have one a
    block) or its one number for all; required."""
    values = array_field(reader, key)
    if values is None:
        return [int(require(reader, key))] * blocks
    if len(values) != blocks:
        raise ModelLoadError(f"GGUF {key} has {len(values)} values for {blocks} blocks")
    return [int(v) for v in values]


def _experts(reader: Any, p: str, experts: int, sizes: set[int]) -> dict[str, Any]:
    """The experts' config keys of a ``nemotron_h_moe`` file (module docstring); ``sizes``
    the expert blocks' ``feed_forward_length``."""
    if field(reader, p + "moe_latent_size") is not None:
        raise ModelLoadError(f"GGUF {p}moe_latent_size (a latent projection around the "
                             "experts: Nemotron 3 Super) is not supported")
    if array_field(reader, p + "expert_used_count") is not None:
        raise ModelLoadError(f"GGUF {p}expert_used_count is a number a block (Nemotron "
                             "Puzzle's experts); FreeToken runs one number for all")
    used = int(require(reader, p + "expert_used_count"))
    if not 1 <= used <= experts:
        raise ModelLoadError(f"GGUF {p}expert_count {experts} / expert_used_count {used}: a "
                             "mixture of experts needs 1 <= used <= count")
    size = _expert_size(reader, p, used, sizes)
    groups = int(field(reader, p + "expert_group_count", 1)) or 1
    keep = int(field(reader, p + "expert_group_used_count", 1 if groups == 1 else 0))
    if experts % groups or not 1 <= keep <= groups:
        raise ModelLoadError(f"GGUF {p}expert_group_count {groups} / expert_group_used_count "
                             f"{keep}: the {experts} experts must split into equal groups, of "
                             "which 1 to all are used")
    scale = float(field(reader, p + "expert_weights_scale", 0.0))
    return {"n_routed_experts": experts, "num_experts_per_tok": used,
            "moe_intermediate_size": size,
            "moe_shared_expert_intermediate_size": int(
                require(reader, p + "expert_shared_feed_forward_length")),
            "n_group": groups, "topk_group": keep,
            "norm_topk_prob": bool(field(reader, p + "expert_weights_norm", False)),
            "routed_scaling_factor": scale or 1.0}


def _expert_size(reader: Any, p: str, used: int, sizes: set[int]) -> int:
    """``expert_feed_forward_length``: its number, or the one nonzero value of its array;
    where it is missing, llama.cpp's fallback: the expert blocks' ``feed_forward_length``
    (``sizes``) over the ``used`` experts."""
    key = p + "expert_feed_forward_length"
    per_block = array_field(reader, key)
    if per_block is not None:
        found = {int(v) for v in per_block} - {0}
        if len(found) != 1:
            raise ModelLoadError(f"GGUF {key} {[int(v) for v in per_block]}: FreeToken runs "
                                 "experts of one size")
        return found.pop()
    size = int(field(reader, key, 0))
    if size:
        return size
    if len(sizes) != 1:
        raise ModelLoadError(f"GGUF lacks {key!r} and its expert blocks' "
                             f"feed_forward_length {sorted(sizes)} are not one size")
    return next(iter(sizes)) // used


def hf_weights(weights: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """``weights`` (the file's, under the names of :data:`LAYER_TENSORS`) as transformers'
    checkpoint holds them: the Mamba-2 mixers' small tensors undone
    (``gguf_mamba2.hf_mamba2_weights``), the prediction block's tensors (of the blocks from
    ``num_layers`` on) dropped."""
    kept = {name: w for name, w in weights.items()
            if not ((m := _LAYER.match(name)) and int(m.group(1)) >= num_layers)}
    return hf_mamba2_weights(kept, "mixer")
