"""Tiny random Apertus models for tests/test_arch_apertus.py, and transformers' model written as
a GGUF file the way llama.cpp's converter writes one (``conversion/llama.py``
``ApertusModel``: Llama's keys and tensor names, q/k rows as the checkpoint has them, the
llama3 scaling as ``rope_freqs`` factors computed by ``LlamaModel.generate_extra_tensors``,
each layer's xIELU scalars taken out of the tensors into ``xielu.*`` arrays), its 2-d
weights quantized; the reference is then transformers' model holding what the file holds
(each weight dequantized by gguf-py)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf_models import _tokenizer_fields
from gguf_writing import add_tensor, finish
from test_arch_phi3 import random_model
from transformers import ApertusConfig, GenerationConfig

from freetoken_core.models.resolve import default_gguf_path

# llama3 scaling over a short original length, so that the 16-wide heads' pairs are of every
# kind: unscaled (the 3 fastest), smoothed (the 4th), divided by the factor (the rest).
ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
        "original_max_position_embeddings": 256, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0}
# Each layer's xIELU eps (the released models': -1e-6); wider ones make min(x, eps) matter.
EPS = (-1e-6, -0.05, -0.3)

# The checkpoint's per-layer names -> the converter's under ``blk.{i}.``.
_GGUF_OF = {
    "attention_layernorm.weight": "attn_norm.weight",
    "feedforward_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def set_xielu(model: Any, seed: int) -> None:
    """Each layer's xIELU scalars random (softplus arguments around transformers' initial
    ones, beta around 0.5) and its eps of :data:`EPS`."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            act = layer.mlp.act_fn
            act.alpha_p.uniform_(-1.0, 1.5, generator=gen)
            act.alpha_n.uniform_(-1.0, 1.5, generator=gen)
            act.beta.uniform_(0.3, 0.7, generator=gen)
            act.eps.fill_(EPS[i % len(EPS)])


def apertus_model(config_class: type, model_class: type, vocab_size: int, seed: int = 0,
                  **overrides: Any) -> Any:
    """transformers' tiny float32 ``model_class`` (Apertus's or Apertus 1.5's text model) of
    ``overrides``: hidden 64, 4 heads of 16 (2 KV heads), 3 layers, MLP 128, :data:`ROPE`;
    O(1)-scale random weights and xIELU scalars (:func:`set_xielu`)."""
    config = config_class(**{
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "bos_token_id": 0,
        "eos_token_id": 2, "pad_token_id": 2, "rope_parameters": dict(ROPE), **overrides})
    config.architectures = [model_class.__name__]
    model = random_model(model_class, config, seed)
    set_xielu(model, seed + 1)
    with torch.no_grad():
        model.lm_head.weight[:7] *= 0.5  # special tokens: rarely greedy picks
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=2, pad_token_id=2)
    return model


def llama3_factors(config: ApertusConfig) -> list[float]:
    """The converter's ``rope_freqs`` of ``config``'s llama3 scaling (``LlamaModel.
    generate_extra_tensors``, as it computes them)."""
    rope = config.rope_parameters
    dim = config.hidden_size // config.num_attention_heads
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def write_apertus_gguf(path: Path, model: Any, weight_type: int = GGMLQuantizationType.Q8_0,
                       drop_keys: tuple[str, ...] = (), keys: dict[str, Any] | None = None
                       ) -> Any:
    """``model`` written to ``path`` as llama.cpp's converter writes an Apertus (the default
    model's vocabulary, which ``model``'s must match; 2-d weights in ``weight_type``, 1-d
    tensors and ``rope_freqs`` F32); ``drop_keys`` left out and ``keys`` written instead of
    the converter's (a list: an array of float32, a float: one float32). Returns ``model``
    holding the file's weights."""
    cfg = model.config
    state = model.state_dict()
    layers = cfg.num_hidden_layers
    values: dict[str, Any] = {
        "apertus.block_count": layers, "apertus.context_length": cfg.max_position_embeddings,
        "apertus.embedding_length": cfg.hidden_size,
        "apertus.feed_forward_length": cfg.intermediate_size,
        "apertus.attention.head_count": cfg.num_attention_heads,
        "apertus.attention.head_count_kv": cfg.num_key_value_heads,
        "apertus.rope.freq_base": float(cfg.rope_parameters["rope_theta"]),
        "apertus.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        "general.file_type": int(weight_type), "apertus.vocab_size": cfg.vocab_size,
        "apertus.rope.dimension_count": cfg.hidden_size // cfg.num_attention_heads}
    for name in ("alpha_n", "alpha_p", "beta", "eps"):  # (the converter's order)
        values[f"xielu.{name}"] = [float(state[f"model.layers.{i}.mlp.act_fn.{name}"])
                                   for i in range(layers)]
    values = {**{k: v for k, v in values.items() if k not in drop_keys}, **(keys or {})}
    writer = GGUFWriter(str(path), "apertus")
    for key, value in values.items():
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    for key, value, kind in _tokenizer_fields(default_gguf_path()):
        writer.add_key_value(key, value, kind[0], sub_type=kind[1] if len(kind) > 1 else None)
    held: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if ".act_fn." in name:
            continue  # (in the metadata)
        if name in _GLOBAL:
            gguf_name = _GLOBAL[name]
        else:
            _, _, index, rest = name.split(".", 3)
            gguf_name = f"blk.{index}.{_GGUF_OF[rest]}"
        held[name] = add_tensor(writer, gguf_name, tensor.detach().float(), weight_type)
    if cfg.rope_parameters["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", np.asarray(llama3_factors(cfg), np.float32))
    finish(writer)
    model.load_state_dict({**state, **held})
    return model
