"""Tiny random Qwen3.5-MoE and Qwen3-Next models for tests/test_arch_qwen35moe_gguf.py:
transformers' model, written as a ``qwen35moe`` / ``qwen3next`` GGUF file the way llama.cpp's
converter writes one (``conversion/qwen.py``: ``Qwen3_5MoeTextModel`` over
``_LinearAttentionVReorderBase``, ``Qwen3NextModel`` and ``Qwen2MoeModel``; ``Qwen3NextModel``
over ``Qwen2MoeModel``: its keys, the tensor names of llama.cpp's ``constants.py`` and each
change it makes to a tensor, copied here from the converter), 2-d and 3-d weights quantized
(the router, the shared expert's gate and the convolution F32, as the converter keeps them);
the reference is transformers' model holding what the file holds (each tensor as gguf-py
dequantizes it, the converter's permutations and splits inverted on the indices, its
elementwise changes undone by ``gguf_qwen35_files._undone``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf_models import _tokenizer_fields
from gguf_qwen35_files import _add, _reordered, _undone, add_keys, qwen35_keys
from gguf_writing import finish
from test_arch_phi3 import random_model
from transformers import (
    GenerationConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from freetoken_core.models.resolve import default_gguf_path

# transformers' names under ``model.layers.{i}.`` -> the file's under ``blk.{i}.`` (llama.cpp's
# gguf-py tensor_mapping for these architectures).
_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    **{f"self_attn.{p}_proj.weight": f"attn_{p}.weight" for p in "qkv"},
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.in_proj_qkvz.weight": "ssm_in.weight",
    "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_proj.bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    **{f"mlp.experts.{p}_proj.weight": f"ffn_{p}_exps.weight" for p in ("gate", "up", "down",
                                                                        "gate_up")},
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    **{f"mlp.shared_expert.{p}_proj.weight": f"ffn_{p}_shexp.weight"
       for p in ("gate", "up", "down")},
}
_F32 = ("_norm.weight", "ssm_conv1d.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")
NEXTN = {"nextn.eh_proj": 2, "nextn.enorm": 0, "nextn.hnorm": 0, "nextn.shared_head_norm": 0}


def moe_model(arch: str, vocab_size: int, seed: int = 0, **overrides: Any) -> Any:
    """transformers' tiny float32 Qwen3.5-MoE (``arch`` ``qwen35moe``) or Qwen3-Next
    (``qwen3next``) of ``overrides`` (hidden 64, 4 heads of 16, 2 KV heads, RoPE on half of
    each head; 4 experts of 32, 2 a token, a shared one of 48) with O(1)-scale random
    weights (tests/test_arch_phi3.py's ``random_model``)."""
    config_class, model_class = ((Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM)
                                 if arch == "qwen35moe" else
                                 (Qwen3NextConfig, Qwen3NextForCausalLM))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.5}
    if arch == "qwen35moe":
        rope.update(mrope_section=[2, 1, 1], mrope_interleaved=True)
    else:
        overrides = {"intermediate_size": 96, **overrides}
    config = config_class(**{
        "vocab_size": vocab_size, "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "bos_token_id": 0,
        "eos_token_id": 2, "pad_token_id": 2, "rope_parameters": rope, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, **overrides})
    config.architectures = [model_class.__name__]
    model = random_model(model_class, config, seed)
    with torch.no_grad():
        if config.tie_word_embeddings:
            model.lm_head.weight *= 0.25
        model.lm_head.weight[:7] *= 0.5  # special tokens: rarely greedy picks
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=2, pad_token_id=2)
    return model


def _pieces(arch: str, cfg: Any, name: str, t: torch.Tensor, fused_experts: bool,
            legacy: bool) -> list[tuple[str, torch.Tensor]]:
    """The converter's reorderings, renames and splits of checkpoint tensor ``name`` (values
    or indices alike): the tensors it writes, by transformers' names of ``_NAMES``."""
    if arch == "qwen35moe":  # (_LinearAttentionVReorderBase: value heads tiled)
        t = _reordered(cfg, name, t)
    if name.endswith("conv1d.weight"):
        t = t.squeeze()
    if name.endswith(".dt_bias"):
        return [(name.rpartition(".dt_bias")[0] + ".dt_proj.bias", t)]
    if name.endswith("mlp.experts.gate_up_proj"):  # (Qwen2MoeModel: split on dim -2)
        if fused_experts:  # (as a file of llama.cpp's fused gate_up_exps has it)
            return [(name + ".weight", t)]
        half = t.shape[-2] // 2
        base = name.removesuffix(".gate_up_proj")
        return [(base + ".gate_proj.weight", t[..., :half, :].contiguous()),
                (base + ".up_proj.weight", t[..., half:, :].contiguous())]
    if name.endswith("mlp.experts.down_proj"):
        return [(name + ".weight", t)]
    if name.endswith("in_proj_qkvz.weight") and not legacy:  # (Qwen3NextModel's split)
        k_heads, v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        sizes = [dk, dk, v_heads // k_heads * dv, v_heads // k_heads * dv]
        data = t.permute(1, 0).contiguous().view(-1, k_heads, sum(sizes))
        q, k, v, z = (x.contiguous().view(cfg.hidden_size, -1)
                      for x in torch.split(data, sizes, dim=-1))
        base = name.removesuffix("in_proj_qkvz.weight")
        return [(base + "in_proj_qkv.weight", torch.cat([q, k, v], dim=-1).permute(1, 0)),
                (base + "in_proj_z.weight", z.permute(1, 0).contiguous())]
    return [(name, t)]


def _values(name: str, t: torch.Tensor) -> torch.Tensor:
    """The converter's elementwise changes (``Qwen3NextModel.modify_tensors``)."""
    if name.endswith(".A_log"):
        return -torch.exp(t)
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return t + 1
    return t


def gguf_name(name: str) -> str:
    """The file's name of transformers' tensor ``name`` (as ``_pieces`` names it)."""
    if not name.startswith("model.layers."):
        return {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight":
                "output.weight", "model.norm.weight": "output_norm.weight"}[name]
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{_NAMES[rest]}"


def write_moe_gguf(path: Path, arch: str, model: Any,
                   weight_type: int = GGMLQuantizationType.Q8_0, mtp: bool = False,
                   recurrent_layers: bool = True, fused_experts: bool = False,
                   legacy: bool = False) -> Any:
    """``model`` written to ``path`` as llama.cpp's converter writes an ``arch`` file (the
    default model's vocabulary, which ``model``'s must match): weights ``weight_type`` (F16
    where a row is not whole blocks of it); ``mtp``: a multi-token-prediction block after
    the layers (the last layer's tensors again and random ``nextn`` ones, not read);
    ``recurrent_layers``: the layer kinds as ``attention.recurrent_layers``, else
    ``full_attention_interval`` alone; ``fused_experts``: the experts' gate and up as one
    ``ffn_gate_up_exps``; ``legacy`` (qwen3next): ``in_proj_qkvz`` as ``ssm_in``, unsplit.
    Returns ``model`` holding the file's weights."""
    cfg = model.config
    layers = cfg.num_hidden_layers
    writer = GGUFWriter(str(path), arch)
    add_keys(writer, moe_keys(arch, cfg, mtp, recurrent_layers))
    for key, value, kind in _tokenizer_fields(default_gguf_path()):
        writer.add_key_value(key, value, kind[0], sub_type=kind[1] if len(kind) > 1 else None)
    held: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        values = tensor.detach().float()
        index = torch.arange(values.numel()).reshape(values.shape)
        original = torch.empty(values.numel())
        for (mapped, stored), (_, where) in zip(
                _pieces(arch, cfg, name, values, fused_experts, legacy),
                _pieces(arch, cfg, name, index, fused_experts, legacy)):
            target = gguf_name(mapped)
            f32 = stored.dim() == 1 or target.endswith(_F32)
            written = _add(writer, target, _values(name, stored), 0 if f32 else weight_type)
            original[where.reshape(-1)] = _undone(name, written).reshape(-1)
            if mtp and name.startswith(f"model.layers.{layers - 1}."):  # (the MTP block)
                _add(writer, target.replace(f"blk.{layers - 1}.", f"blk.{layers}.", 1),
                     torch.randn(stored.shape), 0 if f32 else weight_type)
        held[name] = original.reshape(values.shape)
    if mtp:
        gen = torch.Generator().manual_seed(7)
        for name, dims in NEXTN.items():
            shape = (cfg.hidden_size, 2 * cfg.hidden_size) if dims else (cfg.hidden_size,)
            _add(writer, f"blk.{layers}.{name}.weight", torch.randn(*shape, generator=gen),
                 weight_type if dims else 0)
    finish(writer)
    if cfg.tie_word_embeddings:
        held["lm_head.weight"] = held["model.embed_tokens.weight"]
    model.load_state_dict(held)
    return model


def moe_keys(arch: str, cfg: Any, mtp: bool = False, recurrent_layers: bool = True
             ) -> dict[str, Any]:
    """The converter's metadata of an ``arch`` model ``cfg``, by key (``add_keys``):
    Qwen3.5's (``qwen35_keys``) under ``arch``, no ``feed_forward_length`` where the config
    has no ``intermediate_size`` (Qwen3.5-MoE's), no rope sections for Qwen3-Next
    (``_Qwen35MRopeMixin`` is Qwen3.5's), and ``Qwen2MoeModel``'s expert keys."""
    keys = {arch + k.removeprefix("qwen35"): v for k, v in qwen35_keys(
        _WithSize(cfg), mtp, recurrent_layers).items()}
    if getattr(cfg, "intermediate_size", None) is None:
        del keys[arch + ".feed_forward_length"]
    if arch == "qwen3next":
        del keys[arch + ".rope.dimension_sections"]
    keys.update({f"{arch}.{k}": v for k, v in {
        "expert_count": cfg.num_experts, "expert_used_count": cfg.num_experts_per_tok,
        "expert_feed_forward_length": cfg.moe_intermediate_size,
        "expert_shared_feed_forward_length": cfg.shared_expert_intermediate_size}.items()})
    return keys


class _WithSize:
    """``cfg`` with an ``intermediate_size`` (0 where it has none) for ``qwen35_keys``."""

    def __init__(self, cfg: Any) -> None:
        self._cfg = cfg

    def __getattr__(self, name: str) -> Any:
        if name == "intermediate_size":
            return getattr(self._cfg, name, None) or 0
        return getattr(self._cfg, name)
