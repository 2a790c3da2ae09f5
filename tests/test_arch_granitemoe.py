"""Granite MoE (``GraniteMoeForCausalLM`` directories, ``granitemoe`` GGUF files: Granite 3.x
1B-A400M, 3B-A800M), exact against transformers: greedy tokens and every position's logits.

Granite's model (its embedding, residual, attention and logit multipliers) with experts in
every layer: each token's top k experts weighted by the softmax of their router logits
(llama.cpp: the softmax of all, the top k renormalized: the same weights). The released
checkpoints' names are JetMoE's (``block_sparse_moe.input_linear`` holding gate and up,
``output_linear``, ``router.layer``), which transformers saves again. The GGUF file is
written as llama.cpp's converter writes it (gate and up apart, Llama's q/k permutation), its
reference built from gguf-py's dequantization with the q/k rows un-permuted."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf_models import Q8_0, write_gguf
from gguf_reference_families import hf_granitemoe_from_gguf
from safetensors import safe_open
from test_arch_exaone4 import differs
from test_arch_moe import matching_logits, served_directory
from test_gguf_rope_factors import LONG, greedy, served
from transformers import GraniteMoeConfig, GraniteMoeForCausalLM

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.gguf import convert_gguf

PROMPTS = ["Hello world, this is", "def add(a, b):\n    return", LONG]
# (Granite 3's are 12, 0.22, 1/128 and 8: here the residual branches keep the random model's
# greedy tokens varied, as tests/test_arch_granite.py's.)
MULTIPLIERS = {"embedding_multiplier": 0.5, "residual_multiplier": 1.5,
               "attention_multiplier": 0.125, "logits_scaling": 8.0}


def assert_logits_match(llm, ids: list[int], ref) -> None:
    """Every position's logits equal ``ref``'s (the prompt in two chunks); with the top k
    weighted by their share of the softmax of all the logits (not renormalized) they
    differ, and with a routing scale."""
    model, want = matching_logits(llm, ids, ref)
    sparse = [layer.moe for layer in model.layers if layer.moe is not None]
    assert sparse and all(moe.gating == "softmax_weight" for moe in sparse)
    try:
        for moe in sparse:
            moe.gating, moe.norm_topk_prob = "softmax", False
        assert differs(model, ids, want)
        for moe in sparse:
            moe.gating, moe.scale = "softmax_weight", 2.0
        assert differs(model, ids, want)
    finally:
        for moe in sparse:
            moe.gating, moe.scale = "softmax_weight", 1.0


def test_granitemoe_directory_matches_transformers(tmp_path: Path) -> None:
    hf, llm, prompts, got = served_directory(
        tmp_path / "granitemoe", GraniteMoeConfig, GraniteMoeForCausalLM, num_local_experts=8,
        num_experts_per_tok=3, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        **MULTIPLIERS)
    with safe_open(str(tmp_path / "granitemoe" / "model.safetensors"), framework="pt") as f:
        assert "model.layers.0.block_sparse_moe.input_linear.weight" in f.keys()  # noqa: SIM118
    cfg = llm.engine.core.runner.model.config
    assert (cfg.architecture, cfg.num_experts, cfg.expert_gating) == (
        "granitemoe", 8, "softmax_weight")
    assert (cfg.embedding_multiplier, cfg.query_scale) == (0.5, 0.125)
    assert got == greedy(hf, prompts, 16)
    assert_logits_match(llm, prompts[-1], hf)


def test_granitemoe_gguf_matches_transformers(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "granitemoe.gguf", "granitemoe", hidden=64, layers=2,
                      heads=4, kv_heads=2, ff=32, experts=8, experts_used=3, tied=False,
                      weight_type=Q8_0, seed=13, metadata={
                          "embedding_scale": 0.5, "residual_scale": 1.5,
                          "attention.scale": 0.125, "logit_scale": 8.0})
    hf = hf_granitemoe_from_gguf(path, **MULTIPLIERS)
    llm, prompts, got = served(path, PROMPTS, 16)
    model = llm.engine.core.runner.model
    assert (model.config.architecture, model.config.moe_intermediate_size) == ("granitemoe", 32)
    assert model.uses_gguf_blocks
    assert got == greedy(hf, prompts, 16)
    assert_logits_match(llm, prompts[-1], hf)


def test_the_shared_expert_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="GraniteMoeSharedForCausalLM"):
        ModelConfig.from_dict({"architectures": ["GraniteMoeSharedForCausalLM"],
                               "vocab_size": 64, "hidden_size": 64, "intermediate_size": 64,
                               "num_hidden_layers": 1, "num_attention_heads": 4})
    path = write_gguf(tmp_path / "shared.gguf", "granitemoe", experts=4, experts_used=2,
                      seed=1, metadata={"expert_shared_feed_forward_length": 32})
    with pytest.raises(ModelLoadError, match="granitemoe with shared experts"):
        convert_gguf(path, tmp_path / "out", progress=False)

