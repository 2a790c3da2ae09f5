"""Tiny random DeepSeek-V2/V3 models for tests/test_arch_deepseek_gguf.py: transformers' model
written as a GGUF file the way llama.cpp's converter writes one (``conversion/deepseek.py``
``DeepseekV2Model``: its keys, one KV head of the latent cache's lengths, the heads' in the
``_mla`` keys, ``block_count`` counting a multi-token-prediction layer, the checkpoint's
tensors unpermuted under llama.cpp's names, each layer's experts stacked into 3-d tensors,
``kv_b_proj`` split per head into ``attn_k_b`` (transposed) and ``attn_v_b``, or unsplit
as older files hold it), its weights quantized; the reference is then transformers' model
holding what the file holds (each weight dequantized by gguf-py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from gguf import ExpertGatingFuncType, GGMLQuantizationType, GGUFWriter
from gguf_models import _tokenizer_fields
from gguf_writing import add_tensor, finish, gguf_name, layer_of
from test_arch_phi3 import random_model
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GenerationConfig,
)

from freetoken_core.models.gguf_deepseek2 import LAYER_TENSORS
from freetoken_core.models.resolve import default_gguf_path

_GGUF_OF = {hf.replace("expert_bias", "gate.e_score_correction_bias"): g
            for g, hf in LAYER_TENSORS.items() if "{e}" not in hf}
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32,
         "kv_lora_rank": 32, "qk_nope_head_dim": 32, "qk_rope_head_dim": 8, "v_head_dim": 16,
         "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "n_shared_experts": 1, "first_k_dense_replace": 1, "max_position_embeddings": 2048,
         "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 2}


def deepseek_model(vocab_size: int, v3: bool = True, seed: int = 0, **overrides: Any) -> Any:
    """transformers' tiny float32 DeepSeek-V3 (groups 2 of 4, a routed scale of 2.5, YaRN
    over a 64-token original length with ``mscale_all_dim`` 1, a selection bias that
    changes the choice) or V2 (greedy softmax routing, queries from ``q_proj``) of
    ``overrides``, O(1)-scale random weights."""
    if v3:
        config_class, model_class = DeepseekV3Config, DeepseekV3ForCausalLM
        extra: dict[str, Any] = {
            "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                "original_max_position_embeddings": 64, "mscale": 1.0,
                                "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}}
    else:
        config_class, model_class = DeepseekV2Config, DeepseekV2ForCausalLM
        extra = {"q_lora_rank": None, "topk_method": "greedy", "n_shared_experts": 2,
                 "routed_scaling_factor": 1.5}
    config = config_class(**{**SHAPE, "vocab_size": vocab_size, **extra, **overrides})
    config.architectures = [model_class.__name__]
    model = random_model(model_class, config, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        model.lm_head.weight[:7] *= 0.5  # special tokens: rarely greedy picks
        for layer in model.model.layers[config.first_k_dense_replace:]:
            if v3:
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.3, generator=gen)
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=2, pad_token_id=2)
    return model


def write_deepseek2_gguf(path: Path, model: Any, mtp: dict[str, torch.Tensor] | None = None,
                         weight_type: int = GGMLQuantizationType.Q8_0, split_kv_b: bool = True,
                         drop_keys: tuple[str, ...] = (), keys: dict[str, Any] | None = None
                         ) -> Any:
    """``model`` (and its ``mtp`` layer, ``gguf_glm4moe_files.mtp_layer``) written to
    ``path`` as llama.cpp's converter writes a DeepSeek model (the default model's
    vocabulary; weights in ``weight_type`` where their rows are whole blocks, the routers
    and 1-d tensors F32; ``split_kv_b`` False: the older files' unsplit ``attn_kv_b`` and
    head sizes in ``key_length`` / ``value_length``); ``drop_keys`` left out and ``keys``
    written instead of the converter's (error cases). Returns ``model`` holding the file's
    weights."""
    cfg = model.config
    v3 = isinstance(cfg, DeepseekV3Config)
    nextn = 1 if mtp else 0
    rope = cfg.rope_parameters
    nope, rot, v, kv_lora = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                             cfg.kv_lora_rank)
    values: dict[str, Any] = {
        "block_count": cfg.num_hidden_layers + nextn,
        "context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
        "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": 1,
        "rope.freq_base": float(rope["rope_theta"]),
        "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        "expert_count": cfg.n_routed_experts, "expert_used_count": cfg.num_experts_per_tok,
        "expert_gating_func": int(ExpertGatingFuncType.SIGMOID if v3
                                  else ExpertGatingFuncType.SOFTMAX),
        "leading_dense_block_count": cfg.first_k_dense_replace,
        "vocab_size": cfg.vocab_size, "attention.kv_lora_rank": kv_lora,
        "expert_feed_forward_length": cfg.moe_intermediate_size,
        "expert_shared_count": cfg.n_shared_experts,
        "expert_weights_scale": float(cfg.routed_scaling_factor),
        "rope.dimension_count": rot,
        **({"attention.key_length": kv_lora + rot, "attention.value_length": kv_lora,
            "attention.key_length_mla": nope + rot, "attention.value_length_mla": v}
           if split_kv_b else {"attention.key_length": nope + rot,
                               "attention.value_length": v}),
        **({"attention.q_lora_rank": cfg.q_lora_rank} if cfg.q_lora_rank else {}),
        **({"expert_group_count": cfg.n_group, "expert_group_used_count": cfg.topk_group,
            "expert_weights_norm": bool(cfg.norm_topk_prob)} if v3 else {}),
        **({"nextn_predict_layers": nextn} if nextn else {})}
    if rope.get("rope_type") == "yarn":
        values.update({"rope.scaling.type": "yarn", "rope.scaling.factor": float(rope["factor"]),
                       "rope.scaling.original_context_length":
                           rope["original_max_position_embeddings"],
                       "rope.scaling.yarn_beta_fast": float(rope["beta_fast"]),
                       "rope.scaling.yarn_beta_slow": float(rope["beta_slow"]),
                       "rope.scaling.yarn_log_multiplier": 0.1 * rope["mscale_all_dim"]})
    values = {**{k: v for k, v in values.items() if k not in drop_keys}, **(keys or {})}
    writer = GGUFWriter(str(path), "deepseek2")
    for key, value in values.items():
        name = f"deepseek2.{key}"
        if isinstance(value, bool):
            writer.add_bool(name, value)
        elif isinstance(value, float):
            writer.add_float32(name, value)
        elif isinstance(value, str):
            writer.add_string(name, value)
        else:
            writer.add_uint32(name, value)
    for key, value, kind in _tokenizer_fields(default_gguf_path()):
        writer.add_key_value(key, value, kind[0], sub_type=kind[1] if len(kind) > 1 else None)
    held: dict[str, torch.Tensor] = {}
    heads = cfg.num_attention_heads
    for name, tensor in {**model.state_dict(), **(mtp or {})}.items():
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
        elif name.endswith("kv_b_proj.weight") and split_kv_b:
            k_b, v_b = tensor.view(heads, nope + v, kv_lora).split([nope, v], dim=1)
            k_b = add_tensor(writer, f"blk.{layer_of(name)}.attn_k_b.weight",
                       k_b.transpose(1, 2).contiguous(), weight_type)
            v_b = add_tensor(writer, f"blk.{layer_of(name)}.attn_v_b.weight", v_b.contiguous(),
                       weight_type)
            held[name] = torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(tensor.shape)
        else:
            held[name] = add_tensor(writer, gguf_name(name, _GGUF_OF), tensor, weight_type)
    finish(writer)
    model.load_state_dict({k: v for k, v in held.items() if k in model.state_dict()})
    return model
