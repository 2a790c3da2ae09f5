"""Arcee (``ArceeForCausalLM`` directories, ``arcee`` GGUF files: AFM-4.5B), exact against
transformers: greedy tokens and every position's logits.

Llama's model with an MLP that is not gated: ``down(relu(up(x))^2)`` (transformers'
``relu2``; llama.cpp's ``LLM_FFN_RELU_SQR`` on ``ffn_up`` alone), which leaves the one-call
native block (SwiGLU only). Its converter is Llama's: the q/k rows permuted, which the GGUF
reference un-permutes as transformers' GGUF loader does for Llama; ``rope_freqs`` where the
checkpoint has Llama 3 scaling."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf_models import Q4_K, Q8_0, write_gguf
from gguf_reference_families import hf_arcee_from_gguf
from test_arch_gemma3 import chunked_logits
from test_arch_moe import matching_logits, served_directory
from test_gguf_rope_factors import LONG, greedy, served
from transformers import ArceeConfig, ArceeForCausalLM

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config import ModelConfig

PROMPTS = ["Hello world, this is", "def add(a, b):\n    return", LONG]


def assert_relu2_matters(llm, ids: list[int], ref: torch.nn.Module) -> None:
    """Every position's logits equal ``ref``'s; with ReLU instead of its square they differ."""
    model, want = matching_logits(llm, ids, ref)
    assert all(not layer.gated and layer.one_call is None for layer in model.layers)
    relu = torch.relu
    try:
        torch.relu = lambda x: torch.sqrt(relu(x))  # (the square of this is plain ReLU)
        assert (chunked_logits(model, ids, [len(ids)]) - want).abs().max() > 0.05
    finally:
        torch.relu = relu


def test_arcee_directory_matches_transformers(tmp_path: Path) -> None:
    hf, llm, prompts, got = served_directory(tmp_path / "arcee", ArceeConfig, ArceeForCausalLM,
                                             num_hidden_layers=3)
    model = llm.engine.core.runner.model
    assert model.config.architecture == "arcee" and not model.config.gated_mlp
    assert got == greedy(hf, prompts, 16)
    assert_relu2_matters(llm, prompts[-1], hf)


@pytest.mark.parametrize("tied", [True, False])
def test_arcee_gguf_matches_transformers(tmp_path: Path, tied: bool) -> None:
    path = write_gguf(tmp_path / "arcee.gguf", "arcee", hidden=256, ff=512, heads=4,
                      kv_heads=2, layers=2, tied=tied, seed=7, weight_type=Q4_K,
                      rope_theta=10000.0, types={"attn_v.weight": Q8_0})
    hf = hf_arcee_from_gguf(path)
    llm, prompts, got = served(path, PROMPTS, 16)
    model = llm.engine.core.runner.model
    assert model.config.architecture == "arcee" and model.uses_gguf_blocks
    assert got == greedy(hf, prompts, 16)
    assert_relu2_matters(llm, prompts[-1], hf)


def test_arcee_activation_is_checked() -> None:
    base = {"architectures": ["ArceeForCausalLM"], "vocab_size": 64, "hidden_size": 64,
            "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4}
    assert not ModelConfig.from_dict(base).gated_mlp  # (transformers' default: relu2)
    with pytest.raises(ModelLoadError, match="relu2"):
        ModelConfig.from_dict({**base, "hidden_act": "silu"})
