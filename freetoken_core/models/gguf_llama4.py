"""Llama 4 GGUF files (``general.architecture`` ``llama4``: Scout 17B-16E, Maverick 17B-128E),
as llama.cpp's converter writes them (``conversion/llama.py`` ``Llama4Model``) and its
``src/models/llama4.cpp`` reads them: the metadata as the Hugging Face config keys
``config_llama4`` reads, and the tensor names. The converter writes the checkpoint's q/k rows
as they are (llama.cpp rotates llama4 in adjacent pairs, as transformers does: no
permutation to undo), the dense layers' size as ``feed_forward_length`` (transformers'
``intermediate_size_mlp``) and the experts' and shared expert's as
``expert_feed_forward_length`` (``intermediate_size``), each layer's fused experts split and
transposed into ``ffn_{gate,up,down}_exps``, and llama3 rope scaling as ``rope_freqs.weight``
(``gguf_metadata.rope_factor_scaling``). What the file does not say, llama.cpp fixes, and so
does FreeToken:

- ``interleave_moe_layer_step`` (required): every such layer's MLP the experts;
- chunked attention over 8192 positions on the layers ``attention.sliding_window_pattern``
  marks (default: three in four), RoPE on every layer but each 4th (its
  ``n_no_rope_layer_step``), the NoPE layers' temperature 0.1 in steps of 8192;
- the queries' and keys' L2 norm unless the file has 128 experts (Maverick, whose
  ``use_qk_norm`` is false).

Refused: a file without experts (llama.cpp refuses it too), ``attention.sliding_window`` 0
(MobileLLM-R1's converter writes it: llama.cpp then chunks nothing and rotates every layer but
the last, which transformers does not compute) or any other window than 8192 (which llama.cpp
would apply whatever the key says), and a ``rope.freq_base_swa`` other than
``rope.freq_base``.
"""

from __future__ import annotations

from typing import Any

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.gguf_families import _layer_types
from freetoken_core.models.gguf_reader import field, require

_P = "llama4."
CHUNK = 8192  # (llama.cpp's n_swa and n_attn_temp_floor_scale for llama4)
# A block's tensors, by their names under ``blk.{i}.`` (``{e}``: an expert of a 3-d tensor),
# under transformers' names (``llama4.py`` reads them; the experts per expert).
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "feed_forward.gate_proj.weight",
    "ffn_up.weight": "feed_forward.up_proj.weight",
    "ffn_down.weight": "feed_forward.down_proj.weight",
    "ffn_gate_inp.weight": "feed_forward.router.weight",
    "ffn_gate_exps.weight": "feed_forward.experts.{e}.gate_proj.weight",
    "ffn_up_exps.weight": "feed_forward.experts.{e}.up_proj.weight",
    "ffn_down_exps.weight": "feed_forward.experts.{e}.down_proj.weight",
    "ffn_gate_shexp.weight": "feed_forward.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "feed_forward.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "feed_forward.shared_expert.down_proj.weight",
}


def llama4_config(reader: Any, config: dict[str, Any]) -> dict[str, Any]:
    """The config keys of a ``llama4`` file beyond the common ones (module docstring)."""
    experts = int(field(reader, _P + "expert_count", 0))
    used = int(field(reader, _P + "expert_used_count", 0))
    if experts < 1 or not 1 <= used <= experts:
        raise ModelLoadError(f"GGUF {_P}expert_count {experts} / expert_used_count {used}: "
                             "a llama4 model has experts, 1 <= used <= count")
    step = int(require(reader, _P + "interleave_moe_layer_step"))
    if step < 1:
        raise ModelLoadError(f"GGUF {_P}interleave_moe_layer_step {step} must be at least 1")
    window = field(reader, _P + "attention.sliding_window")
    if window is not None and int(window) != CHUNK:
        raise ModelLoadError(
            f"GGUF {_P}attention.sliding_window {int(window)} is not supported: llama.cpp "
            f"chunks llama4's attention by {CHUNK} positions whatever it says, and with 0 "
            "(MobileLLM-R1) rotates every layer but the last, which transformers does not "
            "compute")
    base_swa = field(reader, _P + "rope.freq_base_swa")
    if base_swa is not None and float(base_swa) != config["rope_theta"]:
        raise ModelLoadError(f"GGUF {_P}rope.freq_base_swa {float(base_swa)} differs from "
                             f"{_P}rope.freq_base {config['rope_theta']}; FreeToken rotates "
                             "every llama4 layer with one base")
    layers = config["num_hidden_layers"]
    return {
        "model_type": "llama4_text",
        "rms_norm_eps": float(require(reader, _P + "attention.layer_norm_rms_epsilon")),
        "intermediate_size": int(require(reader, _P + "expert_feed_forward_length")),
        "intermediate_size_mlp": config["intermediate_size"],
        "num_local_experts": experts, "num_experts_per_tok": used,
        "interleave_moe_layer_step": step, "use_qk_norm": experts != 128,
        "no_rope_layer_interval": 4, "attention_chunk_size": CHUNK,
        "layer_types": ["chunked_attention" if t == "sliding_attention" else "full_attention"
                        for t in _layer_types(reader, "llama4", layers)],
        "attn_temperature_tuning": True, "floor_scale": CHUNK, "attn_scale": 0.1,
    }
