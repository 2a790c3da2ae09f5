"""EXAONE 4 (``Exaone4ForCausalLM`` directories, ``exaone4`` GGUF files), exact against
transformers: greedy tokens and every position's logits.

Its differences from Llama, each of which moves the logits when left out: norms after the
attention and the MLP instead of before (OLMo 2's), q and k RMSNormed per head, and - where
it has a sliding window, as the 32B - sliding layers (every 4th layer global; a window of 8
keys here, so the long prompt's queries see a part of it) whose queries and keys are
rotated beside global layers whose are not (NoPE), with Llama 3's rope scaling in the
checkpoints. The 1.2B has no window: every layer global and rotated. The directories are
tiny random models saved by transformers; the GGUF files are written as llama.cpp's
converter writes them (no input norms, per-head q/k norms, the weights unpermuted), their
reference transformers' model built from gguf-py's dequantization (transformers' GGUF
loader does not read exaone4)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf_models import Q4_0, Q8_0, write_gguf
from gguf_reference_families import hf_olmo_from_gguf
from test_arch_gemma3 import chunked_logits
from test_arch_moe import matching_logits, served_directory
from test_gguf_rope_factors import LONG, greedy, served
from transformers import Exaone4Config, Exaone4ForCausalLM

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.gguf import convert_gguf

PROMPTS = ["Hello world, this is", "def add(a, b):\n    return", LONG]
HYBRID = {"num_hidden_layers": 4, "sliding_window": 8, "sliding_window_pattern": 4,
          "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 16}}
GLOBAL = {"num_hidden_layers": 3, "sliding_window": None, "tie_word_embeddings": True,
          "layer_types": ["full_attention"] * 3,
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


def differs(model: Any, ids: list[int], want: torch.Tensor) -> bool:
    return bool((chunked_logits(model, ids, [len(ids)]) - want).abs().max() > 0.05)


def assert_logits_match(llm: Any, ids: list[int], ref: torch.nn.Module, hybrid: bool) -> None:
    """Every position's logits equal ``ref``'s (the prompt in two chunks); with the q/k norms
    or (hybrid) the windows or the global layers' NoPE left out they differ."""
    model, want = matching_logits(llm, ids, ref)
    assert all(layer.q_norm.numel() == model.config.head_dim for layer in model.layers)
    assert_qk_norms_matter(model, ids, want)
    if not hybrid:
        assert not model.config.no_rope_layers and not model.config.layer_windows
        return
    assert_windows_and_nope_matter(model, ids, want)


def assert_qk_norms_matter(model: Any, ids: list[int], want: torch.Tensor) -> None:
    """With the q/k norms' weights all ones, ``model``'s logits of ``ids`` differ from
    ``want``."""
    norms = [(layer.q_norm, layer.k_norm) for layer in model.layers]
    try:
        for layer in model.layers:
            layer.q_norm, layer.k_norm = (torch.ones_like(w) for w in (layer.q_norm,
                                                                        layer.k_norm))
        assert differs(model, ids, want)
    finally:
        for layer, (q, k) in zip(model.layers, norms):
            layer.q_norm, layer.k_norm = q, k


def assert_windows_and_nope_matter(model: Any, ids: list[int], want: torch.Tensor) -> None:
    """With the sliding layers' windows (of 8 keys) or the global layers' NoPE left out,
    ``model``'s logits of ``ids`` differ from ``want``."""
    saved, cfg = model.windows, model.config
    try:
        assert len(ids) > 4 * 8 and any(w is not None for w in saved)
        model.windows = [None] * len(saved)
        assert differs(model, ids, want)
        model.windows = saved
        model.config = dataclasses.replace(cfg, no_rope_layers=())  # every layer rotated
        assert differs(model, ids, want)
    finally:
        model.windows, model.config = saved, cfg


@pytest.mark.parametrize("hybrid", [True, False], ids=["32b-like", "1.2b-like"])
def test_exaone4_directory_matches_transformers(tmp_path: Path, hybrid: bool) -> None:
    hf, llm, prompts, got = served_directory(tmp_path / "exaone4", Exaone4Config,
                                             Exaone4ForCausalLM, **(HYBRID if hybrid
                                                                    else GLOBAL))
    cfg = llm.engine.core.runner.model.config
    assert cfg.architecture == "exaone4" and cfg.qk_norm
    if hybrid:
        assert cfg.layer_windows == (8, 8, 8, None) and cfg.no_rope_layers == (1, 1, 1, 0)
        assert cfg.rope_scaling["rope_type"] == "llama3"
    assert got == greedy(hf, prompts, 16)
    assert_logits_match(llm, prompts[-1], hf, hybrid)


@pytest.mark.parametrize("hybrid", [True, False], ids=["32b-like", "1.2b-like"])
def test_exaone4_gguf_matches_transformers(tmp_path: Path, hybrid: bool) -> None:
    path = write_gguf(tmp_path / "exaone4.gguf", "exaone4", hidden=64, layers=4, heads=4,
                      kv_heads=2, ff=96, tied=not hybrid, seed=9, weight_type=Q8_0,
                      rope_theta=10000.0, types={"attn_output.weight": Q4_0},
                      metadata={"attention.sliding_window": 8} if hybrid else None)
    hf = hf_olmo_from_gguf(path)
    llm, prompts, got = served(path, PROMPTS, 16)
    model = llm.engine.core.runner.model
    assert model.config.architecture == "exaone4" and model.uses_gguf_blocks
    assert model.config.layer_windows == ((8, 8, 8, None) if hybrid else ())
    assert got == greedy(hf, prompts, 16)
    assert_logits_match(llm, prompts[-1], hf, hybrid)


@pytest.mark.parametrize(("layers", "metadata", "window", "types", "theta"), [
    (4, {}, None, None, 10000.0),  # (the 1.2B: no key, every layer global and rotated)
    (4, {"attention.sliding_window": 8, "attention.sliding_window_pattern": 2,
         "rope.freq_base_swa": 5000.0}, 8, ["sliding_attention", "full_attention"] * 2,
     5000.0),
    (4, {"attention.sliding_window": 8,
         "attention.sliding_window_pattern": [True, False, True, True]}, 8,
     ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
     10000.0),
    # llama.cpp's 32B: 64 layers slide without the keys, over 4,096, every 4th global
    (64, {}, 4096, (["sliding_attention"] * 3 + ["full_attention"]) * 16, 10000.0),
])
def test_exaone4_files_sliding_layers_as_llama_cpp_reads_them(
        tmp_path: Path, layers: int, metadata: dict, window: int | None,
        types: list[str] | None, theta: float) -> None:
    path = write_gguf(tmp_path / "exaone4.gguf", "exaone4", hidden=32, heads=2, kv_heads=1,
                      ff=32, layers=layers, seed=1, metadata=metadata)
    config = json.loads((convert_gguf(path, tmp_path / "out", progress=False)
                         / "config.json").read_text())
    assert config["architectures"] == ["Exaone4ForCausalLM"]
    assert config["sliding_window"] == window and config.get("layer_types") == types
    assert config["rope_theta"] == theta
    cfg = ModelConfig.from_dict(config)
    want = tuple(window if t == "sliding_attention" else None for t in types or ())
    assert cfg.layer_windows == want
    assert cfg.no_rope_layers == tuple(int(w is not None) for w in want)


def test_exaone4_config_pattern_string_and_errors() -> None:
    base = {"architectures": ["Exaone4ForCausalLM"], "vocab_size": 64, "hidden_size": 64,
            "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4}
    cfg = ModelConfig.from_dict({**base, "sliding_window": 16, "sliding_window_pattern": "LG"})
    assert cfg.layer_windows == (16, None, 16, None) and cfg.no_rope_layers == (1, 0, 1, 0)
    # transformers' defaults: a window of 4,096, every 4th layer global
    assert ModelConfig.from_dict(base).layer_windows == (4096, 4096, 4096, None)
    for pattern in (0, "LXG", 2.5):
        with pytest.raises(ModelLoadError, match="sliding_window_pattern"):
            ModelConfig.from_dict({**base, "sliding_window_pattern": pattern})
    with pytest.raises(ModelLoadError, match="silu"):
        ModelConfig.from_dict({**base, "hidden_act": "gelu"})
