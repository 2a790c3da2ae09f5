"""Tiny random Qwen3.5 models for tests/test_arch_qwen35_gguf.py: transformers' model, written
as a ``qwen35`` GGUF file the way llama.cpp's converter writes one (``conversion/qwen.py``
``Qwen3_5TextModel`` over ``_LinearAttentionVReorderBase`` and ``Qwen3NextModel``: its keys,
gguf-py's tensor names for the architecture, and each change it makes to a tensor, copied
here from the converter), 2-d weights quantized; the reference is then transformers' model
holding what the file holds (each tensor as gguf-py dequantizes it, the converter's changes
undone here: its permutations inverted on the indices, ``- 1`` for the ``1 + w`` norms,
``log(-a)`` for ``ssm_a``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, MODEL_ARCH, GGMLQuantizationType, GGUFWriter, get_tensor_name_map
from gguf.quants import dequantize, quantize
from gguf_models import _tokenizer_fields
from gguf_writing import finish
from test_arch_phi3 import random_model
from transformers import GenerationConfig, Qwen3_5ForCausalLM, Qwen3_5TextConfig

from freetoken_core.models.resolve import default_gguf_path

MTP_TENSORS = ("attn_norm", "post_attention_norm", "attn_q", "attn_k", "attn_v", "attn_output",
               "attn_q_norm", "attn_k_norm", "ffn_gate", "ffn_up", "ffn_down",
               "nextn.eh_proj", "nextn.enorm", "nextn.hnorm", "nextn.shared_head_norm")


def qwen35_model(vocab_size: int, seed: int = 0, **overrides: Any) -> Qwen3_5ForCausalLM:
    """transformers' tiny float32 Qwen3.5 of ``overrides`` (hidden 64, 4 heads of 16, 2 KV
    heads, RoPE on half of each head in sections that cover it) with O(1)-scale random
    weights (tests/test_arch_phi3.py's ``random_model``; a tied embedding a quarter of it)."""
    config = Qwen3_5TextConfig(**{
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
        "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
                            "mrope_interleaved": True},
        **overrides})
    config.architectures = ["Qwen3_5ForCausalLM"]
    model = random_model(Qwen3_5ForCausalLM, config, seed)
    with torch.no_grad():
        if config.tie_word_embeddings:  # (the head's logits of the untied ones' scale)
            model.lm_head.weight *= 0.25
        model.lm_head.weight[:7] *= 0.5  # special tokens: rarely greedy picks
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=2, pad_token_id=2)
    return model


def _reorder_v_heads(t: torch.Tensor, dim: int, k_heads: int, v_per_k: int,
                     head_dim: int) -> torch.Tensor:
    """The converter's ``_LinearAttentionVReorderBase._reorder_v_heads``."""
    shape = list(t.shape)
    new_shape = shape[:dim] + [k_heads, v_per_k, head_dim] + shape[dim + 1:]
    t = t.reshape(*new_shape)
    perm = list(range(len(new_shape)))
    perm[dim], perm[dim + 1] = perm[dim + 1], perm[dim]
    return t.permute(*perm).contiguous().reshape(*shape)


def _reordered(cfg: Any, name: str, t: torch.Tensor) -> torch.Tensor:
    """The converter's ``_LinearAttentionVReorderBase.modify_tensors`` (value heads tiled)."""
    k_heads, v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if k_heads == v_heads or "linear_attn." not in name:
        return t
    dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, v_heads // k_heads
    if ".in_proj_qkv." in name:
        qk = dk * k_heads * 2
        return torch.cat([t[:qk], _reorder_v_heads(t[qk:], 0, k_heads, r, dv)], dim=0)
    if ".in_proj_z." in name:
        return _reorder_v_heads(t, 0, k_heads, r, dv)
    if ".in_proj_b." in name or ".in_proj_a." in name:
        return _reorder_v_heads(t, 0, k_heads, r, 1)
    if ".A_log" in name or ".dt_bias" in name:
        return _reorder_v_heads(t.unsqueeze(-1), 0, k_heads, r, 1).squeeze(-1)
    if ".conv1d" in name:
        data = t.squeeze()
        qk = dk * k_heads * 2
        return torch.cat([data[:qk], _reorder_v_heads(data[qk:], 0, k_heads, r, dv)], dim=0)
    if ".out_proj." in name:
        return _reorder_v_heads(t, 1, k_heads, r, dv)
    return t


def _converted(name: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
    """The converter's ``Qwen3NextModel.modify_tensors`` (for Qwen3.5's separate
    ``in_proj_qkv`` / ``in_proj_z``): the checkpoint name it maps and the values."""
    if name.endswith(".A_log"):
        t = -torch.exp(t)
    elif name.endswith(".dt_bias"):
        name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
    elif "conv1d" in name:
        t = t.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        t = t + 1
    return name, t


def write_qwen35_gguf(path: Path, model: Qwen3_5ForCausalLM,
                      weight_type: int = GGMLQuantizationType.Q8_0, mtp: bool = False,
                      recurrent_layers: bool = True) -> Qwen3_5ForCausalLM:
    """``model`` written to ``path`` as llama.cpp's converter writes a Qwen3.5 (the default
    model's vocabulary, which ``model``'s must match): 1-d tensors, norms and the convolution
    F32, the other 2-d weights ``weight_type`` (F16 where a row is not whole blocks of it, as
    the converter falls back); ``mtp``: a multi-token-prediction block after the layers
    (random, not read); ``recurrent_layers``: the layer kinds as
    ``attention.recurrent_layers`` (the converter's where config.json has ``layer_types``),
    else ``full_attention_interval`` alone. Returns ``model`` holding the file's weights."""
    cfg = model.config
    layers = cfg.num_hidden_layers
    writer = GGUFWriter(str(path), "qwen35")
    add_keys(writer, qwen35_keys(cfg, mtp, recurrent_layers))
    for key, value, kind in _tokenizer_fields(default_gguf_path()):
        writer.add_key_value(key, value, kind[0], sub_type=kind[1] if len(kind) > 1 else None)
    names = get_tensor_name_map(MODEL_ARCH.QWEN35, layers + int(mtp))
    held: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # (the head is the embedding's: no output.weight)
        values = tensor.detach().float()
        mapped, stored = _converted(name, _reordered(cfg, name, values))
        gguf_name = names.get_name(mapped, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, mapped
        f32 = stored.dim() == 1 or gguf_name.endswith(("_norm.weight", "ssm_conv1d.weight"))
        written = _add(writer, gguf_name, stored, 0 if f32 else weight_type)
        # what the file holds, the converter's changes undone (its permutation, inverted)
        index = _reordered(cfg, name, torch.arange(values.numel()).reshape(values.shape))
        original = torch.empty(values.numel())
        original[index.reshape(-1)] = _undone(name, written).reshape(-1)
        held[name] = original.reshape(values.shape)
    if mtp:
        _add_mtp_block(writer, cfg, layers, weight_type)
    finish(writer)
    if cfg.tie_word_embeddings:
        held["lm_head.weight"] = held["model.embed_tokens.weight"]
    model.load_state_dict(held)
    return model


def qwen35_keys(cfg: Any, mtp: bool = False, recurrent_layers: bool = True
                ) -> dict[str, Any]:
    """The converter's metadata of the model ``cfg`` (transformers' config), by key: ints
    written as uint32, floats as float32, lists as arrays."""
    p = "qwen35."
    rope = cfg.rope_parameters
    keys: dict[str, Any] = {
        "context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
        "block_count": cfg.num_hidden_layers + int(mtp),
        "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": cfg.num_key_value_heads,
        "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
        "rope.freq_base": float(rope["rope_theta"]),
        "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        "ssm.conv_kernel": cfg.linear_conv_kernel_dim,
        "ssm.state_size": cfg.linear_key_head_dim,
        "ssm.group_count": cfg.linear_num_key_heads,
        "ssm.time_step_rank": cfg.linear_num_value_heads,
        "ssm.inner_size": cfg.linear_value_head_dim * cfg.linear_num_value_heads,
        "full_attention_interval": 4,
        "rope.dimension_count": int(cfg.head_dim * rope["partial_rotary_factor"]),
        "rope.dimension_sections": (list(rope.get("mrope_section", [11, 11, 10])) + [0])[:4],
    }
    if recurrent_layers:
        keys["attention.recurrent_layers"] = [t == "linear_attention" for t in cfg.layer_types
                                              ] + [False] * int(mtp)
    if mtp:
        keys["nextn_predict_layers"] = 1
    return {p + k: v for k, v in keys.items()}


def add_keys(writer: GGUFWriter, keys: dict[str, Any]) -> None:
    """``keys`` (``qwen35_keys``) into ``writer``."""
    for key, value in keys.items():
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, value)


def _undone(name: str, t: torch.Tensor) -> torch.Tensor:
    """The elementwise changes of ``_converted`` undone."""
    if name.endswith(".A_log"):
        return torch.log(-t)
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return t - 1
    return t


def _add_mtp_block(writer: GGUFWriter, cfg: Any, index: int, qtype: int) -> None:
    """A random multi-token-prediction block ``index`` (a Qwen3.5 attention block and the
    ``nextn`` tensors, as the converter names the checkpoint's ``mtp.*``)."""
    gen = torch.Generator().manual_seed(7)
    h, heads, kv, d, ff = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                           cfg.head_dim, cfg.intermediate_size)
    shapes = {"attn_q": (2 * heads * d, h), "attn_k": (kv * d, h), "attn_v": (kv * d, h),
              "attn_output": (h, heads * d), "attn_q_norm": (d,), "attn_k_norm": (d,),
              "ffn_gate": (ff, h), "ffn_up": (ff, h), "ffn_down": (h, ff),
              "nextn.eh_proj": (h, 2 * h)}
    for name in MTP_TENSORS:
        shape = shapes.get(name, (h,))
        _add(writer, f"blk.{index}.{name}.weight", torch.randn(*shape, generator=gen),
             qtype if len(shape) == 2 else 0)


def _add(writer: GGUFWriter, name: str, tensor: torch.Tensor, qtype: int) -> torch.Tensor:
    """Write ``tensor`` as ``qtype`` (F16 where its rows are not whole blocks of it); return
    the values written, as gguf-py dequantizes them."""
    values = tensor.numpy()
    if qtype == 0:
        writer.add_tensor(name, np.ascontiguousarray(values, dtype=np.float32))
        return tensor
    block = GGMLQuantizationType(qtype)
    if values.shape[-1] % GGML_QUANT_SIZES[block][0]:
        block = GGMLQuantizationType.F16
    raw = quantize(values, block)
    writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=block)
    return torch.from_numpy(np.asarray(dequantize(raw, block), dtype=np.float32).reshape(
        values.shape))
