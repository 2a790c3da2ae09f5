"""Tiny random MiniMax-M2 models for tests/test_arch_minimax_m2.py: transformers' model written
as a GGUF file the way llama.cpp's converter writes one (``conversion/minimax.py``
``MiniMaxM2Model``: its keys, ``rotary_dim`` as ``rope.dimension_count``, the checkpoint's
tensors unpermuted under llama.cpp's names, each layer's experts stacked into 3-d tensors),
its weights quantized; the reference is then transformers' model holding what the file
holds (each weight dequantized by gguf-py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from gguf import ExpertGatingFuncType, GGMLQuantizationType, GGUFWriter
from gguf_models import _tokenizer_fields
from gguf_writing import add_tensor, finish, layer_of
from test_arch_phi3 import random_model
from transformers import GenerationConfig, MiniMaxM2Config, MiniMaxM2ForCausalLM

from freetoken_core.models.resolve import default_gguf_path

SHAPE = {"hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
         "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 2048,
         "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 2,
         "rotary_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
_NAMES = {"input_layernorm.weight": "attn_norm.weight",
          "post_attention_layernorm.weight": "ffn_norm.weight",
          **{f"self_attn.{p}_proj.weight": f"attn_{p}.weight" for p in "qkv"},
          "self_attn.o_proj.weight": "attn_output.weight",
          "self_attn.q_norm.weight": "attn_q_norm.weight",
          "self_attn.k_norm.weight": "attn_k_norm.weight",
          "mlp.gate.weight": "ffn_gate_inp.weight",
          "mlp.e_score_correction_bias": "exp_probs_b.bias"}


def minimax_model(vocab_size: int, seed: int = 0, **overrides: Any) -> MiniMaxM2ForCausalLM:
    """transformers' tiny float32 MiniMax-M2 of ``overrides`` (half of each 32-wide head
    rotated, 8 experts of 32, 2 a token), O(1)-scale random weights and a selection bias
    that changes the choice."""
    config = MiniMaxM2Config(**{**SHAPE, "vocab_size": vocab_size, **overrides})
    config.architectures = ["MiniMaxM2ForCausalLM"]
    model = random_model(MiniMaxM2ForCausalLM, config, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        model.lm_head.weight[:7] *= 0.5  # special tokens: rarely greedy picks
        for layer in model.model.layers:
            layer.mlp.e_score_correction_bias.normal_(0.0, 0.3, generator=gen)
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=2, pad_token_id=2)
    return model


def write_minimax_gguf(path: Path, model: MiniMaxM2ForCausalLM,
                       weight_type: int = GGMLQuantizationType.Q8_0,
                       keys: dict[str, Any] | None = None) -> MiniMaxM2ForCausalLM:
    """``model`` written to ``path`` as llama.cpp's converter writes a MiniMax-M2 (the
    default model's vocabulary; weights in ``weight_type``, the router and 1-d tensors F32;
    ``keys`` written instead of the converter's). Returns ``model`` holding the file's
    weights."""
    cfg = model.config
    values: dict[str, Any] = {
        "block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": cfg.num_key_value_heads,
        "rope.freq_base": float(cfg.rope_parameters["rope_theta"]),
        "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        "expert_count": cfg.num_local_experts, "expert_used_count": cfg.num_experts_per_tok,
        "expert_gating_func": int(ExpertGatingFuncType.SIGMOID),
        "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
        "expert_feed_forward_length": cfg.intermediate_size,
        "rope.dimension_count": SHAPE["rotary_dim"], **(keys or {})}
    writer = GGUFWriter(str(path), "minimax-m2")
    for key, value in values.items():
        if isinstance(value, float):
            writer.add_float32(f"minimax-m2.{key}", value)
        else:
            writer.add_uint32(f"minimax-m2.{key}", value)
    for key, value, kind in _tokenizer_fields(default_gguf_path()):
        writer.add_key_value(key, value, kind[0], sub_type=kind[1] if len(kind) > 1 else None)
    held: dict[str, torch.Tensor] = {}
    glob = {"model.embed_tokens.weight": "token_embd.weight",
            "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().float()
        if name.endswith("experts.gate_up_proj"):  # [experts, 2 x size, hidden]: gate first
            index, half = layer_of(name), tensor.shape[1] // 2
            gate = add_tensor(writer, f"blk.{index}.ffn_gate_exps.weight", tensor[:, :half],
                        weight_type)
            up = add_tensor(writer, f"blk.{index}.ffn_up_exps.weight", tensor[:, half:], weight_type)
            held[name] = torch.cat([gate, up], dim=1)
        elif name.endswith("experts.down_proj"):
            held[name] = add_tensor(writer, f"blk.{layer_of(name)}.ffn_down_exps.weight", tensor,
                              weight_type)
        else:
            gguf_name = glob.get(name) or f"blk.{layer_of(name)}.{_NAMES[name.split('.', 3)[3]]}"
            held[name] = add_tensor(writer, gguf_name, tensor, weight_type)
    finish(writer)
    model.load_state_dict(held)
    return model
