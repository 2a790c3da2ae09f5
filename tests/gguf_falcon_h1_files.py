"""Tiny random Falcon-H1 models for tests/test_arch_falcon_h1_gguf.py: transformers' model,
written as a GGUF file the way llama.cpp's converter writes one (``conversion/falcon_h1.py``
``FalconH1Model`` over ``Mamba2Model``: its keys, gguf-py's tensor names for the architecture,
its changes to the Mamba-2 tensors and its multipliers folded into the weights, copied here
from the converter). 2-d weights quantized; the reference is transformers' model of what the
file holds: every multiplier 1, the gated norm after the gate (as llama.cpp computes it), the
file's tensors as gguf-py dequantizes them (the converter's reshapes inverted on the indices,
``log(-a)`` for ``ssm_a``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from gguf import MODEL_ARCH, GGMLQuantizationType, GGUFWriter, get_tensor_name_map
from gguf_granite4_files import add_keys
from gguf_models import _tokenizer_fields
from gguf_qwen35_files import _add as add_tensor
from gguf_writing import finish
from test_arch_phi3 import random_model
from transformers import FalconH1Config, FalconH1ForCausalLM, GenerationConfig

from freetoken_core.models.resolve import default_gguf_path

# The multipliers of a file's model (the converter folds them into the weights).
FOLDED = {"embedding_multiplier": 1.0, "lm_head_multiplier": 1.0,
          "attention_in_multiplier": 1.0, "key_multiplier": 1.0,
          "attention_out_multiplier": 1.0, "ssm_in_multiplier": 1.0, "ssm_out_multiplier": 1.0,
          "ssm_multipliers": [1.0] * 5, "mlp_multipliers": [1.0, 1.0]}


def falcon_h1_model(vocab_size: int, seed: int = 0, **overrides: Any) -> FalconH1ForCausalLM:
    """transformers' tiny float32 Falcon-H1 of ``overrides`` (hidden 64, 4 heads of 16, 2 KV
    heads) with O(1)-scale random weights (tests/test_arch_phi3.py's ``random_model``)."""
    config = FalconH1Config(**{
        "vocab_size": vocab_size, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 2,
        **overrides})
    config.architectures = ["FalconH1ForCausalLM"]
    model = random_model(FalconH1ForCausalLM, config, seed)
    with torch.no_grad():
        model.lm_head.weight[:7] *= 0.5  # special tokens: rarely greedy picks
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=2, pad_token_id=2)
    return model


def _rearranged(cfg: Any, name: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
    """``Mamba2Model.filter_tensors`` / ``modify_tensors`` of checkpoint tensor ``name``: the
    name gguf-py maps and the tensor's elements as the converter lays them out (``ssm_a``'s
    ``-exp`` and the multipliers left to the caller)."""
    if name.endswith(".dt_bias"):
        name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
    elif name.endswith("conv1d.weight"):
        t = t.squeeze()
    elif name.endswith((".A_log", ".D")):
        t = t.reshape(*t.shape, 1)
    elif name.endswith("mamba.norm.weight"):
        t = t.reshape(cfg.mamba_n_groups, -1)
    return name, t


def _folded(cfg: Any, name: str, t: torch.Tensor) -> torch.Tensor:
    """``FalconH1Model.modify_tensors``' multipliers, by its tests of the name in its order."""
    mlp, t = cfg.mlp_multipliers, t.clone()
    if "down_proj" in name:
        return t * mlp[1]
    if "gate_proj" in name:
        return t * mlp[0]
    if "k_proj" in name:
        return t * cfg.key_multiplier * cfg.attention_in_multiplier
    if "q_proj" in name or "v_proj" in name:
        return t * cfg.attention_in_multiplier
    if "o_proj" in name:
        return t * cfg.attention_out_multiplier
    if "out_proj" in name:
        return t * cfg.ssm_out_multiplier
    if "in_proj" in name:
        t = t * cfg.ssm_in_multiplier
        inner, bc = cfg.mamba_d_ssm, cfg.mamba_n_groups * cfg.mamba_d_state
        ends = (inner, 2 * inner, 2 * inner + bc, 2 * inner + 2 * bc, t.shape[0])
        for start, end, m in zip((0, *ends[:4]), ends, cfg.ssm_multipliers):
            t[start:end] *= m
        return t
    if "lm_head" in name:
        return t * cfg.lm_head_multiplier
    if "embed_tokens" in name:
        return t * cfg.embedding_multiplier
    return t


def write_falcon_h1_gguf(path: Path, model: FalconH1ForCausalLM,
                         weight_type: int = GGMLQuantizationType.Q8_0) -> FalconH1ForCausalLM:
    """``model`` written to ``path`` as llama.cpp's converter writes a Falcon-H1 (the default
    model's vocabulary, which ``model``'s must match): 1-d tensors, norms, the convolution,
    ``ssm_a`` / ``ssm_d`` F32, the other weights ``weight_type`` (0: F32). Returns
    transformers' model of the file (module docstring)."""
    cfg = model.config
    writer = GGUFWriter(str(path), "falcon-h1")
    add_keys(writer, {f"falcon-h1.{k}": v for k, v in falcon_h1_keys(cfg).items()})
    for key, value, kind in _tokenizer_fields(default_gguf_path()):
        writer.add_key_value(key, value, kind[0], sub_type=kind[1] if len(kind) > 1 else None)
    names = get_tensor_name_map(MODEL_ARCH.FALCON_H1, cfg.num_hidden_layers)
    held: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # (not in a tied checkpoint's files)
        values = tensor.detach().float()
        mapped, stored = _rearranged(cfg, name, values)
        _, at = _rearranged(cfg, name, torch.arange(values.numel()).reshape(values.shape))
        if mapped.endswith(".A_log"):
            stored = -torch.exp(stored)
        stored = _folded(cfg, name, stored)
        gguf_name = names.get_name(mapped, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, mapped
        f32 = (stored.dim() == 1 or gguf_name.endswith(("_norm.weight", "ssm_conv1d.weight"))
               or not gguf_name.endswith(".weight"))
        written = add_tensor(writer, gguf_name, stored, 0 if f32 else weight_type)
        if mapped.endswith(".A_log"):
            written = torch.log(-written)
        original = torch.empty(values.numel())
        original[at.reshape(-1)] = written.reshape(-1)
        held[name] = original.reshape(values.shape)
    finish(writer)
    if cfg.tie_word_embeddings:
        held["lm_head.weight"] = held["model.embed_tokens.weight"]
    reference = FalconH1ForCausalLM(FalconH1Config(**{
        **cfg.to_dict(), **FOLDED, "mamba_norm_before_gate": False})).float().eval()
    reference.load_state_dict(held)
    reference.generation_config = model.generation_config
    return reference


def falcon_h1_keys(cfg: Any) -> dict[str, Any]:
    """The converter's metadata of the model ``cfg`` (transformers' config), by key without
    the architecture's prefix (as ``Mamba2Model.set_gguf_parameters`` and then
    ``FalconH1Model``'s leave them: the latter's values where both write a key)."""
    return {
        "context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
        "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads, "block_count": cfg.num_hidden_layers,
        "ssm.conv_kernel": cfg.mamba_d_conv, "ssm.inner_size": cfg.mamba_d_ssm,
        "ssm.state_size": cfg.mamba_d_state,
        "ssm.time_step_rank": cfg.mamba_d_ssm // cfg.mamba_d_head,
        "ssm.group_count": cfg.mamba_n_groups,
        "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        "vocab_size": cfg.vocab_size, "attention.head_count_kv": cfg.num_key_value_heads,
        "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
        "rope.freq_base": float(cfg.rope_parameters["rope_theta"]),
    }
