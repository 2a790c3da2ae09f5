"""StarCoder2 (``Starcoder2ForCausalLM`` directories, ``starcoder2`` GGUF files), exact
against transformers: greedy tokens and every position's logits.

Its differences from Llama, each of which moves the logits when left out: LayerNorms with
biases (before the attention, before the MLP, at the end), biases on every linear but the
head, an MLP that is not gated (``c_proj(gelu_tanh(c_fc(x)))``), and a sliding window over
every layer where the config has one (a window of 8 here, so the long prompt's queries see
a part of it). The GGUF file is written as llama.cpp's converter writes it (no window key:
llama.cpp attends to every key), its reference built from gguf-py's dequantization
(transformers' GGUF loader does not read starcoder2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf_models import Q4_0, Q8_0, write_gguf
from gguf_reference_families import hf_starcoder2_from_gguf
from test_arch_exaone4 import differs
from test_arch_moe import matching_logits, served_directory
from test_arch_phi3 import save_tiny_model
from test_gguf_rope_factors import LONG, greedy, served
from test_tensor_parallel import _check_tp_equals_one_rank
from transformers import Starcoder2Config, Starcoder2ForCausalLM

from freetoken_core.models.config import ModelConfig

PROMPTS = ["Hello world, this is", "def add(a, b):\n    return", LONG]


def assert_logits_match(llm, ids: list[int], ref: torch.nn.Module, window: bool) -> None:
    """Every position's logits equal ``ref``'s (the prompt in two chunks); without the
    norms' biases, the MLP's, or (``window``) the windows they differ."""
    model, want = matching_logits(llm, ids, ref)
    layers = model.layers
    saved = [(layer.input_bias, layer.down_proj.bias) for layer in layers]
    try:
        for layer in layers:
            layer.input_bias = torch.zeros_like(layer.input_bias)
        assert differs(model, ids, want)
        for layer, (bias, _) in zip(layers, saved):
            layer.input_bias, layer.down_proj.bias = bias, None
        assert differs(model, ids, want)
    finally:
        for layer, (norm, down) in zip(layers, saved):
            layer.input_bias, layer.down_proj.bias = norm, down
    if window:
        windows = model.windows
        try:
            assert len(ids) > 2 * 8 and all(w == 8 for w in windows)
            model.windows = [None] * len(windows)
            assert differs(model, ids, want)
        finally:
            model.windows = windows


@pytest.mark.parametrize("window", [8, None], ids=["window", "no-window"])
def test_starcoder2_directory_matches_transformers(tmp_path: Path, window: int | None) -> None:
    hf, llm, prompts, got = served_directory(
        tmp_path / "starcoder2", Starcoder2Config, Starcoder2ForCausalLM, num_hidden_layers=3,
        sliding_window=window, norm_epsilon=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = llm.engine.core.runner.model
    assert model.config.architecture == "starcoder2" and not model.config.gated_mlp
    assert model.config.layer_windows == ((window,) * 3 if window else ())
    assert got == greedy(hf, prompts, 16)
    assert_logits_match(llm, prompts[-1], hf, window is not None)


@pytest.mark.parametrize("tied", [True, False])
def test_starcoder2_gguf_matches_transformers(tmp_path: Path, tied: bool) -> None:
    path = write_gguf(tmp_path / "starcoder2.gguf", "starcoder2", hidden=64, layers=3,
                      heads=4, kv_heads=2, ff=96, tied=tied, seed=11, weight_type=Q8_0,
                      rope_theta=10000.0, biases=True, types={"attn_output.weight": Q4_0})
    hf = hf_starcoder2_from_gguf(path)
    llm, prompts, got = served(path, PROMPTS, 16)
    model = llm.engine.core.runner.model
    assert model.config.architecture == "starcoder2" and model.uses_gguf_blocks
    assert not model.config.layer_windows  # (llama.cpp's: no window)
    assert got == greedy(hf, prompts, 16)
    assert_logits_match(llm, prompts[-1], hf, window=False)


def test_starcoder2_tensor_parallel_equals_one_rank(tmp_path: Path) -> None:
    """The LayerNorms (and their biases) on every rank, the o and MLP biases added once."""
    model_dir = save_tiny_model(tmp_path / "starcoder2", Starcoder2Config,
                                Starcoder2ForCausalLM, sliding_window=8, norm_epsilon=1e-5)
    _check_tp_equals_one_rank(str(model_dir), dtype="float32")


def test_starcoder2_config_defaults() -> None:
    cfg = ModelConfig.from_dict({"architectures": ["Starcoder2ForCausalLM"], "hidden_size": 64,
                                 "num_attention_heads": 4, "intermediate_size": 128,
                                 "norm_epsilon": 1e-4})
    # transformers' Starcoder2Config: biases, tied, 2 KV heads, GELU-tanh, no window
    assert (cfg.attention_bias, cfg.tie_word_embeddings, cfg.num_kv_heads) == (True, True, 2)
    assert (cfg.hidden_act, cfg.rms_norm_eps, cfg.layer_windows) == (
        "gelu_pytorch_tanh", 1e-4, ())
