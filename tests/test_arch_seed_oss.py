"""Seed-OSS (``SeedOssForCausalLM`` directories, ``seed_oss`` GGUF files), exact against
transformers: greedy tokens and every position's logits.

Llama's computation with biases on the q/k/v projections (``attention_bias``, on by
default) and on the o projection where a checkpoint has one (``attention_out_bias``), a
head size of its own (128 by default, not hidden / heads), and transformers' defaults for
left-out keys. llama.cpp's converter writes ``seed_oss`` files with the q/k rows as the
checkpoint has them and the MLP's input norm as ``post_attention_norm``; the GGUF file's
reference is built from gguf-py's dequantization (transformers' GGUF loader does not read
seed_oss)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf_models import Q4_0, Q8_0, write_gguf
from gguf_reference_families import hf_seed_oss_from_gguf
from test_arch_gemma3 import chunked_logits
from test_arch_moe import matching_logits, served_directory
from test_gguf_rope_factors import LONG, greedy, served
from transformers import SeedOssConfig, SeedOssForCausalLM

from freetoken_core.models.config import ModelConfig

PROMPTS = ["Hello world, this is", "def add(a, b):\n    return", LONG]


def assert_biases_matter(llm, ids: list[int], ref: torch.nn.Module) -> None:
    """Every position's logits equal ``ref``'s; without the q/k/v biases they differ."""
    model, want = matching_logits(llm, ids, ref)
    saved = [layer.qkv_proj.bias for layer in model.layers]
    assert all(b is not None for b in saved)
    try:
        for layer in model.layers:
            layer.qkv_proj.bias = torch.zeros_like(layer.qkv_proj.bias)
        assert (chunked_logits(model, ids, [len(ids)]) - want).abs().max() > 0.05
    finally:
        for layer, bias in zip(model.layers, saved):
            layer.qkv_proj.bias = bias


@pytest.mark.parametrize("out_bias", [False, True])
def test_seed_oss_directory_matches_transformers(tmp_path: Path, out_bias: bool) -> None:
    hf, llm, prompts, got = served_directory(
        tmp_path / "seed_oss", SeedOssConfig, SeedOssForCausalLM, head_dim=32,
        attention_out_bias=out_bias, rope_parameters={"rope_type": "default",
                                                      "rope_theta": 10000.0})
    model = llm.engine.core.runner.model
    assert model.config.architecture == "seed_oss" and model.config.head_dim == 32
    assert (model.layers[0].o_proj.bias is not None) == out_bias
    assert got == greedy(hf, prompts, 16)
    assert_biases_matter(llm, prompts[-1], hf)


@pytest.mark.parametrize("tied", [True, False])
def test_seed_oss_gguf_matches_transformers(tmp_path: Path, tied: bool) -> None:
    path = write_gguf(tmp_path / "seed_oss.gguf", "seed_oss", hidden=64, layers=3, heads=4,
                      kv_heads=2, head_dim=32, ff=96, tied=tied, seed=6, weight_type=Q8_0,
                      rope_theta=10000.0, types={"attn_output.weight": Q4_0})
    hf = hf_seed_oss_from_gguf(path)
    llm, prompts, got = served(path, PROMPTS, 16)
    model = llm.engine.core.runner.model
    assert model.config.architecture == "seed_oss" and model.uses_gguf_blocks
    assert got == greedy(hf, prompts, 16)
    assert_biases_matter(llm, prompts[-1], hf)


def test_seed_oss_config_defaults() -> None:
    cfg = ModelConfig.from_dict({"architectures": ["SeedOssForCausalLM"], "hidden_size": 64,
                                 "num_attention_heads": 4, "intermediate_size": 128})
    # transformers' SeedOssConfig: head_dim 128, 8 KV heads, q/k/v biases
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.attention_bias) == (128, 8, True)
    assert (cfg.vocab_size, cfg.num_layers, cfg.eos_token_ids) == (155136, 64, (2,))
