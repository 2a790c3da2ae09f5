"""Tiny random Phi models for tests/test_arch_phi.py written as ``phi2`` GGUF files the way
llama.cpp's converter writes them (``conversion/phi.py`` ``Phi2Model``): its keys (the
feed-forward length written as 4 x hidden, as many KV heads as heads, the LayerNorms' eps,
``rope.dimension_count`` = int(partial_rotary_factor x hidden) / heads, no rope base: 10,000,
no BOS added), the checkpoint's names mapped by gguf-py's own table (the converter's
``map_tensor_name``); with ``fused``, q/k/v as one ``attn_qkv`` weight and bias, rows q, k
then v, as the converter writes Phi's original checkpoints (their ``mixer.Wqkv``). 2-d
weights quantized with gguf-py, 1-d ones (norms, biases) F32. The reference is
transformers' model holding what the file holds (each weight dequantized by gguf-py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from gguf import MODEL_ARCH, GGMLQuantizationType, GGUFWriter, get_tensor_name_map
from gguf_models import _tokenizer_fields
from gguf_writing import add_tensor, finish
from test_arch_phi3 import random_model
from transformers import GenerationConfig, PhiConfig, PhiForCausalLM

from freetoken_core.models.resolve import default_gguf_path

VOCAB = 49152  # (the default model's vocabulary, whose tokenizer fields the files take)


def phi_model(seed: int = 0, **overrides: Any) -> Any:
    """transformers' tiny float32 Phi (hidden 64, 4 heads of 16, 2 layers, an MLP of
    4 x hidden as Phi's, Phi-2's rotary fraction 0.4: 6 of 16 dimensions rotated; the
    default model's vocabulary) of O(1)-scale random weights, biases included
    (:func:`random_phi`)."""
    config = PhiConfig(**{
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 2048,
        "partial_rotary_factor": 0.4, "layer_norm_eps": 1e-5, "bos_token_id": 1,
        "eos_token_id": 2, "pad_token_id": 0, **overrides})
    model = random_phi(config, seed)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return model


def random_phi(config: Any, seed: int) -> Any:
    """transformers' Phi of ``config`` with ``random_model``'s weights, but the LayerNorms'
    biases N(0, 0.2) (not ~1, as every norm parameter there: the final norm's would add
    the same large vector to every position, and one token would win them all) and the
    head's bias N(0, 0.5) (of the logits' size, so that it moves them)."""
    config.architectures = ["PhiForCausalLM"]
    model = random_model(PhiForCausalLM, config, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith(".bias"):
                param.normal_(0.0, 0.2, generator=gen)
        model.lm_head.bias.normal_(0.0, 0.5, generator=gen)
        model.lm_head.weight[:7] *= 0.5  # special tokens: rarely greedy picks
    return model


def write_phi2_gguf(path: Path, model: Any, weight_type: int = GGMLQuantizationType.Q8_0,
                    fused: bool = False, keys: dict[str, Any] | None = None) -> Any:
    """``model`` written to ``path`` as llama.cpp's converter writes it, the metadata keys
    (under ``phi2.``) changed by ``keys`` (a value of None leaves the key out); returns
    ``model`` holding the file's weights."""
    cfg = model.config
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads
    layers = cfg.num_hidden_layers
    values: dict[str, Any] = {
        "context_length": cfg.max_position_embeddings, "embedding_length": hidden,
        "feed_forward_length": 4 * hidden, "block_count": layers,
        "attention.head_count": heads, "attention.head_count_kv": heads,
        "attention.layer_norm_epsilon": float(cfg.layer_norm_eps),
        "rope.dimension_count": int(cfg.rope_parameters["partial_rotary_factor"] * hidden)
        // heads}
    values.update(keys or {})
    writer = GGUFWriter(str(path), "phi2")
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, str):
            writer.add_string(f"phi2.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"phi2.{key}", value)
        else:
            writer.add_uint32(f"phi2.{key}", value)
    for key, value, kind in _tokenizer_fields(default_gguf_path()):
        if key != "tokenizer.ggml.add_bos_token":
            writer.add_key_value(key, value, kind[0],
                                 sub_type=kind[1] if len(kind) > 1 else None)
    writer.add_add_bos_token(False)
    table = get_tensor_name_map(MODEL_ARCH.PHI2, layers)
    state = {name: tensor.detach().float() for name, tensor in model.state_dict().items()}
    held: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if fused and (".self_attn.k_proj." in name or ".self_attn.v_proj." in name):
            continue  # (in the q projection's fused tensor)
        if fused and ".self_attn.q_proj." in name:
            i, kind = name.split(".")[2], name.rsplit(".", 1)[1]
            parts = [state[name.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            written = add_tensor(writer, f"blk.{i}.attn_qkv.{kind}", torch.cat(parts), weight_type)
            for p, values_of in zip(("q_proj", "k_proj", "v_proj"),
                                    written.split([len(t) for t in parts])):
                held[name.replace("q_proj", p)] = values_of
            continue
        gguf_name = table.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        held[name] = add_tensor(writer, gguf_name, tensor, weight_type)
    finish(writer)
    model.load_state_dict(held, strict=False)
    return model
