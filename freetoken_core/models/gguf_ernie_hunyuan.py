"""ERNIE 4.5 MoE and Hunyuan MoE GGUF files (``general.architecture`` ``ernie4_5-moe``:
ERNIE-4.5-21B-A3B, 300B-A47B; ``hunyuan-moe``: Hunyuan-A13B), as llama.cpp's converter
writes them (``conversion/ernie.py`` ``Ernie4_5MoeModel``, ``conversion/hunyuan.py``
``HunYuanMoEModel``) and its ``src/models/ernie4-5-moe.cpp`` / ``hunyuan-moe.cpp`` compute
them: the metadata as the Hugging Face config keys transformers' classes read (which
``config_defaults.ernie4_5_moe_fields`` / ``hunyuan_moe_fields`` make FreeToken's), and the
tensor names. Both converters write the checkpoint's tensors as they are (q/k rows unpermuted:
llama.cpp turns ERNIE's adjacent pairs, ``ROPE_TYPE_NORM``, as transformers does and
``ernie4_5.py`` reorders at load, and Hunyuan's half-offset ones) and stack each layer's
experts into 3-d tensors. Both graphs route by the softmax of the router's logits, the top k
rescaled to sum to 1, and read no ``expert_gating_func``, ``expert_weights_scale`` or
``expert_weights_norm``: FreeToken, as llama.cpp, ignores them in these files.

``ernie4_5-moe.``:

- ``expert_count``, ``expert_used_count``, ``expert_feed_forward_length`` (``moe_num_experts``,
  ``moe_k``, ``moe_intermediate_size``);
- ``leading_dense_block_count`` (``moe_layer_start_index``; none: 0, as llama.cpp reads it) and
  ``interleave_moe_layer_step`` (``moe_layer_interval``, required): layer i has experts where
  i >= lead and (i + 1) % step == 0, transformers' rule with ``moe_layer_end_index`` the
  last layer (the converter writes no end);
- ``expert_shared_count`` (``moe_num_shared_experts``) and
  ``expert_shared_feed_forward_length``, which the converter writes as ``intermediate_size //
  num_key_value_heads`` (ERNIE-4.5-21B-A3B's two shared experts' 2 x 1,536): llama.cpp runs
  a shared expert of that width where it is above 0, transformers one of
  ``moe_intermediate_size`` x count where the count is; a file where they disagree is refused;
- the router's selection bias ``exp_probs_b.bias`` (``e_score_correction_bias``, ``[1,
  experts]`` as the checkpoints hold it), which chooses the experts and does not weight them;
  required (every checkpoint has one; llama.cpp chooses without one where it is missing);
- no biases: llama.cpp's graph drops ``attn_output.bias`` and loads no MLP's, transformers'
  ``use_bias`` adds the attention's, the dense and shared MLPs' and the head's (the released
  models have none).

``hunyuan-moe.``: ``expert_count``, ``expert_used_count`` (``num_experts``, ``moe_topk``),
experts of ``expert_feed_forward_length`` in every layer beside a shared SwiGLU MLP of
``expert_shared_feed_forward_length`` (none or 0: ``feed_forward_length``, as llama.cpp reads
it; ``expert_shared_count`` is not read), which transformers computes both of
``intermediate_size``: a file where they differ is refused. The q/k norms apply to the rotated
heads, as in ``hunyuan-dense`` files; the checkpoints' NTK-alpha rope (type ``dynamic`` with
``alpha``) is written as the base ``rope.freq_base`` (``rope_theta * alpha ** (d / (d -
2))``, scaling type none): the default rope of that base. No biases (Hunyuan-A13B has none;
llama.cpp's graph drops ``attn_output.bias``).

Both: a scaled rope (``rope.scaling.type`` linear, YaRN ...) is refused, as from directories
(the checkpoints scale none).
"""

from __future__ import annotations

from typing import Any

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.gguf_reader import array_field, field, require

# Both families' attention and norms, by the tensors' names under ``blk.{i}.``.
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
}
# The experts (``{e}``: an expert of a 3-d tensor), their router and the shared expert.
_EXPERTS = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    **{f"ffn_{p}_exps.weight": f"mlp.experts.{{e}}.{p}_proj.weight"
       for p in ("gate", "up", "down")},
    **{f"ffn_{p}_shexp.weight": f"mlp.shared_experts.{p}_proj.weight"
       for p in ("gate", "up", "down")},
}
ERNIE4_5_MOE_TENSORS = {
    **_BLOCK, **_EXPERTS,
    "exp_probs_b.bias": "mlp.expert_bias",  # (FreeToken's name of e_score_correction_bias)
    **{f"ffn_{p}.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
}
HUNYUAN_MOE_TENSORS = {
    **_BLOCK, **_EXPERTS,
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_ROUTED = ("ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight",
           "ffn_down_exps.weight")
_SHARED = ("ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight")
_DENSE = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")


def ernie4_5_moe_config(reader: Any, config: dict[str, Any], names: set[str]
                        ) -> dict[str, Any]:
    """The config keys of an ``ernie4_5-moe`` file (module docstring), beside the common ones
    in ``config``; ``names``: the file's tensors."""
    p = "ernie4_5-moe."
    layers = config["num_hidden_layers"]
    experts, used = _experts(reader, p)
    lead = int(field(reader, p + "leading_dense_block_count", 0))
    step = int(require(reader, p + "interleave_moe_layer_step"))
    if step < 1 or not 0 <= lead <= layers:
        raise ModelLoadError(f"GGUF {p}interleave_moe_layer_step {step} / "
                             f"leading_dense_block_count {lead}: the step must be at least 1 "
                             f"and the dense lead between 0 and the {layers} layers")
    sparse = [i for i in range(layers) if i >= lead and (i + 1) % step == 0]
    size = _expert_size(reader, p, sparse)
    shared = int(field(reader, p + "expert_shared_count", 0))
    width = int(field(reader, p + "expert_shared_feed_forward_length", 0))
    if width != size * shared:
        raise ModelLoadError(
            f"GGUF {p}expert_shared_feed_forward_length {width} is not {p}"
            f"expert_shared_count {shared} x expert_feed_forward_length {size}: llama.cpp "
            "would compute a shared expert of that width, transformers one of the count's; "
            "re-export the model")
    _refuse_biases(p, names, allowed="exp_probs_b.bias")
    _refuse_rope_scaling(reader, p)
    for i in range(layers):
        moe = i in sparse
        wanted = (*_ROUTED, "exp_probs_b.bias", *(_SHARED if shared else ())) if moe else _DENSE
        _require_tensors(p, names, i, wanted, "an expert layer" if moe else "a dense layer",
                         "leading_dense_block_count and interleave_moe_layer_step")
    return {"model_type": "ernie4_5_moe", "use_bias": False, "moe_num_experts": experts,
            "moe_k": used, "moe_intermediate_size": size, "moe_num_shared_experts": shared,
            "moe_layer_start_index": lead, "moe_layer_end_index": -1,
            "moe_layer_interval": step}


def hunyuan_moe_config(reader: Any, config: dict[str, Any], names: set[str]
                       ) -> dict[str, Any]:
    """The config keys of a ``hunyuan-moe`` file (module docstring), beside the common ones
    in ``config``; ``names``: the file's tensors."""
    p = "hunyuan-moe."
    layers = config["num_hidden_layers"]
    experts, used = _experts(reader, p)
    size = _expert_size(reader, p, list(range(layers)))
    shared = int(field(reader, p + "expert_shared_feed_forward_length", 0)) or config[
        "intermediate_size"]
    if shared != size:
        raise ModelLoadError(
            f"GGUF {p}expert_shared_feed_forward_length {shared} (the shared MLP's width; "
            f"none: feed_forward_length) != {p}expert_feed_forward_length {size}: "
            "transformers' Hunyuan MoE computes both of intermediate_size; FreeToken runs "
            "files where they are equal")
    _refuse_biases(p, names)
    _refuse_rope_scaling(reader, p)
    for i in range(layers):
        _require_tensors(p, names, i, (*_ROUTED, *_SHARED, "attn_q_norm.weight",
                                       "attn_k_norm.weight"), "a layer", "")
    return {"model_type": "hunyuan_v1_moe", "num_experts": experts, "moe_topk": used,
            "intermediate_size": size}


def _experts(reader: Any, p: str) -> tuple[int, int]:
    """``expert_count`` and ``expert_used_count``, checked (1 <= used <= count)."""
    experts = int(field(reader, p + "expert_count", 0))
    used = int(field(reader, p + "expert_used_count", 0))
    if experts < 1 or not 1 <= used <= experts:
        raise ModelLoadError(f"GGUF {p}expert_count {experts} / expert_used_count {used}: a "
                             "mixture of experts needs 1 <= used <= count")
    return experts, used


def _expert_size(reader: Any, p: str, sparse: list[int]) -> int:
    """``expert_feed_forward_length`` (required, as llama.cpp reads it): the file's number,
    or the one number of every layer of ``sparse`` in its array."""
    key = p + "expert_feed_forward_length"
    sizes = array_field(reader, key)
    if sizes is None:
        return int(require(reader, key))
    found = {int(sizes[i]) for i in sparse if i < len(sizes)}
    if len(found) != 1:
        raise ModelLoadError(f"GGUF {key} {list(map(int, sizes))} does not give every expert "
                             "layer one size; FreeToken runs experts of one size")
    return found.pop()


def _refuse_biases(p: str, names: set[str], allowed: str = "") -> None:
    """A bias of a linear (attention, MLP, head) is refused naming it (module docstring)."""
    biases = sorted(n for n in names if n.endswith(".bias") and not (
        allowed and n.endswith("." + allowed)))
    if biases:
        raise ModelLoadError(f"GGUF tensor {biases[0]!r}: {p.rstrip('.')} files with biases "
                             "on their linears are not supported (llama.cpp's graph drops "
                             "attn_output.bias; the released models have none)")


def _refuse_rope_scaling(reader: Any, p: str) -> None:
    """A scaled rope (``rope.scaling.type`` other than none, of a factor other than 1) is
    refused naming the key: the checkpoints scale none (Hunyuan's NTK-alpha is the base
    itself), and FreeToken computes these families' rope unscaled, as from directories."""
    kind = field(reader, p + "rope.scaling.type")
    factor = float(field(reader, p + "rope.scaling.factor", 1.0))
    if kind not in (None, "none") and factor != 1.0:
        raise ModelLoadError(f"GGUF {p}rope.scaling.type {kind!r} (factor {factor:g}) is not "
                             f"supported for {p.rstrip('.')}: FreeToken computes its rope "
                             "unscaled, as its checkpoints have it")


def _require_tensors(p: str, names: set[str], layer: int, wanted: tuple[str, ...], kind: str,
                     keys: str) -> None:
    """Each of ``wanted`` is in layer ``layer`` of the file, else an error naming the first
    missing (``keys``: the metadata that made the layer ``kind``)."""
    missing = [w for w in wanted if f"blk.{layer}.{w}" not in names]
    if missing:
        why = f" ({p.rstrip('.')}'s {keys} make it {kind})" if keys else ""
        raise ModelLoadError(f"GGUF file lacks 'blk.{layer}.{missing[0]}'{why}; the file is "
                             "incomplete or its metadata inconsistent - re-export the model")
