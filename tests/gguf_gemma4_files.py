"""Tiny random Gemma 4 models for tests/test_arch_gemma4.py: transformers' model (its weights
at scales that keep greedy logits apart), saved as a directory, or written as a GGUF file the
way llama.cpp's converter writes one (``conversion/gemma.py`` ``Gemma4Model``: its keys, its
tensor names, ``rope_freqs`` for the global layers' proportional rope), its 2-d weights
quantized; the reference is then transformers' model holding what the file holds (each
weight dequantized by gguf-py)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf_models import _tokenizer_fields
from gguf_writing import add_tensor, finish
from transformers import Gemma4ForCausalLM, Gemma4TextConfig, GenerationConfig

from freetoken_core.models.gguf_gemma4 import GLOBAL_TENSORS, LAYER_TENSORS
from freetoken_core.models.resolve import default_gguf_path

# The checkpoint's names the converter renames beyond the table FreeToken reads them with.
_CHECKPOINT = {"router.proj.weight": "ffn_gate_inp.weight",
               "experts.gate_up_proj": "ffn_gate_up_exps.weight",
               "experts.down_proj": "ffn_down_exps.weight"}
_GGUF_OF = {**{hf: g for g, hf in LAYER_TENSORS.items() if "{e}" not in hf}, **_CHECKPOINT}


def gemma4_model(vocab_size: int, seed: int = 0, **overrides: Any) -> Gemma4ForCausalLM:
    """transformers' tiny float32 Gemma 4 of ``overrides`` (hidden 64, 4 heads, 2 KV heads):
    embeddings small beside the residual branches (post-norm weights ~2, the final norm's
    ~3), so the tied head does not echo the last token; each layer's ``layer_scalar`` and
    the routers' scales away from 1, so that leaving one out shows."""
    config = Gemma4TextConfig(**{
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "global_head_dim": 32, "sliding_window": 8,
        "hidden_size_per_layer_input": 0, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 2,
        **overrides})
    config.architectures = ["Gemma4ForCausalLM"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Gemma4ForCausalLM(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    centres = {"post_attention_layernorm": 2.0, "post_feedforward_layernorm": 2.0,
               "norm": 3.0}
    with torch.no_grad():
        for name, param in model.named_parameters():
            kind = name.rsplit(".", 2)[-2]
            if name.endswith("embed_tokens.weight"):
                param.normal_(0.0, 0.125, generator=gen)
                param[:7] *= 0.5  # special tokens: rarely greedy picks
            elif "norm" in name:
                centre = centres.get(kind, 1.0)
                param.uniform_(centre - 0.1, centre + 0.1, generator=gen)
            elif name.endswith(("router.scale", "per_expert_scale")):
                param.uniform_(0.5, 1.5, generator=gen)
            elif param.dim() == 1:
                param.normal_(0.0, 0.1, generator=gen)
            else:
                param.normal_(0.0, 2.0 / math.sqrt(param.shape[-1]), generator=gen)
        for layer in model.model.layers:
            layer.layer_scalar.uniform_(0.6, 1.4, generator=gen)
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=2, pad_token_id=2)
    return model


def write_gemma4_gguf(path: Path, model: Gemma4ForCausalLM,
                      weight_type: int = GGMLQuantizationType.Q8_0,
                      tokenizer_fields: list[tuple[str, Any, Any]] | None = None,
                      chat_template: str | None = None) -> Gemma4ForCausalLM:
    """``model`` written to ``path`` as llama.cpp's converter writes a Gemma 4
    (``tokenizer_fields``' vocabulary, default the default model's, which ``model``'s must
    match; ``chat_template`` as ``tokenizer.chat_template``; 2-d weights in ``weight_type``
    where their rows are whole blocks of it, else F32); returns ``model`` holding the file's
    weights."""
    cfg = model.config
    if tokenizer_fields is None:
        tokenizer_fields = _tokenizer_fields(default_gguf_path())
    writer = GGUFWriter(str(path), "gemma4")
    p = "gemma4."
    layers, types = cfg.num_hidden_layers, cfg.layer_types
    full = [t == "full_attention" for t in types]
    shapes = [(cfg.per_layer_config[i].num_key_value_heads, cfg.per_layer_config[i].head_dim)
              for i in range(layers)]
    full_dim = next(d for (_, d), f in zip(shapes, full) if f)
    swa_dim = next(d for (_, d), f in zip(shapes, full) if not f)
    for key, value in (("context_length", cfg.max_position_embeddings),
                       ("embedding_length", cfg.hidden_size), ("block_count", layers),
                       ("attention.head_count", cfg.num_attention_heads),
                       ("attention.key_length", full_dim), ("attention.value_length", full_dim),
                       ("attention.key_length_swa", swa_dim),
                       ("attention.value_length_swa", swa_dim),
                       ("rope.dimension_count", full_dim),
                       ("rope.dimension_count_swa", swa_dim),
                       ("attention.sliding_window", cfg.sliding_window),
                       ("attention.shared_kv_layers", cfg.num_kv_shared_layers),
                       ("embedding_length_per_layer_input", cfg.hidden_size_per_layer_input)):
        writer.add_uint32(p + key, value)
    kv = [h for h, _ in shapes]
    if len(set(kv)) > 1:
        writer.add_array(p + "attention.head_count_kv", kv)
    else:
        writer.add_uint32(p + "attention.head_count_kv", kv[0])
    ff = [model.model.layers[i].mlp.down_proj.weight.shape[1] for i in range(layers)]
    if len(set(ff)) > 1:
        writer.add_array(p + "feed_forward_length", ff)
    else:
        writer.add_uint32(p + "feed_forward_length", ff[0])
    writer.add_array(p + "attention.sliding_window_pattern", [not f for f in full])
    rope = cfg.rope_parameters
    writer.add_float32(p + "rope.freq_base", rope["full_attention"]["rope_theta"])
    writer.add_float32(p + "rope.freq_base_swa", rope["sliding_attention"]["rope_theta"])
    writer.add_float32(p + "attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    if cfg.final_logit_softcapping is not None:
        writer.add_float32(p + "final_logit_softcapping", cfg.final_logit_softcapping)
    if cfg.enable_moe_block:
        writer.add_uint32(p + "expert_count", cfg.num_experts)
        writer.add_uint32(p + "expert_used_count", cfg.top_k_experts)
        writer.add_uint32(p + "expert_feed_forward_length", cfg.moe_intermediate_size)
    for key, value, kind in tokenizer_fields:
        writer.add_key_value(key, value, kind[0], sub_type=kind[1] if len(kind) > 1 else None)
    if chat_template is not None:
        writer.add_string("tokenizer.chat_template", chat_template)
    # The global layers' proportional rope as the converter writes it: a factor a pair.
    turning = int(full_dim * rope["full_attention"].get("partial_rotary_factor", 1.0) / 2)
    writer.add_tensor("rope_freqs.weight", np.array(
        [1.0] * turning + [1e30] * (full_dim // 2 - turning), dtype=np.float32))
    state = model.state_dict()
    held: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        gguf_name = _gguf_name(name)
        if gguf_name is None:  # (a shared layer's unused k/v: the converter writes them too)
            continue
        held[name] = add_tensor(writer, gguf_name, tensor.detach().float(), weight_type)
    finish(writer)
    model.load_state_dict(held, strict=False)
    return model


def _gguf_name(name: str) -> str | None:
    """The converter's name of the checkpoint's tensor ``name``."""
    glob = {hf: g for g, hf in GLOBAL_TENSORS.items()}
    glob.update({"model.embed_tokens.weight": "token_embd.weight",
                 "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"})
    if name in glob:
        return glob[name]
    _, _, index, rest = name.split(".", 3)
    return f"blk.{index}.{_GGUF_OF[rest]}" if rest in _GGUF_OF else None
