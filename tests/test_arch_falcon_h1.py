"""Falcon-H1 (``FalconH1ForCausalLM`` directories), exact against transformers: greedy tokens and
every position's logits, each block's attention (keys and values in the paged cache) and
Mamba-2 mixer (a state per sequence, kept by the engine) side by side.

Tiny random models (the mixer's 8 heads in 2 groups, chunks of 8 tokens, so prompts cross many
of them), every µP multiplier a different value away from 1, so that each one matters:
- 0.5b-like: no gated norm (``mamba_rms_norm`` false, as most released models), no biases;
- h1r-like: the gated norm after the gate (``mamba_norm_before_gate`` false, as released),
  tied embeddings;
- defaults-like: transformers' defaults where the released configs set them otherwise: the
  norm before the gate, ``mamba_d_ssm`` null (``mamba_expand`` x hidden), ``mamba_d_head``
  auto; every bias (attention, MLP, the mixer's projections) and none on the convolution."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from test_arch_gemma3 import engine_path
from test_arch_phi3 import save_tiny_model
from test_arch_qwen3_5 import assert_matches, generate, prompts_of, served
from test_gguf_rope_factors import greedy
from transformers import FalconH1Config, FalconH1ForCausalLM

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.config_falcon_h1 import HybridMultipliers
from freetoken_core.models.kv_layout import kv_cache_dims

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MULTIPLIERS: dict[str, Any] = {
    "embedding_multiplier": 1.7, "lm_head_multiplier": 0.6, "attention_in_multiplier": 0.8,
    "key_multiplier": 0.55, "attention_out_multiplier": 0.9, "ssm_in_multiplier": 1.25,
    "ssm_out_multiplier": 0.7, "ssm_multipliers": [0.5, 1.4, 0.75, 1.3, 0.6],
    "mlp_multipliers": [0.65, 1.35]}
SHAPE: dict[str, Any] = {
    "num_hidden_layers": 3, "head_dim": 16, "intermediate_size": 96, "mamba_d_ssm": 64,
    "mamba_n_heads": 8, "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_chunk_size": 8,
    "mamba_norm_before_gate": False, **MULTIPLIERS}
SHAPES: dict[str, dict[str, Any]] = {
    "0.5b-like": {"mamba_rms_norm": False},
    "h1r-like": {"mamba_rms_norm": True, "tie_word_embeddings": True},
    "defaults-like": {"mamba_rms_norm": True, "mamba_norm_before_gate": True,
                      "mamba_d_ssm": None, "mamba_expand": 1, "attention_bias": True,
                      "mlp_bias": True, "projectors_bias": True, "mamba_proj_bias": True,
                      "mamba_conv_bias": False},
}


def tiny(tmp_path: Path, shape: str) -> tuple[Path, Any]:
    model_dir = save_tiny_model(tmp_path, FalconH1Config, FalconH1ForCausalLM,
                                **{**SHAPE, **SHAPES[shape]})
    return model_dir, FalconH1ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("shape,path", [("0.5b-like", "native"), ("0.5b-like", "torch"),
                                        ("h1r-like", "native"), ("h1r-like", "torch"),
                                        ("defaults-like", "native")])
def test_falcon_h1_directory_matches_transformers(tmp_path: Path, shape: str, path: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    native, _ = engine_path(path, monkeypatch)
    model_dir, hf = tiny(tmp_path, shape)
    llm = served(model_dir)
    model = assert_matches(llm, hf, 7, [[], [1, 1, 70], [64, 64]])
    cfg = model.config
    assert model.native is native and cfg.architecture == "falcon_h1"
    assert llm.engine.core.runner.recurrent and cfg.layer_kinds == ("hybrid",) * 3
    assert kv_cache_dims(cfg) == (3, 2, 16)  # (every layer's keys and values)
    assert cfg.mamba_norm == {"0.5b-like": "none", "h1r-like": "after_gate",
                              "defaults-like": "before_gate"}[shape]
    mixer = model.layers[0].mamba
    assert (mixer.norm is None) == (shape == "0.5b-like")
    assert (mixer.in_proj.bias is not None) == (mixer.conv_bias is None) == (
        shape == "defaults-like")


def test_falcon_h1_states_across_slots_chunks_and_preemption(tmp_path: Path) -> None:
    model_dir, hf = tiny(tmp_path, "h1r-like")
    prompts = prompts_of(served(model_dir, max_num_seqs=1), 7)
    want = greedy(hf, prompts, 12)
    # several sequences decoding together, prompts in chunks of 16 crossing the scan's 8
    assert generate(served(model_dir, max_num_seqs=2, max_num_batched_tokens=16),
                    prompts) == want
    # more requests than slots, a cache too small for them all: preempted and recomputed
    llm = served(model_dir, kv_cache_tokens=192, block_size=8, max_num_seqs=4)
    assert generate(llm, prompts) == want
    assert llm.engine.core.scheduler.num_preemptions > 0


BASE = {"architectures": ["FalconH1ForCausalLM"], "vocab_size": 64, "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4}


def test_falcon_h1_config_defaults() -> None:
    cfg = ModelConfig.from_dict(BASE)  # (FalconH1Config's defaults for the rest)
    assert cfg.layer_kinds == ("hybrid", "hybrid") and cfg.num_kv_heads == 8
    assert cfg.head_dim == 16 and cfg.intermediate_size == 14_336 and cfg.rope_theta == 1e4
    # mamba_d_ssm 1024 over 128 heads of 8 (auto), 1 group, state 256, kernel 4, chunks 256
    assert cfg.mamba_shape == (128, 8, 1, 256, 4, 256)
    assert cfg.mamba_norm == "none" and cfg.mamba_time_step_limit == (0.0, math.inf)
    assert cfg.hybrid_multipliers == HybridMultipliers()
    assert (cfg.embedding_multiplier, cfg.logit_scale, cfg.tie_word_embeddings,
            cfg.rms_norm_eps, cfg.max_position_embeddings) == (1.0, 1.0, False, 1e-5, 8192)
    assert ModelConfig.from_dict({**BASE, "mamba_rms_norm": True}).mamba_norm == "before_gate"
    assert ModelConfig.from_dict({**BASE, "time_step_limit": [0.0, 1.5]}
                                 ).mamba_time_step_limit == (0.0, 1.5)
    cfg = ModelConfig.from_dict({**BASE, "mamba_d_ssm": None, "mamba_n_heads": 4,
                                 "num_key_value_heads": None, **MULTIPLIERS})
    assert cfg.mamba_shape[:2] == (4, 32) and cfg.num_kv_heads == 4  # (2 x 64 over 4)
    assert cfg.hybrid_multipliers == HybridMultipliers(
        attention_in=0.8, key=0.55, attention_out=0.9, ssm_in=1.25,
        ssm_projection=(0.5, 1.4, 0.75, 1.3, 0.6), ssm_out=0.7, mlp_gate=0.65, mlp_down=1.35)
    assert (cfg.embedding_multiplier, cfg.logit_scale) == (1.7, 0.6)


@pytest.mark.parametrize("change,match", [
    ({"mamba_n_heads": 7}, r"mamba_n_heads 7 x mamba_d_head 146 must be .* \(1024\)"),
    ({"mamba_d_head": 16}, "mamba_d_head 16 must be"),
    ({"mamba_n_groups": 3}, "a multiple of mamba_n_groups"),
    ({"mamba_d_conv": 1}, "mamba_d_conv must be a positive integer"),
    ({"mamba_chunk_size": 0}, "mamba_chunk_size must be a positive integer"),
    ({"mamba_d_state": 16.0}, "mamba_d_state must be a positive integer"),
    ({"time_step_limit": [1.0]}, "time_step_limit must be two numbers"),
    ({"key_multiplier": None}, "key_multiplier must be a finite number, not None"),
    ({"lm_head_multiplier": "0.5"}, "lm_head_multiplier must be a finite number"),
    ({"ssm_multipliers": [1.0] * 4}, "ssm_multipliers must be a list of 5 numbers"),
    ({"mlp_multipliers": [1.0, float("nan")]}, "mlp_multipliers must be a finite number"),
    ({"hidden_act": "gelu"}, "FalconH1ForCausalLM with hidden activation 'gelu'"),
])
def test_falcon_h1_config_errors(change: dict[str, Any], match: str) -> None:
    with pytest.raises(ModelLoadError, match=match):
        ModelConfig.from_dict({**BASE, **change})
