"""EXAONE 3.0 / 3.5 (``ExaoneForCausalLM`` directories, ``exaone`` GGUF files), exact
against transformers (which computes it as ``LlamaForCausalLM``): greedy tokens and every
position's logits.

What is EXAONE's own: config.json's key names (``num_layers``, ``layer_norm_epsilon``,
``activation_function``) and defaults, the checkpoints' GPT-2 tensor names
(``transformer.h.{i}.attn.attention.q_proj`` ...), and in a GGUF file q/k rows as the
checkpoint has them (half-offset rotary pairs: llama.cpp's converter permutes its ``llama``
files' rows, not these) with EXAONE 3.5's Llama 3 rope scaling as ``rope_freqs`` factors.
The directory is a tiny random model saved by transformers (which writes the released
tensor names) with config.json in the released form; the GGUF file's reference is built
from gguf-py's dequantization (transformers' GGUF loader does not read exaone)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf_models import Q4_K, Q8_0, write_gguf
from gguf_reference_families import hf_exaone_from_gguf
from safetensors import safe_open
from test_arch_moe import matching_logits
from test_arch_phi3 import save_tiny_model
from test_gguf_rope_factors import LLAMA3, LONG, greedy, llama3_factors, served
from transformers import AutoModelForCausalLM, ExaoneConfig, LlamaForCausalLM

from freetoken_core.models.config import ModelConfig
from freetoken_core.models.config_defaults import exaone_config

PROMPTS = ["Hello world, this is", "def add(a, b):\n    return", LONG]
# config.json's keys as the released checkpoints name them (ExaoneConfig.attribute_map).
RELEASED = {"num_hidden_layers": "num_layers", "rms_norm_eps": "layer_norm_epsilon",
            "hidden_act": "activation_function"}


def test_exaone_directory_as_released_matches_transformers(tmp_path: Path) -> None:
    model_dir = save_tiny_model(tmp_path / "exaone", ExaoneConfig, LlamaForCausalLM,
                                rope_parameters={"rope_theta": 10000.0, **LLAMA3})
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config = {RELEASED.get(k, k): v for k, v in config.items()}
    params = config.pop("rope_parameters")
    config.update(architectures=["ExaoneForCausalLM"], rope_theta=params.pop("rope_theta"),
                  rope_scaling=params)
    path.write_text(json.dumps(config))
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        assert "transformer.h.0.attn.attention.q_proj.weight" in f.keys()  # noqa: SIM118
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert hf.config.num_hidden_layers == 2 and hf.config.rms_norm_eps == 1e-5
    llm, prompts, got = served(model_dir, PROMPTS, 16)
    cfg = llm.engine.core.runner.model.config
    assert (cfg.architecture, cfg.num_layers, cfg.rms_norm_eps) == ("exaone", 2, 1e-5)
    assert cfg.rope_scaling["rope_type"] == "llama3"
    assert got == greedy(hf, prompts, 16)
    matching_logits(llm, prompts[-1], hf)


@pytest.mark.parametrize("tied", [True, False])
def test_exaone_gguf_matches_transformers(tmp_path: Path, tied: bool) -> None:
    """Q/k as the checkpoint has them, and (untied) EXAONE 3.5's ``rope_freqs``."""
    scaling = {"rope_theta": 10000.0, **LLAMA3}
    factors = None if tied else {"rope_freqs.weight": llama3_factors(64, 10000.0, LLAMA3)}
    path = write_gguf(tmp_path / "exaone.gguf", "exaone", hidden=256, ff=512, heads=4,
                      kv_heads=2, tied=tied, seed=5, weight_type=Q4_K, rope_theta=10000.0,
                      context=256, rope_factors=factors,
                      types={"attn_v.weight": Q8_0, "token_embd.weight": Q8_0})
    hf = hf_exaone_from_gguf(path, **({} if tied else {"rope_parameters": scaling}))
    llm, prompts, got = served(path, PROMPTS, 16)
    model = llm.engine.core.runner.model
    assert model.config.architecture == "exaone" and model.uses_gguf_blocks
    assert (model.config.rope_scaling is None) == tied
    assert got == greedy(hf, prompts, 16)
    matching_logits(llm, prompts[-1], hf)


def test_exaone_config_keys_and_defaults() -> None:
    released = {"architectures": ["ExaoneForCausalLM"], "num_layers": 3,
                "layer_norm_epsilon": 1e-6, "activation_function": "silu",
                "num_hidden_layers": 5, "hidden_size": 64, "num_attention_heads": 4}
    out = exaone_config(released)
    # transformers' name wins over its alias; ExaoneConfig's defaults fill the rest
    assert out["num_hidden_layers"] == 5 and out["rms_norm_eps"] == 1e-6
    assert out["num_key_value_heads"] == 8 and out["rope_theta"] == 500_000.0
    assert exaone_config({"rope_parameters": {"rope_theta": 7.0}}).get("rope_theta") is None
    cfg = ModelConfig.from_dict({"architectures": ["ExaoneForCausalLM"], "num_layers": 2,
                                 "hidden_size": 64, "num_attention_heads": 8,
                                 "intermediate_size": 128})
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.vocab_size) == (2, 8, 102400)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.eos_token_ids) == (500_000.0, 1e-5, (361,))
