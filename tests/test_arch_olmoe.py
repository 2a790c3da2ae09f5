"""OLMoE (``OlmoeForCausalLM`` directories, ``olmoe`` GGUF files: OLMoE-1B-7B), exact against
transformers: greedy tokens and every position's logits.

Llama's blocks with OLMo's q/k RMSNorms over all heads at once and a mixture of experts in
every layer (softmax routing, the top k not renormalized by default; llama.cpp's olmoe graph
passes ``norm_w`` false). The GGUF file is written as llama.cpp's converter writes it
(experts stacked in 3-d tensors of ``feed_forward_length`` each, the q/k rows unpermuted),
its reference built from gguf-py's dequantization (transformers' GGUF loader does not read
olmoe)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf_models import Q8_0, write_gguf
from gguf_reference_families import hf_olmoe_from_gguf
from test_arch_exaone4 import assert_qk_norms_matter
from test_arch_moe import assert_logits_match, matching_logits, served_directory
from test_gguf_rope_factors import LONG, greedy, served
from transformers import OlmoeConfig, OlmoeForCausalLM

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config import ModelConfig

PROMPTS = ["Hello world, this is", "def add(a, b):\n    return", LONG]


def assert_full_width_norms_matter(llm, ids: list[int], ref: torch.nn.Module) -> None:
    """Every position's logits equal ``ref``'s; without the q/k norms (over all heads) they
    differ."""
    model, want = matching_logits(llm, ids, ref)
    assert model.layers[0].q_norm.numel() == model.config.num_heads * model.config.head_dim
    assert_qk_norms_matter(model, ids, want)


def test_olmoe_directory_matches_transformers(tmp_path: Path) -> None:
    hf, llm, prompts, got = served_directory(
        tmp_path / "olmoe", OlmoeConfig, OlmoeForCausalLM, num_experts=8,
        num_experts_per_tok=3, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    cfg = llm.engine.core.runner.model.config
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok) == ("olmoe", 8, 3)
    assert not cfg.norm_topk_prob and cfg.qk_norm
    assert got == greedy(hf, prompts, 16)
    assert_logits_match(llm, prompts[-1], hf, renormalized=False)
    assert_full_width_norms_matter(llm, prompts[-1], hf)


def test_olmoe_gguf_matches_transformers(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "olmoe.gguf", "olmoe", hidden=64, layers=2, heads=4,
                      kv_heads=4, ff=32, experts=8, experts_used=3, weight_type=Q8_0,
                      tied=False, seed=12)
    hf = hf_olmoe_from_gguf(path)
    llm, prompts, got = served(path, PROMPTS, 16)
    model = llm.engine.core.runner.model
    assert (model.config.architecture, model.config.moe_intermediate_size) == ("olmoe", 32)
    assert model.uses_gguf_blocks
    assert got == greedy(hf, prompts, 16)
    assert_logits_match(llm, prompts[-1], hf, renormalized=False)


def test_olmoe_config_defaults_and_clip_qkv() -> None:
    base = {"architectures": ["OlmoeForCausalLM"], "vocab_size": 64, "hidden_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4}
    cfg = ModelConfig.from_dict(base)  # (transformers' OlmoeConfig defaults)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (64, 8, 2048)
    with pytest.raises(ModelLoadError, match="clip_qkv"):
        ModelConfig.from_dict({**base, "clip_qkv": 8.0})
