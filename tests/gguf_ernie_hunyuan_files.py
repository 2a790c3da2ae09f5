"""Tiny random ERNIE 4.5 MoE and Hunyuan MoE models for tests/test_arch_ernie_hunyuan_moe_gguf.py:
transformers' model written as a GGUF file the way llama.cpp's converter writes one
(``conversion/ernie.py`` ``Ernie4_5MoeModel``, ``conversion/hunyuan.py`` ``HunYuanMoEModel``:
their keys, the released checkpoints' tensors under gguf-py's names for the architecture,
unpermuted, each layer's experts stacked into 3-d tensors), its 2-d and 3-d weights
quantized; the reference is then transformers' model holding what the file holds (each
weight dequantized by gguf-py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from gguf import MODEL_ARCH, GGMLQuantizationType, GGUFWriter, get_tensor_name_map
from gguf_models import _tokenizer_fields
from gguf_writing import add_tensor, finish
from test_arch_phi3 import random_model
from transformers import (
    Ernie4_5_MoeConfig,
    Ernie4_5_MoeForCausalLM,
    GenerationConfig,
    HunYuanMoEV1Config,
    HunYuanMoEV1ForCausalLM,
)

from freetoken_core.models.resolve import default_gguf_path

ALPHA, THETA = 1000.0, 10000.0  # (Hunyuan-A13B's NTK-alpha rope)


def ernie_moe_model(vocab_size: int, seed: int = 0, **overrides: Any) -> Ernie4_5_MoeForCausalLM:
    """transformers' tiny float32 ERNIE 4.5 MoE of ``overrides``: hidden 64, 4 heads of 16 (2
    KV heads), a dense first layer (128 wide) then 8 experts of 32 (2 a token) beside 2 shared
    experts (ERNIE-4.5-21B-A3B's layout), untied; a selection bias that changes the choice."""
    config = Ernie4_5_MoeConfig(**{
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "moe_num_experts": 8, "moe_k": 2, "moe_intermediate_size": 32,
        "moe_num_shared_experts": 2, "moe_layer_start_index": 1, "moe_layer_interval": 1,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, **overrides})
    config.architectures = ["Ernie4_5_MoeForCausalLM"]
    model = _random(Ernie4_5_MoeForCausalLM, config, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.moe_statics.e_score_correction_bias.normal_(0.0, 0.2,
                                                                           generator=gen)
    return model


def hunyuan_moe_model(vocab_size: int, seed: int = 0, **overrides: Any
                      ) -> HunYuanMoEV1ForCausalLM:
    """transformers' tiny float32 Hunyuan MoE of ``overrides``: hidden 64, 4 heads of 16 (2 KV
    heads), every layer's 8 experts of 32 (2 a token) beside a shared MLP of 32, NTK-alpha rope
    (alpha 1,000: Hunyuan-A13B's), untied."""
    config = HunYuanMoEV1Config(**{
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 32,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_experts": 8, "moe_topk": 2, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 0,
        "eos_token_id": 2, "pad_token_id": 2,
        "rope_parameters": {"rope_type": "dynamic", "alpha": ALPHA, "factor": 1.0,
                            "rope_theta": THETA}, **overrides})
    config.architectures = ["HunYuanMoEV1ForCausalLM"]
    return _random(HunYuanMoEV1ForCausalLM, config, seed)


def _random(model_class: type, config: Any, seed: int) -> Any:
    model = random_model(model_class, config, seed)
    with torch.no_grad():
        model.lm_head.weight[:7] *= 0.5  # special tokens: rarely greedy picks
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=2, pad_token_id=2)
    return model


def converter_keys(cfg: Any) -> tuple[str, dict[str, Any]]:
    """The architecture and the ``{arch}.*`` keys llama.cpp's converter writes for ``cfg``
    (TextModel's, then the family's)."""
    if isinstance(cfg, Ernie4_5_MoeConfig):
        arch, theta = "ernie4_5-moe", float(cfg.rope_parameters["rope_theta"])
        context = cfg.max_position_embeddings
        family: dict[str, Any] = {
            "expert_count": cfg.moe_num_experts, "expert_used_count": cfg.moe_k,
            "interleave_moe_layer_step": cfg.moe_layer_interval,
            "leading_dense_block_count": cfg.moe_layer_start_index,
            "expert_feed_forward_length": cfg.moe_intermediate_size,
            "expert_shared_count": cfg.moe_num_shared_experts}
        if cfg.moe_num_shared_experts:  # (the converter's: the dense width over the KV heads)
            family["expert_shared_feed_forward_length"] = (cfg.intermediate_size
                                                           // cfg.num_key_value_heads)
    else:
        arch, dim = "hunyuan-moe", cfg.hidden_size // cfg.num_attention_heads
        theta = THETA * ALPHA ** (dim / (dim - 2))  # (the NTK-alpha base, scaling none)
        context = 256 * 1024
        family = {"rope.scaling.type": "none", "rope.scaling.factor": 1.0,
                  "rope.scaling.original_context_length": context,
                  "expert_count": cfg.num_experts, "expert_used_count": cfg.moe_topk,
                  "expert_shared_feed_forward_length": cfg.intermediate_size,
                  "expert_feed_forward_length": cfg.intermediate_size,
                  "expert_shared_count": 1}
    return arch, {
        "block_count": cfg.num_hidden_layers, "context_length": context,
        "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": cfg.num_key_value_heads, "rope.freq_base": theta,
        "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
        **family}


def write_moe_gguf(path: Path, model: Any, weight_type: int = GGMLQuantizationType.Q8_0,
                   drop_keys: tuple[str, ...] = (), keys: dict[str, Any] | None = None,
                   drop_tensors: tuple[str, ...] = ()) -> Any:
    """``model`` (:func:`ernie_moe_model` or :func:`hunyuan_moe_model`) written to ``path``
    as llama.cpp's converter writes it (the default model's vocabulary, which ``model``'s
    must match; 2-d and 3-d weights in ``weight_type``, the routers and 1-d tensors F32);
    ``drop_keys`` / ``drop_tensors`` left out and ``keys`` written instead of the
    converter's (error cases). Returns ``model`` holding the file's weights."""
    cfg = model.config
    arch, values = converter_keys(cfg)
    values = {**{k: v for k, v in values.items() if k not in drop_keys}, **(keys or {})}
    writer = GGUFWriter(str(path), arch)
    for key, value in values.items():
        name = f"{arch}.{key}"
        if isinstance(value, str):
            writer.add_string(name, value)
        elif isinstance(value, float):
            writer.add_float32(name, value)
        else:
            writer.add_uint32(name, value)
    for key, value, kind in _tokenizer_fields(default_gguf_path()):
        writer.add_key_value(key, value, kind[0], sub_type=kind[1] if len(kind) > 1 else None)
    names = get_tensor_name_map(MODEL_ARCH.ERNIE4_5_MOE if arch == "ernie4_5-moe"
                                else MODEL_ARCH.HUNYUAN_MOE, cfg.num_hidden_layers)
    held: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().float()
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # (a tied checkpoint has none)
        if name.endswith("experts.gate_up_proj"):  # [experts, 2 x size, hidden]: gate first
            half, prefix = tensor.shape[1] // 2, name.rsplit(".", 1)[0]
            parts = [_write(writer, names, f"{prefix}.{p}_proj.weight", part, weight_type)
                     for p, part in (("gate", tensor[:, :half]), ("up", tensor[:, half:]))]
            held[name] = torch.cat(parts, dim=1)
            continue
        # (the released checkpoints' names: the converter reads those)
        released = name.replace("mlp.gate.moe_statics.", "mlp.moe_statics.").replace(
            "e_score_correction_bias", "e_score_correction.bias")
        if released.endswith("experts.down_proj"):
            released += ".weight"
        held[name] = _write(writer, names, released, tensor, weight_type, drop_tensors)
    finish(writer)
    model.load_state_dict(held, strict=False)
    return model


def _write(writer: GGUFWriter, names: Any, name: str, tensor: torch.Tensor, weight_type: int,
           drop: tuple[str, ...] = ()) -> torch.Tensor:
    """``tensor`` written under gguf-py's name for ``name`` (nothing where that name ends
    with one of ``drop``); the values written."""
    gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
    assert gguf_name is not None, name
    if drop and gguf_name.endswith(drop):
        return tensor
    if not gguf_name.endswith(".weight"):  # (biases F32, as the converter writes them)
        weight_type = GGMLQuantizationType.F32
    return add_tensor(writer, gguf_name, tensor, weight_type)
