"""Tiny random Llama 4 models for tests/test_arch_llama4.py: transformers' model, and the same
written as a GGUF file the way llama.cpp's converter writes one (``conversion/llama.py``
``Llama4Model``: its keys, the checkpoint's q/k rows as they are, the dense layers' size as
``feed_forward_length`` and the experts' as ``expert_feed_forward_length``, each layer's fused
experts split and transposed into ``ffn_{gate,up,down}_exps``, llama3 rope scaling as
``rope_freqs.weight``), its 2-d and 3-d weights quantized; the reference is then transformers'
model holding what the file holds (each weight dequantized by gguf-py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf_models import _tokenizer_fields
from gguf_writing import add_tensor, finish, gguf_name, layer_of
from test_arch_phi3 import random_model
from test_gguf_rope_factors import llama3_factors
from transformers import GenerationConfig, Llama4ForCausalLM, Llama4TextConfig

from freetoken_core.models.gguf_llama4 import LAYER_TENSORS
from freetoken_core.models.resolve import default_gguf_path

# transformers' per-layer names -> the converter's names under ``blk.{i}.``.
_GGUF_OF = {hf: g for g, hf in LAYER_TENSORS.items() if "{e}" not in hf}
# Llama 4 Scout's rope scaling (low and high frequency factors both 1: no smoothed band),
# its original length shortened so that most of a 16-wide head's pairs are scaled.
SCOUT_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
              "low_freq_factor": 1.0, "high_freq_factor": 1.0,
              "original_max_position_embeddings": 64}


def llama4_model(vocab_size: int, seed: int = 0, **overrides: Any) -> Llama4ForCausalLM:
    """transformers' tiny float32 Llama 4 of ``overrides``: hidden 64, 4 heads of 16 (2 KV
    heads), 4 layers (the 4th NoPE), dense and MoE layers in turn (dense 96 wide; 4 experts of
    32, 1 a token, and the shared expert), q/k norms, chunks of 22 positions, a temperature of
    0.5 in steps of 16 (so that both matter in a 150-token prompt), Scout's rope scaling;
    O(1)-scale random weights (the experts' by their fan-in)."""
    config = Llama4TextConfig(**{
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 32,
        "intermediate_size_mlp": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
        "num_experts_per_tok": 1, "interleave_moe_layer_step": 2, "use_qk_norm": True,
        "attention_chunk_size": 22, "floor_scale": 16, "attn_scale": 0.5,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "bos_token_id": 0,
        "eos_token_id": 2, "pad_token_id": 2, "rope_parameters": SCOUT_ROPE, **overrides})
    config.architectures = ["Llama4ForCausalLM"]
    model = random_model(Llama4ForCausalLM, config, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        model.lm_head.weight[:7] *= 0.5  # special tokens: rarely greedy picks
        for layer in model.model.layers:
            if layer.is_moe_layer:  # ([experts, in, out]: by the fan-in, the middle size)
                for w in (layer.feed_forward.experts.gate_up_proj,
                          layer.feed_forward.experts.down_proj):
                    w.normal_(0.0, 2.0 / w.shape[1] ** 0.5, generator=gen)
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=2, pad_token_id=2)
    return model


def write_llama4_gguf(path: Path, model: Llama4ForCausalLM,
                      weight_type: int = GGMLQuantizationType.Q8_0,
                      drop_keys: tuple[str, ...] = (),
                      keys: dict[str, Any] | None = None) -> Llama4ForCausalLM:
    """``model`` written to ``path`` as llama.cpp's converter writes a Llama 4, with the
    default model's vocabulary (``model``'s must match; 2-d and 3-d weights in
    ``weight_type``, the routers and 1-d tensors F32); ``drop_keys`` left out and ``keys``
    written instead of the converter's (error cases). Returns ``model`` holding the file's
    weights."""
    cfg = model.config
    rope = cfg.rope_parameters
    values: dict[str, Any] = {
        "block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size_mlp,
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": cfg.num_key_value_heads,
        "rope.freq_base": float(rope["rope_theta"]),
        "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        "expert_count": cfg.num_local_experts, "expert_used_count": cfg.num_experts_per_tok,
        "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "rope.dimension_count": cfg.head_dim,
        "interleave_moe_layer_step": cfg.interleave_moe_layer_step,
        "expert_feed_forward_length": cfg.intermediate_size}
    values = {**{k: v for k, v in values.items() if k not in drop_keys}, **(keys or {})}
    writer = GGUFWriter(str(path), "llama4")
    for key, value in values.items():
        name = f"llama4.{key}"
        if isinstance(value, float):
            writer.add_float32(name, value)
        else:
            writer.add_uint32(name, value)
    for key, value, kind in _tokenizer_fields(default_gguf_path()):
        writer.add_key_value(key, value, kind[0], sub_type=kind[1] if len(kind) > 1 else None)
    if rope["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", np.asarray(
            llama3_factors(cfg.head_dim, rope["rope_theta"], rope), dtype=np.float32))
    held: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().float()
        if name.endswith("experts.gate_up_proj"):  # [experts, hidden, 2 x size]: gate first
            index, half = layer_of(name), tensor.shape[2] // 2
            rows = tensor.transpose(1, 2)
            gate = add_tensor(writer, f"blk.{index}.ffn_gate_exps.weight", rows[:, :half], weight_type)
            up = add_tensor(writer, f"blk.{index}.ffn_up_exps.weight", rows[:, half:], weight_type)
            held[name] = torch.cat([gate, up], dim=1).transpose(1, 2)
        elif name.endswith("experts.down_proj"):  # [experts, size, hidden]
            held[name] = add_tensor(writer, f"blk.{layer_of(name)}.ffn_down_exps.weight",
                              tensor.transpose(1, 2), weight_type).transpose(1, 2)
        else:
            held[name] = add_tensor(writer, gguf_name(name, _GGUF_OF), tensor, weight_type)
    finish(writer)
    model.load_state_dict(held)
    return model
