"""Granite 4 (``GraniteMoeHybridForCausalLM`` directories), exact against transformers: greedy
tokens and every position's logits, its Mamba-2 layers' states kept per sequence by the
engine.

Tiny random models: Mamba-2 layers (8 heads in 2 groups, chunks of 8 tokens, so prompts cross
many of them) beside an attention layer, Granite's multipliers away from 1, experts beside the
shared MLP (h-tiny-like, with RoPE) or the shared MLP alone (h-micro-like, NoPE). As for
Qwen3.5 (tests/test_arch_qwen3_5.py), the states must come out as transformers' single pass
leaves them however the engine runs a sequence."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_arch_gemma3 import engine_path
from test_arch_phi3 import save_tiny_model
from test_arch_qwen3_5 import assert_matches, generate, prompts_of, served
from test_gguf_rope_factors import greedy
from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.mamba2 import chunk_scan

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHAPE: dict[str, Any] = {
    "num_hidden_layers": 4, "layer_types": ["mamba", "attention", "mamba", "mamba"],
    "mamba_n_heads": 8, "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_chunk_size": 8,
    "intermediate_size": 32, "shared_intermediate_size": 48, "embedding_multiplier": 1.5,
    "residual_multiplier": 0.7, "attention_multiplier": 0.2, "logits_scaling": 2.0}
SHAPES = {"h-tiny-like": {"num_local_experts": 4, "num_experts_per_tok": 2,
                          "position_embedding_type": "rope"},
          "h-micro-like": {"num_local_experts": 0, "position_embedding_type": None}}


@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_granite4_directory_matches_transformers(tmp_path: Path, shape: str, path: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    native, _ = engine_path(path, monkeypatch)
    model_dir = save_tiny_model(tmp_path, GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM,
                                **SHAPE, **SHAPES[shape])
    hf = GraniteMoeHybridForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = served(model_dir)
    model = assert_matches(llm, hf, 7, [[], [1, 1, 70]])
    cfg = model.config
    assert model.native is native and cfg.architecture == "granitemoehybrid"
    assert cfg.layer_kinds == ("mamba", "attention", "mamba", "mamba")
    assert (model.layers[0].moe is not None) == (shape == "h-tiny-like")
    assert model.rotates == (shape == "h-tiny-like")


def test_granite4_states_across_slots_chunks_and_preemption(tmp_path: Path) -> None:
    model_dir = save_tiny_model(tmp_path, GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM,
                                **SHAPE, **SHAPES["h-tiny-like"])
    hf = GraniteMoeHybridForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = prompts_of(served(model_dir, max_num_seqs=1), 7)
    want = greedy(hf, prompts, 12)
    assert generate(served(model_dir, max_num_seqs=2, max_num_batched_tokens=16),
                    prompts) == want
    llm = served(model_dir, kv_cache_tokens=192, block_size=8, max_num_seqs=4)
    assert generate(llm, prompts) == want
    assert llm.engine.core.scheduler.num_preemptions > 0


def test_chunk_scan_is_the_recurrence() -> None:
    gen = torch.Generator().manual_seed(0)
    length, heads, size, state_size = 37, 4, 6, 5
    x = torch.randn(length, heads, size, generator=gen)
    dt = torch.rand(length, heads, generator=gen)
    a = -torch.rand(heads, generator=gen) * 2
    b, c = (torch.randn(length, heads, state_size, generator=gen) for _ in range(2))
    state = torch.randn(heads, size, state_size, generator=gen)
    out, final = chunk_scan(x, dt, a, b, c, state, chunk=8)
    s, outs = state, []
    for t in range(length):
        s = s * torch.exp(dt[t] * a)[:, None, None] + (dt[t][:, None, None] * b[t][:, None]
                                                     * x[t][..., None])
        outs.append((s @ c[t][..., None])[..., 0])
    torch.testing.assert_close(out, torch.stack(outs), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, s, atol=1e-4, rtol=1e-4)


def test_granite4_config_defaults_and_errors() -> None:
    base = {"architectures": ["GraniteMoeHybridForCausalLM"], "vocab_size": 64,
            "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "mamba_n_heads": 8}
    cfg = ModelConfig.from_dict(base)
    assert cfg.layer_kinds == ("mamba", "mamba") and cfg.mamba_shape == (8, 16, 1, 256, 4,
                                                                          256)
    assert cfg.num_experts == 8 and cfg.expert_gating == "softmax_weight"
    assert cfg.no_rope_layers == (0, 0)  # (no position_embedding_type: NoPE)
    for bad, match in (({"mamba_n_heads": 7}, "mamba_n_heads"),
                       ({"mamba_d_conv": 1}, "mamba_d_conv"),
                       ({"layer_types": ["conv", "mamba"]}, "layer_types"),
                       ({"num_experts_per_tok": 9}, "num_experts_per_tok")):
        with pytest.raises(ModelLoadError, match=match):
            ModelConfig.from_dict({**base, **bad})
