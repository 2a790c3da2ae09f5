"""Falcon-H1 GGUF files (``general.architecture`` ``falcon-h1``), exact against transformers:
greedy tokens and every position's logits, over the paged cache in chunks, the mixers' states
kept per sequence.

The files are written as llama.cpp's converter writes them (tests/gguf_falcon_h1_files.py:
the µP multipliers folded into the weights), their reference transformers' model holding the
file's weights with every multiplier 1 (its chunk size 8, which the file does not store:
FreeToken's scan runs in its default chunks of 256). Shapes (the multipliers away from 1):
- 0.5b-like: no gated norm, Q8_0 weights;
- h1r-like: the gated norm (``ssm_norm``: after the gate, as llama.cpp computes it), tied
  embeddings (no ``output.weight``: a warning), Q4_0 weights;
- f32: F32 weights, against the original model, multipliers and all: the converter's folding
  undone by nothing, the file is that model."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from gguf_falcon_h1_files import falcon_h1_keys, falcon_h1_model, write_falcon_h1_gguf
from gguf_granite4_files import add_keys
from gguf_writing import finish
from test_arch_falcon_h1 import MULTIPLIERS
from test_arch_gemma3 import assert_chunks_match, engine_path
from test_arch_qwen35_gguf import served_file_matches
from test_gguf_rope_factors import LONG

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.config_falcon_h1 import HybridMultipliers
from freetoken_core.models.gguf import convert_gguf
from freetoken_core.models.gguf_metadata import build_config
from freetoken_core.models.gguf_reader import open_header
from freetoken_core.models.kv_layout import kv_cache_dims
from freetoken_core.models.resolve import default_gguf_path

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 49152  # (the default model's vocabulary, which the files take)
PROMPTS = ["Hello world, this is", "def add(a, b):\n    return", LONG + " " + LONG,
           " ".join([LONG] * 7)]
MODEL: dict[str, Any] = {
    "num_hidden_layers": 3, "intermediate_size": 96, "mamba_d_ssm": 64, "mamba_n_heads": 8,
    "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_chunk_size": 8,
    "mamba_norm_before_gate": False, **MULTIPLIERS}
SHAPES: dict[str, dict[str, Any]] = {
    "0.5b-like": {"model": {"mamba_rms_norm": False}, "file": {}},
    "h1r-like": {"model": {"mamba_rms_norm": True, "tie_word_embeddings": True},
                 "file": {"weight_type": GGMLQuantizationType.Q4_0}},
    "f32": {"model": {"mamba_rms_norm": True}, "file": {"weight_type": 0}},
}


def written(tmp_path: Path, shape: str, seed: int = 3) -> tuple[Path, Any, Any]:
    """The file of ``shape``, transformers' model of it and the original model."""
    assert default_gguf_path().exists()
    path = tmp_path / f"{shape}.gguf"
    original = falcon_h1_model(VOCAB, seed=seed, **MODEL, **SHAPES[shape]["model"])
    return path, write_falcon_h1_gguf(path, original, **SHAPES[shape]["file"]), original


@pytest.mark.parametrize("shape,path", [("0.5b-like", "native"), ("0.5b-like", "torch"),
                                        ("h1r-like", "native"), ("f32", "native")])
def test_falcon_h1_gguf_matches_transformers(tmp_path: Path, shape: str, path: str,
                                             monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    native, _ = engine_path(path, monkeypatch)
    file, hf, original = written(tmp_path, shape)
    if shape == "f32":
        hf = original  # (the original model: its multipliers, its norm after the gate)
    with caplog.at_level(logging.WARNING):
        model, prompts = served_file_matches(file, hf, native, PROMPTS)
    tied = "no output.weight (a tied checkpoint's)" in caplog.text
    assert tied == (shape == "h1r-like")
    ids = prompts[2]
    assert len(prompts[-1]) > 256  # (past a chunk of the scan as FreeToken runs it)
    assert_chunks_match(model, hf, ids, [1, 1, 30, len(ids) - 32])
    cfg = model.config
    assert cfg.architecture == "falcon_h1" and cfg.layer_kinds == ("hybrid",) * 3
    assert kv_cache_dims(cfg) == (3, 2, 16)
    assert cfg.hybrid_multipliers == HybridMultipliers() and cfg.logit_scale == 1.0
    assert cfg.mamba_norm == ("none" if shape == "0.5b-like" else "after_gate")
    assert model.layers[0].mamba.in_proj.blocks is not None  # (the file's blocks)


def test_falcon_h1_gguf_config_is_transformers_config(tmp_path: Path) -> None:
    for shape in ("0.5b-like", "h1r-like"):
        path, hf, _ = written(tmp_path, shape)
        config = json.loads((convert_gguf(path, tmp_path / shape, progress=False)
                             / "config.json").read_text())
        assert config["architectures"] == ["FalconH1ForCausalLM"]
        from_file, from_hf = ModelConfig.from_dict(config), ModelConfig.from_dict(
            {**hf.config.to_dict(), "architectures": ["FalconH1ForCausalLM"]})
        for name in ("num_layers", "layer_kinds", "head_dim", "num_heads", "num_kv_heads",
                     "intermediate_size", "rope_theta", "rope_scaling", "tie_word_embeddings",
                     "mamba_norm", "mamba_time_step_limit", "hybrid_multipliers",
                     "embedding_multiplier", "logit_scale", "vocab_size",
                     "max_position_embeddings"):
            assert getattr(from_file, name) == getattr(from_hf, name), (shape, name)
        # (the chunk size is not in the file: transformers' default)
        assert from_file.mamba_shape == (*from_hf.mamba_shape[:5], 256)
        assert from_file.rms_norm_eps == pytest.approx(from_hf.rms_norm_eps)


def metadata(tmp_path: Path, change: dict[str, Any], drop: str = "") -> dict[str, Any]:
    """``build_config`` of a file with the 0.5b-like metadata (no tensors), its keys
    ``change``d (the architecture's prefix left out) and ``drop`` left out."""
    cfg = falcon_h1_model(64, **MODEL).config
    keys = {**falcon_h1_keys(cfg), **change}
    keys.pop(drop, None)
    path = tmp_path / "keys.gguf"
    writer = GGUFWriter(str(path), "falcon-h1")
    add_keys(writer, {f"falcon-h1.{k}": v for k, v in keys.items()})
    finish(writer)
    return build_config(open_header(path))


def test_falcon_h1_gguf_metadata(tmp_path: Path) -> None:
    config = metadata(tmp_path, {})
    assert config["architectures"] == ["FalconH1ForCausalLM"]
    assert (config["mamba_n_heads"], config["mamba_d_head"], config["mamba_d_ssm"],
            config["mamba_n_groups"], config["mamba_d_state"], config["mamba_d_conv"]) == (
        8, 8, 64, 2, 16, 4)
    assert (config["num_key_value_heads"], config["head_dim"]) == (2, 16)
    assert not config["mamba_rms_norm"]  # (no blk.0.ssm_norm.weight)
    assert config["mamba_norm_before_gate"] is False
    assert config["ssm_multipliers"] == [1.0] * 5 and config["key_multiplier"] == 1.0


@pytest.mark.parametrize("change,drop,match", [
    ({}, "ssm.group_count", "lacks 'falcon-h1.ssm.group_count'"),
    ({}, "ssm.time_step_rank", "lacks 'falcon-h1.ssm.time_step_rank'"),
    ({}, "ssm.inner_size", "lacks 'falcon-h1.ssm.inner_size'"),
    ({}, "ssm.state_size", "lacks 'falcon-h1.ssm.state_size'"),
    ({"ssm.inner_size": 100}, "", r"falcon-h1.ssm.inner_size 100 must split into the 8 "),
    ({"ssm.group_count": 3}, "", r"3 groups \(falcon-h1.ssm.group_count\)"),
    ({"ssm.conv_kernel": 0}, "", "falcon-h1.ssm.conv_kernel must be a positive integer"),
])
def test_falcon_h1_gguf_metadata_errors(tmp_path: Path, change: dict[str, Any], drop: str,
                                        match: str) -> None:
    with pytest.raises(ModelLoadError, match=match):
        ModelConfig.from_dict(metadata(tmp_path, change, drop))
