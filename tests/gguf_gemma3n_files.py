"""Tiny random Gemma 3n models for tests/test_arch_gemma3n.py: transformers' model (its weights
at scales that make AltUp's router, LAuReL and the per-layer inputs matter), saved as a
directory, or written as a GGUF file the way llama.cpp's converter writes one
(``conversion/gemma.py`` ``Gemma3NModel``): its keys; gguf-py's tensor names (its
``TensorNameMap``, as the converter maps them, not FreeToken's table); the AltUp projections
stacked into one 3-d tensor each; the sparsities as their standard normal quantiles; the
shared layers' unused k/v, as a checkpoint holds them. Its 2-d weights are quantized; the
reference is then transformers' model holding what the file holds (each weight dequantized
by gguf-py). The models here have a per-layer row for every token (the converter would pad
the table with zero rows to the vocabulary)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf_models import _tokenizer_fields
from gguf_writing import add_tensor, finish
from transformers import Gemma3nForCausalLM, Gemma3nTextConfig, GenerationConfig

from freetoken_core.models.resolve import default_gguf_path

# Each weight kind's scale (the normal's standard deviation; the norms and the correction
# scale uniform about a centre): the router's logits about 0.4, so that AltUp's coefficients
# matter (larger, and the random model amplifies float32's rounding past the tests' bounds).
_STD = {"modality_router": 3.0, "prediction_coefs": 0.3, "correction_coefs": 0.3}
_CENTRES = {"norm": 3.0, "correct_output_scale": 1.0}


def gemma3n_model(vocab_size: int, seed: int = 0, **overrides: Any) -> Gemma3nForCausalLM:
    """transformers' tiny float32 Gemma 3n of ``overrides`` (hidden 64, 4 heads of 16, 2 KV
    heads, windows of 8 keys, per-layer inputs of 16, LAuReL of rank 8): embeddings small
    beside the residual branches (the final norm's weights ~3), so the tied head does not
    echo the last token."""
    config = Gemma3nTextConfig(**{
        "vocab_size": vocab_size, "vocab_size_per_layer_input": vocab_size,
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "sliding_window": 8, "hidden_size_per_layer_input": 16, "laurel_rank": 8,
        "num_kv_shared_layers": 0, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
        "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 2, **overrides})
    config.architectures = ["Gemma3nForCausalLM"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Gemma3nForCausalLM(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            kind = name.removesuffix(".weight").rsplit(".", 1)[-1]
            if name.endswith("embed_tokens.weight"):
                param.normal_(0.0, 0.125, generator=gen)
                param[:7] *= 0.5  # special tokens: rarely greedy picks
            elif "norm" in kind or kind == "correct_output_scale":
                centre = _CENTRES.get(kind, 1.0)
                param.uniform_(centre - 0.5 * (kind == "correct_output_scale") - 0.1,
                               centre + 0.5 * (kind == "correct_output_scale") + 0.1,
                               generator=gen)
            elif kind in _STD:
                param.normal_(0.0, _STD[kind], generator=gen)
            else:
                param.normal_(0.0, 2.0 / math.sqrt(param.shape[-1]), generator=gen)
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=2, pad_token_id=2)
    return model


def write_gemma3n_gguf(path: Path, model: Gemma3nForCausalLM,
                       weight_type: int = GGMLQuantizationType.Q8_0,
                       omit: tuple[str, ...] = ()) -> Gemma3nForCausalLM:
    """``model`` written to ``path`` as llama.cpp's converter writes a Gemma 3n (the default
    model's vocabulary, which ``model``'s must match; 2-d weights in ``weight_type`` where
    their rows are whole blocks of it, else F32; the metadata keys ``omit`` left out);
    returns ``model`` holding the file's weights."""
    cfg = model.config
    if cfg.vocab_size_per_layer_input != cfg.vocab_size or not cfg.altup_correct_scale:
        raise ValueError("the file's reference: a model with a per-layer row for every token "
                         "(the converter pads the table) and its corrections scaled (llama.cpp "
                         "always scales them)")
    writer = GGUFWriter(str(path), "gemma3n")
    p = "gemma3n."
    layers = cfg.num_hidden_layers
    quantiles = [torch.distributions.Normal(0, 1).icdf(torch.tensor(s, dtype=torch.float32))
                 .item() for s in cfg.activation_sparsity_pattern]
    keys: list[tuple[str, str, Any]] = [
        ("uint32", "context_length", cfg.max_position_embeddings),
        ("uint32", "embedding_length", cfg.hidden_size), ("uint32", "block_count", layers),
        ("array", "feed_forward_length", list(cfg.intermediate_size)),
        ("uint32", "attention.head_count", cfg.num_attention_heads),
        ("uint32", "attention.head_count_kv", cfg.num_key_value_heads),
        ("uint32", "attention.key_length", cfg.head_dim),
        ("uint32", "attention.value_length", cfg.head_dim),
        ("float32", "attention.layer_norm_rms_epsilon", cfg.rms_norm_eps),
        ("float32", "rope.freq_base", cfg.rope_parameters["full_attention"]["rope_theta"]),
        ("float32", "rope.freq_base_swa",
         cfg.rope_parameters["sliding_attention"]["rope_theta"]),
        ("float32", "final_logit_softcapping", cfg.final_logit_softcapping),
        ("uint32", "attention.sliding_window", cfg.sliding_window),
        ("uint32", "altup.active_idx", cfg.altup_active_idx),
        ("uint32", "altup.num_inputs", cfg.altup_num_inputs),
        ("uint32", "embedding_length_per_layer_input", cfg.hidden_size_per_layer_input),
        ("uint32", "attention.shared_kv_layers", cfg.num_kv_shared_layers),
        ("array", "activation_sparsity_scale", quantiles),
        ("array", "attention.sliding_window_pattern",
         [t == "sliding_attention" for t in cfg.layer_types])]
    for kind, key, value in keys:
        if key not in omit:
            getattr(writer, f"add_{kind}")(p + key, value)
    for key, value, kinds in _tokenizer_fields(default_gguf_path()):
        writer.add_key_value(key, value, kinds[0],
                             sub_type=kinds[1] if len(kinds) > 1 else None)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3N, layers)

    def gguf_name(name: str) -> str:  # (the converter's: filter_tensors, map_tensor_name)
        return names.get_name(name if name.endswith(".weight") else name + ".weight",
                              try_suffixes=(".weight",))

    state = model.state_dict()
    held: dict[str, torch.Tensor] = {}
    for kind in ("altup_projections", "altup_unembed_projections"):
        stack = [f"model.{kind}.{i}.weight" for i in range(cfg.altup_num_inputs - 1)]
        written = add_tensor(writer, gguf_name(f"model.{kind}"),
                       torch.stack([state.pop(n) for n in stack]), weight_type)
        held.update(zip(stack, written))
    for name, tensor in state.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        held[name] = add_tensor(writer, gguf_name(name), tensor.detach().float(), weight_type)
    gen = torch.Generator().manual_seed(5)
    for i, kind in enumerate(cfg.kv_sharing_modes):  # (a checkpoint's unused k/v)
        if kind == "reuse":
            for suffix, rows in (("k", cfg.num_key_value_heads * cfg.head_dim),
                                 ("v", cfg.num_key_value_heads * cfg.head_dim)):
                add_tensor(writer, f"blk.{i}.attn_{suffix}.weight",
                     torch.randn(rows, cfg.hidden_size, generator=gen), weight_type)
            add_tensor(writer, f"blk.{i}.attn_k_norm.weight", torch.ones(cfg.head_dim), weight_type)
    finish(writer)
    model.load_state_dict(held, strict=False)
    return model

