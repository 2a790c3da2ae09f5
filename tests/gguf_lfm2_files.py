"""Tiny random LFM2 / LFM2-MoE models for tests/test_arch_lfm2.py written as GGUF files the
way llama.cpp's converter writes them (``conversion/lfm2.py`` ``LFM2Model`` /
``LFM2MoeModel``): its keys (``attention.head_count_kv`` a number a layer, 0 for the
convolution layers; ``shortconv.l_cache``; the experts' counts, ``leading_dense_block_count``
and sigmoid gating), the checkpoint's names mapped by gguf-py's own table (the converter's
``map_tensor_name``: ``token_embd_norm``, ``shortconv.*``, ``exp_probs_b.bias``), each
convolution weight squeezed to ``[hidden, kernel]``, the experts stacked a tensor a layer;
2-d weights quantized with gguf-py (the convolutions, the routers, norms and vectors F32, as
the converter forces them). The reference is transformers' model holding what the file
holds (each weight dequantized by gguf-py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from gguf import MODEL_ARCH, GGMLQuantizationType, GGUFWriter, get_tensor_name_map
from gguf_models import _tokenizer_fields
from gguf_writing import add_tensor, finish
from test_arch_phi3 import random_model
from transformers import (
    GenerationConfig,
    Lfm2Config,
    Lfm2ForCausalLM,
    Lfm2MoeConfig,
    Lfm2MoeForCausalLM,
)

from freetoken_core.models.resolve import default_gguf_path

VOCAB = 49152  # (the default model's vocabulary, whose tokenizer fields the files take)
TYPES = ["conv", "full_attention", "conv", "conv"]


def lfm2_model(arch: str, seed: int = 0, **overrides: Any) -> Any:
    """transformers' tiny float32 LFM2 (``arch`` ``lfm2``) or LFM2-MoE (``lfm2moe``: experts
    past the first layer, their selection biases N(0, 0.5) so that they change the choice)
    of O(1)-scale random weights (hidden 64, 4 heads of 16, 2 KV heads, the default
    model's vocabulary; no biases: ``conv_bias`` false, as released)."""
    shape: dict[str, Any] = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": len(TYPES), "layer_types": TYPES, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 2048, "norm_eps": 1e-5,
        "block_auto_adjust_ff_dim": False, "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 0}
    if arch == "lfm2moe":
        shape.update(num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=32)
    config = (Lfm2Config if arch == "lfm2" else Lfm2MoeConfig)(**{**shape, **overrides})
    model_class = Lfm2ForCausalLM if arch == "lfm2" else Lfm2MoeForCausalLM
    config.architectures = [model_class.__name__]
    model = random_model(model_class, config, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        model.lm_head.weight[:7] *= 0.5  # special tokens: rarely greedy picks
        for layer in model.model.layers:
            bias = getattr(layer.feed_forward, "expert_bias", None)
            if bias is not None:
                bias.normal_(0.0, 0.5, generator=gen)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return model


def write_lfm2_gguf(path: Path, model: Any, weight_type: int = GGMLQuantizationType.Q8_0,
                    keys: dict[str, Any] | None = None) -> Any:
    """``model`` written to ``path`` as llama.cpp's converter writes it, the metadata keys
    (under ``{arch}.``) changed by ``keys`` (a value of None leaves the key out); returns
    ``model`` holding the file's weights."""
    cfg = model.config
    moe = cfg.model_type == "lfm2_moe"
    arch = "lfm2moe" if moe else "lfm2"
    layers = cfg.num_hidden_layers
    values: dict[str, Any] = {
        "block_count": layers, "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": [cfg.num_key_value_heads if t == "full_attention" else 0
                                    for t in cfg.layer_types],
        "rope.freq_base": float(cfg.rope_parameters["rope_theta"]),
        "attention.layer_norm_rms_epsilon": float(cfg.norm_eps),
        "vocab_size": cfg.vocab_size, "shortconv.l_cache": cfg.conv_L_cache}
    if moe:
        values.update({"expert_count": cfg.num_experts,
                       "expert_used_count": cfg.num_experts_per_tok,
                       "expert_feed_forward_length": cfg.moe_intermediate_size,
                       "leading_dense_block_count": cfg.num_dense_layers,
                       "expert_gating_func": 2})  # (sigmoid)
    values.update(keys or {})
    writer = GGUFWriter(str(path), arch)
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, list):
            writer.add_array(f"{arch}.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", value)
    for key, value, kind in _tokenizer_fields(default_gguf_path()):
        writer.add_key_value(key, value, kind[0], sub_type=kind[1] if len(kind) > 1 else None)
    table = get_tensor_name_map(MODEL_ARCH.LFM2MOE if moe else MODEL_ARCH.LFM2, layers)

    def mapped(name: str) -> str:
        gguf_name = table.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        return gguf_name

    held: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.detach().float()
        if name.endswith("feed_forward.experts.gate_up_proj"):  # (released: w1, w3 each)
            i = name.split(".")[2]
            gate, up = data.chunk(2, dim=1)
            stacked = [(f"layers.{i}.feed_forward.experts.w1.weight", gate),
                       (f"layers.{i}.feed_forward.experts.w3.weight", up)]
            written = [_add(writer, mapped(n), t, weight_type) for n, t in stacked]
            held[name] = torch.cat(written, dim=1)
            continue
        if name.endswith("feed_forward.experts.down_proj"):
            i = name.split(".")[2]
            held[name] = _add(writer, mapped(f"layers.{i}.feed_forward.experts.w2.weight"),
                              data, weight_type)
            continue
        # (the converter's filter_tensors names the selection bias as a bias)
        gguf_name = mapped(name + ".bias" if name.endswith(".expert_bias") else name)
        if "conv.conv" in name:  # (the converter's modify_tensors: "conv op requires 2d";
            # a conv bias fails there: no file has one, so these models have none)
            held[name] = _add(writer, gguf_name, data.squeeze(1), weight_type).unsqueeze(1)
        else:
            held[name] = _add(writer, gguf_name, data, weight_type)
    finish(writer)
    model.load_state_dict(held, strict=False)
    return model


def _add(writer: GGUFWriter, name: str, tensor: torch.Tensor, qtype: int) -> torch.Tensor:
    """``add_tensor``, with what LFM2's converter forces to F32 (norms, the router, the
    convolution)."""
    return add_tensor(writer, name, tensor, qtype,
                      f32=("_norm.weight", "ffn_gate_inp.weight", "shortconv.conv.weight"))
