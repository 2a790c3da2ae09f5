"""DeepSeek-V2/V3 GGUF files (``general.architecture`` ``deepseek2``: DeepSeek-V2, V2-Lite,
V2.5, V3, R1, V3.1, Kimi K2, Moonlight, GLM-4.7-Flash), as llama.cpp's converter writes them
(``conversion/deepseek.py`` ``DeepseekV2Model``, ``conversion/glm.py``
``Glm4MoeLiteModel``) and its ``src/models/deepseek2.cpp`` reads them: the metadata as the
Hugging Face config keys ``config_deepseek`` reads, and the tensor names. The converter
writes the checkpoint's tensors as they are (the rotated rows on adjacent pairs, unpermuted:
llama.cpp rotates ``deepseek2`` in NORM pairs), stacks each layer's experts into 3-d
tensors, and splits each layer's ``kv_b_proj`` per head into ``attn_k_b`` (``[heads,
kv_lora_rank, qk_nope_head_dim]``: ``W_UK`` transposed, the absorbed query's linear) and
``attn_v_b`` (``[heads, v_head_dim, kv_lora_rank]``: ``W_UV``), which FreeToken keeps as one
linear of GGUF blocks a head (older files' unsplit ``attn_kv_b`` is read too). Its keys:

- ``attention.head_count_kv`` 1 and ``attention.key_length`` / ``value_length`` the latent
  cache's (``kv_lora_rank + qk_rope_head_dim`` / ``kv_lora_rank``), the heads' sizes in
  ``attention.key_length_mla`` / ``value_length_mla`` (older files: the heads' sizes in
  ``key_length`` / ``value_length``, no ``_mla`` keys); ``attention.q_lora_rank`` (none:
  queries from ``attn_q``), ``attention.kv_lora_rank``, ``rope.dimension_count``
  (``qk_rope_head_dim``);
- ``block_count`` with the ``nextn_predict_layers`` multi-token-prediction layers (not
  read), ``leading_dense_block_count`` (``first_k_dense_replace``);
- ``expert_count`` / ``expert_used_count`` / ``expert_feed_forward_length`` /
  ``expert_shared_count``, ``expert_group_count`` / ``expert_group_used_count``,
  ``expert_weights_scale`` / ``expert_weights_norm``, ``expert_gating_func`` (2: sigmoid,
  V3's; 1: softmax, V2's; none: llama.cpp's guess, sigmoid for GLM-4.7-Flash's 47/48 layers
  and 154,880 tokens, else softmax) and the selection bias ``exp_probs_b.bias``; a V2 file
  with groups is routed among the groups of the best single probability (transformers'
  ``group_limited_greedy``; llama.cpp sums each group's two best);
- YaRN's ``rope.scaling.*`` with ``yarn_log_multiplier`` (``0.1 mscale_all_dim``), which
  FreeToken reads as ``mscale`` and ``mscale_all_dim`` both (the released checkpoints'
  equal values: no attention factor on the rotation, ``mscale_all_dim`` in the score
  scale)."""

from __future__ import annotations

import re
from typing import Any

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.gguf_glm4moe import NEXTN_TENSORS
from freetoken_core.models.gguf_name_parts import MLP, MOE, SELECTION_BIAS, SHARED_EXPERTS
from freetoken_core.models.gguf_reader import field, require

_P = "deepseek2."
_NEXTN = re.compile(r"^blk\.(\d+)\.nextn\.")
# A block's tensors, by their names under ``blk.{i}.`` (``{e}``: an expert, or a head of
# the split kv_b).
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_k_b.weight": "self_attn.k_b_proj.{e}.weight",
    "attn_v_b.weight": "self_attn.v_b_proj.{e}.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **MLP, **MOE, **SELECTION_BIAS, **SHARED_EXPERTS,
    **NEXTN_TENSORS,
}
_SIGMOID, _SOFTMAX = 2, 1  # (llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_*)


def deepseek2_config(reader: Any, hidden: int, heads: int, vocab: int, names: set[str]
                     ) -> dict[str, Any]:
    """The ``config.json`` keys of a ``deepseek2`` file (module docstring): a
    ``DeepseekV3ForCausalLM`` where its experts are scored by sigmoids, else a
    ``DeepseekV2ForCausalLM``."""
    blocks = int(require(reader, _P + "block_count"))
    nextn = int(field(reader, _P + "nextn_predict_layers", 0))
    if not 0 <= nextn < blocks:
        raise ModelLoadError(f"GGUF {_P}nextn_predict_layers {nextn} must be at least 0 and "
                             f"fewer than {_P}block_count {blocks}")
    if nextn and "blk.0.attn_norm.weight" not in names:
        raise ModelLoadError("GGUF deepseek2 file holds the multi-token-prediction layers "
                             "alone (the converter's --mtp-only); serve the model's main file")
    layers = blocks - nextn
    rope = int(require(reader, _P + "rope.dimension_count"))
    kv_lora = int(require(reader, _P + "attention.kv_lora_rank"))
    if field(reader, _P + "attention.key_length_mla") is not None:
        qk_dim = int(require(reader, _P + "attention.key_length_mla"))
        v_dim = int(require(reader, _P + "attention.value_length_mla"))
    else:  # (files written before the absorbed split: the heads' sizes, attn_kv_b)
        qk_dim = int(require(reader, _P + "attention.key_length"))
        v_dim = int(require(reader, _P + "attention.value_length"))
    if not 0 < rope < qk_dim or rope % 2:
        raise ModelLoadError(f"GGUF {_P}rope.dimension_count {rope} must be even and smaller "
                             f"than the heads' key length {qk_dim}")
    q_lora = field(reader, _P + "attention.q_lora_rank")
    experts = int(require(reader, _P + "expert_count"))
    used = int(require(reader, _P + "expert_used_count"))
    gating = field(reader, _P + "expert_gating_func")
    if gating is None or int(gating) == 0:  # (llama.cpp's guess for files without the key)
        gating = _SIGMOID if layers in (47, 48) and vocab == 154_880 else _SOFTMAX
    if int(gating) not in (_SIGMOID, _SOFTMAX):
        raise ModelLoadError(f"GGUF {_P}expert_gating_func {int(gating)} is not supported "
                             "(FreeToken routes deepseek2 with softmax, 1, or sigmoid, 2)")
    v3 = int(gating) == _SIGMOID
    groups = int(field(reader, _P + "expert_group_count", 1)) or 1
    keep = int(field(reader, _P + "expert_group_used_count", 1)) or 1
    scale = float(field(reader, _P + "expert_weights_scale", 0.0))
    config: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if v3 else "deepseek_v2",
        "hidden_size": hidden, "num_attention_heads": heads, "num_hidden_layers": layers,
        "num_nextn_predict_layers": nextn, "vocab_size": vocab,
        "intermediate_size": int(require(reader, _P + "feed_forward_length")),
        "q_lora_rank": int(q_lora) if q_lora else None, "kv_lora_rank": kv_lora,
        "qk_rope_head_dim": rope, "qk_nope_head_dim": qk_dim - rope, "v_head_dim": v_dim,
        "n_routed_experts": experts, "num_experts_per_tok": used,
        "moe_intermediate_size": int(require(reader, _P + "expert_feed_forward_length")),
        "n_shared_experts": int(require(reader, _P + "expert_shared_count")),
        "first_k_dense_replace": int(field(reader, _P + "leading_dense_block_count", 0)),
        "n_group": groups, "topk_group": keep,
        "routed_scaling_factor": scale if scale else 1.0,
        "norm_topk_prob": bool(field(reader, _P + "expert_weights_norm", False)),
        "scoring_func": "sigmoid" if v3 else "softmax", "rope_interleave": True,
        "rms_norm_eps": float(require(reader, _P + "attention.layer_norm_rms_epsilon")),
        "rope_theta": float(field(reader, _P + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(field(reader, _P + "context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names, "attention_bias": False,
        "torch_dtype": "float32"}
    if not v3:
        config["topk_method"] = "group_limited_greedy" if groups > 1 else "greedy"
    scaling = _yarn(reader)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _yarn(reader: Any) -> dict[str, Any] | None:
    """``rope_scaling`` of the file's YaRN keys (module docstring); None without scaling.
    Other scaling types are refused (the converter writes YaRN only for these models)."""
    kind = field(reader, _P + "rope.scaling.type")
    factor = float(field(reader, _P + "rope.scaling.factor", 1.0))
    if kind in (None, "none") or factor == 1.0:
        return None
    if kind != "yarn":
        raise ModelLoadError(f"GGUF {_P}rope.scaling.type {kind!r} is not supported for "
                             "deepseek2 (its models scale with yarn)")
    original = require(reader, _P + "rope.scaling.original_context_length")
    out: dict[str, Any] = {"rope_type": "yarn", "factor": factor,
                           "original_max_position_embeddings": int(original)}
    for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                      ("yarn_attn_factor", "attention_factor")):
        value = field(reader, f"{_P}rope.scaling.{key}")
        if value is not None:
            out[name] = float(value)
    log_mul = field(reader, _P + "rope.scaling.yarn_log_multiplier")
    if log_mul is not None:
        out["mscale"] = out["mscale_all_dim"] = float(log_mul) / 0.1
    return out
