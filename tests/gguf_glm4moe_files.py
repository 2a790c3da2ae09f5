"""Tiny random GLM-4.5 models for tests/test_arch_glm4_moe.py: transformers' model written as
a GGUF file the way llama.cpp's converter writes one (``conversion/glm.py``
``Glm4MoeModel``: its keys, ``block_count`` counting the multi-token-prediction layer, the
checkpoint's tensors unpermuted under llama.cpp's names, each layer's experts stacked into
3-d tensors, the MTP layer's block and ``nextn.*`` tensors), its 2-d and 3-d weights
quantized; the reference is then transformers' model holding what the file holds (each
weight dequantized by gguf-py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from gguf import (
    MODEL_ARCH,
    ExpertGatingFuncType,
    GGMLQuantizationType,
    GGUFWriter,
    get_tensor_name_map,
)
from gguf_models import _tokenizer_fields
from gguf_writing import add_tensor, finish, gguf_name, layer_of
from test_arch_phi3 import random_model
from transformers import GenerationConfig, Glm4MoeConfig, Glm4MoeForCausalLM

from freetoken_core.models.gguf_glm4moe import LAYER_TENSORS
from freetoken_core.models.resolve import default_gguf_path

# The checkpoint's per-layer names (as the released checkpoints and the MTP layer hold them)
# -> the converter's names under ``blk.{i}.``.
_GGUF_OF = {hf.replace("expert_bias", "gate.e_score_correction_bias"): g
            for g, hf in LAYER_TENSORS.items() if "{e}" not in hf}
_EXPERTS = ("gate", "up", "down")  # ffn_{gate,up,down}_exps


def glm4moe_model(vocab_size: int, seed: int = 0, **overrides: Any) -> Glm4MoeForCausalLM:
    """transformers' tiny float32 GLM-4.5 of ``overrides``: hidden 64, 4 heads of 16 (2 KV
    heads), q/k/v biases and q/k norms, half of each head rotated, one dense layer then 8
    experts of 32 (2 a token) in 4 groups of which 2 are kept, a shared expert, a routed
    scale of 2.5; O(1)-scale random weights and a selection bias that changes the choice."""
    config = Glm4MoeConfig(**{
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "attention_bias": True, "use_qk_norm": True, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
        "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.5}, **overrides})
    config.architectures = ["Glm4MoeForCausalLM"]
    model = random_model(Glm4MoeForCausalLM, config, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        model.lm_head.weight[:7] *= 0.5  # special tokens: rarely greedy picks
        for layer in model.model.layers[config.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.3, generator=gen)
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=2, pad_token_id=2)
    return model


def mtp_layer(model: Any, seed: int = 7) -> dict[str, torch.Tensor]:
    """A multi-token-prediction layer as the released checkpoints hold it after the model's
    layers (``model.layers.{n}``; of a GLM-4.5 or a DeepSeek-V3): a whole sparse block, ``eh_proj``, ``enorm``, ``hnorm``,
    ``embed_tokens`` and ``shared_head`` (random: nothing may read it)."""
    cfg = model.config
    n, hidden = cfg.num_hidden_layers, cfg.hidden_size
    block = random_model(type(model), type(cfg)(**{
        **cfg.to_dict(), "num_hidden_layers": 1, "first_k_dense_replace": 0}), seed)
    gen = torch.Generator().manual_seed(seed)
    out = {f"model.layers.{n}.{k.split('.', 3)[3]}": v
           for k, v in block.state_dict().items() if k.startswith("model.layers.0.")}
    for name, shape in (("eh_proj.weight", (hidden, 2 * hidden)),
                        ("embed_tokens.weight", (cfg.vocab_size, hidden)),
                        ("shared_head.head.weight", (cfg.vocab_size, hidden)),
                        ("enorm.weight", (hidden,)), ("hnorm.weight", (hidden,)),
                        ("shared_head.norm.weight", (hidden,))):
        out[f"model.layers.{n}.{name}"] = torch.randn(shape, generator=gen)
    return out


def write_glm4moe_gguf(path: Path, model: Glm4MoeForCausalLM,
                       mtp: dict[str, torch.Tensor] | None = None,
                       weight_type: int = GGMLQuantizationType.Q8_0,
                       tokenizer_fields: list[tuple[str, Any, Any]] | None = None,
                       drop_keys: tuple[str, ...] = (),
                       keys: dict[str, Any] | None = None, arch: str = "glm4moe") -> Any:
    """``model`` (and its ``mtp`` layer, :func:`mtp_layer`) written to ``path`` as llama.cpp's
    converter writes a GLM-4.5 (``tokenizer_fields``' vocabulary, default the default model's,
    which ``model``'s must match; 2-d and 3-d weights in ``weight_type``, the routers and 1-d
    tensors F32); ``drop_keys`` left out and ``keys`` written instead of the converter's
    (error cases); ``arch`` ``dots1``: a dots.llm1 (its converter writes GLM-4.5's keys and
    names). Returns ``model`` holding the file's weights."""
    cfg = model.config
    if tokenizer_fields is None:
        tokenizer_fields = _tokenizer_fields(default_gguf_path())
    nextn = 1 if mtp else 0
    rope = cfg.rope_parameters
    values: dict[str, Any] = {
        "block_count": cfg.num_hidden_layers + nextn,
        "context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
        "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": cfg.num_key_value_heads,
        "rope.freq_base": float(rope["rope_theta"]),
        "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        "expert_count": cfg.n_routed_experts, "expert_used_count": cfg.num_experts_per_tok,
        "expert_group_count": cfg.n_group, "expert_group_used_count": cfg.topk_group,
        "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
        "rope.dimension_count": int(cfg.head_dim * rope.get("partial_rotary_factor", 1.0)),
        "expert_feed_forward_length": cfg.moe_intermediate_size,
        "expert_shared_count": cfg.n_shared_experts,
        "leading_dense_block_count": cfg.first_k_dense_replace,
        "expert_gating_func": int(ExpertGatingFuncType.SIGMOID),
        "expert_weights_scale": float(cfg.routed_scaling_factor),
        "expert_weights_norm": bool(cfg.norm_topk_prob),
        **({"nextn_predict_layers": nextn} if nextn else {})}
    values = {**{k: v for k, v in values.items() if k not in drop_keys}, **(keys or {})}
    writer = GGUFWriter(str(path), arch)
    for key, value in values.items():
        name = f"{arch}.{key}"
        if isinstance(value, bool):
            writer.add_bool(name, value)
        elif isinstance(value, float):
            writer.add_float32(name, value)
        else:
            writer.add_uint32(name, value)
    for key, value, kind in tokenizer_fields:
        writer.add_key_value(key, value, kind[0], sub_type=kind[1] if len(kind) > 1 else None)
    held: dict[str, torch.Tensor] = {}
    dots1_names = get_tensor_name_map(MODEL_ARCH.DOTS1, cfg.num_hidden_layers)
    state = {**model.state_dict(), **(mtp or {})}
    for name, tensor in state.items():
        tensor = tensor.detach().float()
        if name.endswith("experts.gate_up_proj"):  # [experts, 2 x size, hidden]: gate first
            index, half = layer_of(name), tensor.shape[1] // 2
            gate = add_tensor(writer, f"blk.{index}.ffn_gate_exps.weight", tensor[:, :half],
                        weight_type)
            up = add_tensor(writer, f"blk.{index}.ffn_up_exps.weight", tensor[:, half:],
                      weight_type)
            held[name] = torch.cat([gate, up], dim=1)
        elif name.endswith("experts.down_proj"):
            held[name] = add_tensor(writer, f"blk.{layer_of(name)}.ffn_down_exps.weight", tensor,
                              weight_type)
        elif arch == "dots1":  # (gguf-py's names of its converter: ffn_norm, ...)
            known = dots1_names.get_name(name, try_suffixes=(".weight", ".bias"))
            held[name] = add_tensor(writer, known or gguf_name(name, _GGUF_OF), tensor,
                                    weight_type)
        else:
            held[name] = add_tensor(writer, gguf_name(name, _GGUF_OF), tensor, weight_type)
    finish(writer)
    model.load_state_dict({k: v for k, v in held.items() if k in model.state_dict()})
    return model
