"""Tiny random Nemotron-H models for tests/test_arch_nemotron_h_gguf.py: transformers' model,
written as a GGUF file the way llama.cpp's converter writes one (``conversion/nemotron.py``
``NemotronHModel`` over ``GraniteHybridModel``: its keys, gguf-py's tensor names for
``nemotron_h`` / ``nemotron_h_moe``, and each change it makes to a tensor, copied here from
the converter), optionally with the multi-token-prediction block it appends (random: neither
transformers nor FreeToken runs it). 2-d and 3-d weights quantized where the converter
quantizes them; the reference is then transformers' model holding what the file holds (each
tensor as gguf-py dequantizes it, the converter's reshapes and permutations inverted on the
indices, ``log(-a)`` for ``ssm_a``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from gguf import MODEL_ARCH, GGMLQuantizationType, GGUFWriter, get_tensor_name_map
from gguf_granite4_files import add_keys
from gguf_models import _tokenizer_fields
from gguf_qwen35_files import _add as add_tensor
from gguf_writing import finish
from test_arch_phi3 import random_model
from transformers import GenerationConfig, NemotronHConfig, NemotronHForCausalLM

from freetoken_core.models.resolve import default_gguf_path


def nemotron_h_model(vocab_size: int, seed: int = 0, **overrides: Any) -> NemotronHForCausalLM:
    """transformers' tiny float32 Nemotron-H of ``overrides`` (hidden 64, 4 heads of 32 - not
    hidden / heads, as Nemotron Nano 2's -, 2 KV heads; Mamba-2 of 8 heads of 8 in 2 groups)
    with O(1)-scale random weights (tests/test_arch_phi3.py's ``random_model``) and a random
    selection bias for its experts."""
    config = NemotronHConfig(**{
        "vocab_size": vocab_size, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 2048,
        "layer_norm_epsilon": 1e-5, "mamba_num_heads": 8, "mamba_head_dim": 8, "n_groups": 2,
        "ssm_state_size": 16, "chunk_size": 8, "bos_token_id": 0, "eos_token_id": 2,
        "pad_token_id": 2, **overrides})
    config.architectures = ["NemotronHForCausalLM"]
    model = random_model(NemotronHForCausalLM, config, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        model.lm_head.weight[:7] *= 0.5  # special tokens: rarely greedy picks
        for layer in model.model.layers:  # (the bias changes which experts are chosen)
            if hasattr(layer.mixer, "gate"):
                layer.mixer.gate.e_score_correction_bias.normal_(0.0, 0.3, generator=gen)
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=2, pad_token_id=2)
    return model


def _permute(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """The converter's ``LlamaModel.permute`` (q/k rows for llama.cpp's rotary pairs)."""
    return t.reshape(n_head, 2, t.shape[0] // n_head // 2, *t.shape[1:]).swapaxes(1, 2
                                                                                   ).reshape(t.shape)


def _converted(cfg: Any, name: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """``NemotronHModel.modify_tensors`` (and the filters before it) of transformers'
    tensor ``name`` (the released checkpoint's under ``backbone.``, each expert apart, which
    the converter stacks back into transformers' 3-d tensor): the name gguf-py maps and the
    tensor, its elements rearranged as the converter rearranges them (``ssm_a``'s ``-exp``
    left to the caller)."""
    name = "backbone." + name.removeprefix("model.") if name.startswith("model.") else name
    if name.endswith(".dt_bias"):
        name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
    elif name.endswith("e_score_correction_bias"):
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
    elif name.endswith("conv1d.weight"):
        t = t.squeeze()
    elif name.endswith((".A_log", ".D")):
        t = t.reshape(-1, 1)
    elif name.endswith("mixer.norm.weight"):
        t = t.reshape(cfg.n_groups, -1)
    elif name.endswith("q_proj.weight"):
        t = _permute(t, cfg.num_attention_heads)
    elif name.endswith("k_proj.weight"):
        t = _permute(t, cfg.num_key_value_heads)
    yield name, t


def _gguf_name(names: Any, name: str) -> str:
    """The file's name of the converter's tensor ``name`` (``_converted``)."""
    if ".mixer.experts." in name:  # (stacked: model.layers.{i}.mlp.experts.{w}.weight)
        layer, w = name.split(".")[2], name.rsplit(".", 1)[-1].removesuffix("_proj")
        return f"blk.{layer}.ffn_{w}_exps.weight"
    mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
    assert mapped is not None, name
    return mapped


def write_nemotron_h_gguf(path: Path, model: NemotronHForCausalLM,
                          weight_type: int = GGMLQuantizationType.Q8_0, mtp: bool = False
                          ) -> NemotronHForCausalLM:
    """``model`` written to ``path`` as llama.cpp's converter writes a Nemotron-H (the default
    model's vocabulary, which ``model``'s must match): 1-d tensors, norms, the router, the
    convolution, ``ssm_a`` / ``ssm_d`` F32, the other weights ``weight_type`` (0: F32); with
    a random multi-token-prediction block after the model's where ``mtp``. Returns ``model``
    holding the file's weights."""
    cfg = model.config
    moe = "moe" in cfg.layers_block_type
    arch = "nemotron_h_moe" if moe else "nemotron_h"
    writer = GGUFWriter(str(path), arch)
    add_keys(writer, {f"{arch}.{k}": v for k, v in nemotron_h_keys(cfg, mtp).items()})
    for key, value, kind in _tokenizer_fields(default_gguf_path()):
        writer.add_key_value(key, value, kind[0], sub_type=kind[1] if len(kind) > 1 else None)
    names = get_tensor_name_map(MODEL_ARCH.NEMOTRON_H_MOE if moe else MODEL_ARCH.NEMOTRON_H,
                                cfg.num_hidden_layers + 1)
    held: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        values = tensor.detach().float()
        index = torch.arange(values.numel()).reshape(values.shape)
        original = torch.empty(values.numel())
        for (mapped, stored), (_, at) in zip(_converted(cfg, name, values),
                                             _converted(cfg, name, index)):
            if mapped.endswith(".A_log"):
                stored = -torch.exp(stored)
            gguf_name = _gguf_name(names, mapped)
            written = add_tensor(writer, gguf_name, stored,
                                 0 if _is_f32(gguf_name, stored) else weight_type)
            if mapped.endswith(".A_log"):
                written = torch.log(-written)
            original[at.reshape(-1)] = written.reshape(-1)
        held[name] = original.reshape(values.shape)
    if mtp:
        _add_mtp_block(writer, cfg, weight_type)
    finish(writer)
    model.load_state_dict(held)
    return model


def _is_f32(gguf_name: str, t: torch.Tensor) -> bool:
    """Whether the converter writes tensor ``gguf_name`` F32 whatever the file's type (1-d
    tensors, norms, the router, the convolution, tensors not named ``.weight``)."""
    return (t.dim() == 1 or gguf_name.endswith(("_norm.weight", "ffn_gate_inp.weight",
                                                "ssm_conv1d.weight"))
            or not gguf_name.endswith(".weight"))


def _add_mtp_block(writer: GGUFWriter, cfg: Any, qtype: int) -> None:
    """A random multi-token-prediction block after the model's (``mtp.layers.0`` / ``.1``
    folded into one block: the ``nextn`` tensors, an attention and the experts)."""
    gen = torch.Generator().manual_seed(11)
    h, heads, kv, d = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                       cfg.head_dim)
    e, ff, shared = cfg.n_routed_experts, cfg.moe_intermediate_size, (
        cfg.moe_shared_expert_intermediate_size)
    shapes = {"nextn.enorm.weight": (h,), "nextn.hnorm.weight": (h,),
              "nextn.eh_proj.weight": (h, 2 * h), "nextn.shared_head_norm.weight": (h,),
              "attn_norm.weight": (h,), "attn_q.weight": (heads * d, h),
              "attn_k.weight": (kv * d, h), "attn_v.weight": (kv * d, h),
              "attn_output.weight": (h, heads * d), "post_attention_norm.weight": (h,),
              "ffn_gate_inp.weight": (e, h), "exp_probs_b.bias": (e,),
              "ffn_up_exps.weight": (e, ff, h), "ffn_down_exps.weight": (e, h, ff),
              "ffn_up_shexp.weight": (shared, h), "ffn_down_shexp.weight": (h, shared)}
    for name, shape in shapes.items():
        t = torch.randn(*shape, generator=gen)
        name = f"blk.{cfg.num_hidden_layers}.{name}"
        add_tensor(writer, name, t, 0 if _is_f32(name, t) else qtype)


def nemotron_h_keys(cfg: Any, mtp: bool = False) -> dict[str, Any]:
    """The converter's metadata of the model ``cfg`` (transformers' config, as the released
    config.json gives it: ``TextModel``'s keys, then ``GraniteHybridModel``'s and
    ``NemotronHModel``'s over them), by key without the architecture's prefix: ints written
    as uint32, floats as float32, lists as arrays. ``mtp``: with the prediction block, in
    ``block_count`` and in the arrays as an attention and an expert block."""
    kinds = list(cfg.layers_block_type) + (["full_attention+moe"] if mtp else [])
    moe = "moe" in cfg.layers_block_type
    ffn = cfg.moe_intermediate_size if moe else cfg.intermediate_size
    keys: dict[str, Any] = {
        "block_count": len(kinds),
        "context_length": 2 ** 20,  # (GraniteHybridModel's where it does not rotate)
        "embedding_length": cfg.hidden_size,
        "feed_forward_length": [ffn if k in ("mlp", "moe", "full_attention+moe") else 0
                                for k in kinds],
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": [cfg.num_key_value_heads if "full_attention" in k else 0
                                    for k in kinds],
        "attention.layer_norm_epsilon": float(cfg.layer_norm_epsilon),
        "vocab_size": cfg.vocab_size,
        # (GraniteModel drops head_dim, so LlamaModel writes hidden / heads)
        "rope.dimension_count": cfg.hidden_size // cfg.num_attention_heads,
        "ssm.conv_kernel": cfg.conv_kernel, "ssm.state_size": cfg.ssm_state_size,
        "ssm.group_count": cfg.n_groups,
        "ssm.inner_size": cfg.mamba_num_heads * cfg.mamba_head_dim,
        "ssm.time_step_rank": cfg.mamba_num_heads,
        "rope.scaling.finetuned": False,
        "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
    }
    if moe:
        keys.update({
            "expert_count": cfg.n_routed_experts, "expert_used_count": cfg.num_experts_per_tok,
            "expert_group_count": cfg.n_group, "expert_group_used_count": cfg.topk_group,
            "expert_feed_forward_length": cfg.moe_intermediate_size,
            "expert_shared_feed_forward_length": cfg.moe_shared_expert_intermediate_size,
            "expert_shared_count": cfg.n_shared_experts,
            "expert_weights_norm": bool(cfg.norm_topk_prob),
            "expert_weights_scale": float(cfg.routed_scaling_factor)})
    if mtp:
        keys["nextn_predict_layers"] = 1
    return keys
