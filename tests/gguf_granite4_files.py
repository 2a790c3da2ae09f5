"""Tiny random Granite 4 models for tests/test_arch_granite4_gguf.py: transformers' model,
written as a GGUF file the way llama.cpp's converter writes one (``conversion/granite.py``
``GraniteHybridModel`` over ``Mamba2Model`` and ``GraniteMoeModel``: its keys, gguf-py's tensor
names for the architecture, and each change it makes to a tensor, copied here from the
converter): ``granitehybrid`` where the model has Mamba-2 layers, else ``granite`` (the dense
granite-4.0-micro's). 2-d and 3-d weights quantized; the reference is then transformers'
model holding what the file holds (each tensor as gguf-py dequantizes it, the converter's
changes undone here: its reshapes and permutations inverted on the indices, ``log(-a)`` for
``ssm_a``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from gguf import MODEL_ARCH, GGMLQuantizationType, GGUFWriter, get_tensor_name_map
from gguf_models import _tokenizer_fields
from gguf_qwen35_files import _add as add_tensor
from gguf_writing import finish
from test_arch_phi3 import random_model
from transformers import GenerationConfig, GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

from freetoken_core.models.resolve import default_gguf_path

# transformers 5's names of Granite MoE's experts -> the released checkpoints' (which the
# converter reads)
_RELEASED = {".block_sparse_moe.router.weight": ".block_sparse_moe.router.layer.weight",
             ".block_sparse_moe.experts.gate_up_proj": ".block_sparse_moe.input_linear.weight",
             ".block_sparse_moe.experts.down_proj": ".block_sparse_moe.output_linear.weight"}


def granite4_model(vocab_size: int, seed: int = 0, **overrides: Any
                   ) -> GraniteMoeHybridForCausalLM:
    """transformers' tiny float32 Granite 4 of ``overrides`` (hidden 64, 4 heads of 16, 2 KV
    heads) with O(1)-scale random weights (tests/test_arch_phi3.py's ``random_model``)."""
    config = GraniteMoeHybridConfig(**{
        "vocab_size": vocab_size, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 2, **overrides})
    config.architectures = ["GraniteMoeHybridForCausalLM"]
    model = random_model(GraniteMoeHybridForCausalLM, config, seed)
    with torch.no_grad():
        model.lm_head.weight[:7] *= 0.5  # special tokens: rarely greedy picks
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=2, pad_token_id=2)
    return model


def _permute(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """The converter's ``LlamaModel.permute`` (q/k rows for llama.cpp's rotary pairs)."""
    return t.reshape(n_head, 2, t.shape[0] // n_head // 2, *t.shape[1:]).swapaxes(1, 2
                                                                                   ).reshape(t.shape)


def _converted(cfg: Any, name: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The converter's ``GraniteHybridModel.modify_tensors`` (and ``filter_tensors``) of the
    released checkpoint's tensor ``name``: the names gguf-py maps and the tensors, their
    elements rearranged as the converter rearranges them (``ssm_a``'s ``-exp`` left to the
    caller)."""
    experts = bool(cfg.num_local_experts)
    if name.endswith("block_sparse_moe.input_linear.weight"):
        gate, up = t.split(cfg.intermediate_size, dim=-2)
        base = name.rpartition(".input_linear")[0]
        yield base + ".gate_exps", gate  # (named below: gguf-py has no checkpoint name)
        yield base + ".up_exps", up
        return
    if name.endswith("shared_mlp.input_linear.weight"):
        gate, up = t.split(cfg.shared_intermediate_size, dim=-2)
        yield name.replace("input_linear.weight", "gate"), gate
        yield name.replace("input_linear.weight", "up"), up
        return
    if name.endswith("shared_mlp.output_linear.weight") and not experts:
        yield name.replace("output_linear.weight", "down"), t
        return
    if name.endswith(".dt_bias"):
        name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
    elif name.endswith("conv1d.weight"):
        t = t.squeeze()
    elif name.endswith((".A_log", ".D")):
        t = t.reshape(*t.shape, 1)
    elif name.endswith("mamba.norm.weight"):
        t = t.reshape(cfg.mamba_n_groups, -1)
    elif name.endswith("q_proj.weight"):
        t = _permute(t, cfg.num_attention_heads)
    elif name.endswith("k_proj.weight"):
        t = _permute(t, cfg.num_key_value_heads)
    yield name, t


def _gguf_name(names: Any, name: str, experts: bool) -> str:
    """The file's name of the converter's tensor ``name`` (``_converted``)."""
    layer = name.split(".")[2] if name.startswith("model.layers.") else ""
    for suffix, gguf in ((".gate_exps", "ffn_gate_exps"), (".up_exps", "ffn_up_exps"),
                         ("shared_mlp.gate", "ffn_gate_shexp" if experts else "ffn_gate"),
                         ("shared_mlp.up", "ffn_up_shexp" if experts else "ffn_up"),
                         ("shared_mlp.down", "ffn_down")):
        if name.endswith(suffix):
            return f"blk.{layer}.{gguf}.weight"
    mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
    assert mapped is not None, name
    return mapped


def write_granite4_gguf(path: Path, model: GraniteMoeHybridForCausalLM,
                        weight_type: int = GGMLQuantizationType.Q8_0,
                        rope_finetuned: bool | None = None) -> GraniteMoeHybridForCausalLM:
    """``model`` written to ``path`` as llama.cpp's converter writes a Granite 4 (the default
    model's vocabulary, which ``model``'s must match): 1-d tensors, norms, the router, the
    convolution, ``ssm_a`` / ``ssm_d`` F32, the other weights ``weight_type``;
    ``rope_finetuned`` in place of the converter's ``rope.scaling.finetuned`` (false for
    every hybrid). Returns ``model`` holding the file's weights."""
    cfg = model.config
    arch = "granite" if all(_attention(cfg)) else "granitehybrid"
    writer = GGUFWriter(str(path), arch)
    keys = granite4_keys(cfg)
    if rope_finetuned is not None:
        keys["rope.scaling.finetuned"] = rope_finetuned
    add_keys(writer, {f"{arch}.{k}": v for k, v in keys.items()})
    for key, value, kind in _tokenizer_fields(default_gguf_path()):
        writer.add_key_value(key, value, kind[0], sub_type=kind[1] if len(kind) > 1 else None)
    names = get_tensor_name_map(MODEL_ARCH.GRANITE_HYBRID if arch == "granitehybrid"
                                else MODEL_ARCH.GRANITE, cfg.num_hidden_layers)
    held: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        values = tensor.detach().float()
        released = name
        for old, new in _RELEASED.items():
            released = released.replace(old, new) if released.endswith(old) else released
        index = torch.arange(values.numel()).reshape(values.shape)
        original = torch.empty(values.numel())
        for (mapped, stored), (_, at) in zip(_converted(cfg, released, values),
                                             _converted(cfg, released, index)):
            if mapped.endswith(".A_log"):
                stored = -torch.exp(stored)
            gguf_name = _gguf_name(names, mapped, bool(cfg.num_local_experts))
            f32 = (stored.dim() == 1 or gguf_name.endswith(("_norm.weight", "ffn_gate_inp.weight",
                                                           "ssm_conv1d.weight"))
                   or not gguf_name.endswith(".weight"))
            written = add_tensor(writer, gguf_name, stored, 0 if f32 else weight_type)
            if mapped.endswith(".A_log"):
                written = torch.log(-written)
            original[at.reshape(-1)] = written.reshape(-1)
        held[name] = original.reshape(values.shape)
    finish(writer)
    model.load_state_dict(held)
    return model


def granite4_keys(cfg: Any) -> dict[str, Any]:
    """The converter's metadata of the model ``cfg`` (transformers' config), by key without
    the architecture's prefix: ints written as uint32, floats as float32, lists as arrays."""
    hybrid = not all(_attention(cfg))
    inner = cfg.mamba_expand * cfg.hidden_size
    keys: dict[str, Any] = {
        "block_count": cfg.num_hidden_layers,
        # (the converter's 2^20 where it writes rope.scaling.finetuned false: every hybrid)
        "context_length": 2 ** 20 if hybrid else cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads,
        "rope.freq_base": float(cfg.rope_parameters["rope_theta"]),
        "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        "expert_count": cfg.num_local_experts,
        "expert_used_count": cfg.num_experts_per_tok,
        "vocab_size": cfg.vocab_size,
        "rope.dimension_count": cfg.hidden_size // cfg.num_attention_heads,
        "attention.scale": float(cfg.attention_multiplier),
        "embedding_scale": float(cfg.embedding_multiplier),
        "residual_scale": float(cfg.residual_multiplier),
        "logit_scale": float(cfg.logits_scaling),
        "expert_shared_feed_forward_length": cfg.shared_intermediate_size,
        "ssm.conv_kernel": cfg.mamba_d_conv, "ssm.state_size": cfg.mamba_d_state,
        "ssm.group_count": cfg.mamba_n_groups, "ssm.inner_size": inner,
        "ssm.time_step_rank": cfg.mamba_n_heads,
        "attention.head_count_kv": [cfg.num_key_value_heads if a else 0
                                    for a in _attention(cfg)],
        "rope.scaling.finetuned": not hybrid,
    }
    if not cfg.num_experts_per_tok:
        keys.pop("expert_used_count")
    return keys


def _attention(cfg: Any) -> list[bool]:
    """Which layers are attention layers (config.json's ``attention``, transformers 5's
    ``full_attention``; the others Mamba-2)."""
    return [t in ("attention", "full_attention") for t in cfg.layer_types]


def add_keys(writer: GGUFWriter, keys: dict[str, Any]) -> None:
    """``keys`` (``granite4_keys``, prefixed) into ``writer``."""
    for key, value in keys.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)

