"""Granite 4 GGUF files (``general.architecture`` ``granitehybrid``, and the dense
granite-4.0-micro's ``granite``), exact against transformers: greedy tokens and every
position's logits, over the paged cache in chunks, the Mamba-2 layers' states kept per
sequence.

The files are written as llama.cpp's converter writes them (tests/gguf_granite4_files.py),
their reference transformers' model holding the file's weights (its chunk size 8, which the
file does not store: FreeToken's scan runs in its default chunks of 256). Shapes:
- h-tiny-like: Mamba-2 layers (8 heads in 2 groups) beside an attention layer, experts beside
  the shared MLP (``ffn_*_shexp``), RoPE (``rope.scaling.finetuned`` true: the converter
  writes false for every hybrid, as the released ones are NoPE), Granite's multipliers;
- h-micro-like: the shared MLP alone (``ffn_gate`` / ``ffn_up`` / ``ffn_down``), NoPE, as the
  converter writes it, Q4_0 weights;
- micro-like: attention layers only, written as a ``granite`` file (its
  ``attention.head_count_kv`` one a layer), served as Granite 3."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from gguf_granite4_files import add_keys, granite4_keys, granite4_model, write_granite4_gguf
from gguf_writing import finish
from test_arch_gemma3 import assert_chunks_match, engine_path
from test_arch_qwen35_gguf import served_file_matches
from test_gguf_rope_factors import LONG

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.gguf import convert_gguf
from freetoken_core.models.gguf_metadata import build_config
from freetoken_core.models.gguf_reader import open_header
from freetoken_core.models.kv_layout import kv_cache_dims
from freetoken_core.models.resolve import default_gguf_path

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 49152  # (the default model's vocabulary, which the files take)
PROMPTS = ["Hello world, this is", "def add(a, b):\n    return", LONG + " " + LONG,
           " ".join([LONG] * 7)]
HYBRID = {"num_hidden_layers": 4, "layer_types": ["mamba", "attention", "mamba", "mamba"],
          "mamba_n_heads": 8, "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_chunk_size": 8,
          "intermediate_size": 32, "shared_intermediate_size": 48,
          "embedding_multiplier": 1.5, "residual_multiplier": 0.7,
          "attention_multiplier": 0.2, "logits_scaling": 2.0}
SHAPES: dict[str, dict[str, Any]] = {
    "h-tiny-like": {"model": {**HYBRID, "num_local_experts": 4, "num_experts_per_tok": 2,
                              "position_embedding_type": "rope"},
                    "file": {"rope_finetuned": True}},
    # (llama.cpp's dense MLP is of feed_forward_length: the shared MLP's size)
    "h-micro-like": {"model": {**HYBRID, "num_local_experts": 0, "num_experts_per_tok": 0,
                               "intermediate_size": 48, "position_embedding_type": None},
                     "file": {"weight_type": GGMLQuantizationType.Q4_0}},
    "micro-like": {"model": {**HYBRID, "layer_types": ["attention"] * 3,
                             "num_hidden_layers": 3, "num_local_experts": 0,
                             "num_experts_per_tok": 0, "intermediate_size": 48,
                             "position_embedding_type": "rope"}, "file": {}},
}


def written(tmp_path: Path, shape: str, seed: int = 3) -> tuple[Path, Any]:
    assert default_gguf_path().exists()
    path = tmp_path / f"{shape}.gguf"
    hf = write_granite4_gguf(path, granite4_model(VOCAB, seed=seed, **SHAPES[shape]["model"]),
                             **SHAPES[shape]["file"])
    return path, hf


@pytest.mark.parametrize("shape,path", [("h-tiny-like", "native"), ("h-tiny-like", "torch"),
                                        ("h-micro-like", "native"), ("micro-like", "native")])
def test_granite4_gguf_matches_transformers(tmp_path: Path, shape: str, path: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    native, _ = engine_path(path, monkeypatch)
    file, hf = written(tmp_path, shape)
    model, prompts = served_file_matches(file, hf, native, PROMPTS)
    ids = prompts[2]
    assert len(prompts[-1]) > 256  # (past a chunk of the scan as FreeToken runs it)
    assert_chunks_match(model, hf, ids, [1, 1, 30, len(ids) - 32])
    cfg = model.config
    if shape == "micro-like":
        assert cfg.architecture == "granite" and cfg.num_kv_heads == 2
        return
    assert cfg.architecture == "granitemoehybrid"
    assert cfg.layer_kinds == ("mamba", "attention", "mamba", "mamba")
    assert kv_cache_dims(cfg) == (1, 2, 16)  # (the attention layer alone)
    assert (model.layers[0].moe is not None) == (shape == "h-tiny-like")
    assert model.rotates == (shape == "h-tiny-like")
    assert model.layers[0].mixer.in_proj.blocks is not None  # (the file's blocks)


def test_granite4_gguf_config_is_transformers_config(tmp_path: Path) -> None:
    for shape in ("h-tiny-like", "h-micro-like"):
        hf = granite4_model(VOCAB, **SHAPES[shape]["model"])
        path = tmp_path / f"{shape}.gguf"
        write_granite4_gguf(path, hf, **SHAPES[shape]["file"])
        config = json.loads((convert_gguf(path, tmp_path / shape, progress=False)
                             / "config.json").read_text())
        assert config["architectures"] == ["GraniteMoeHybridForCausalLM"]
        from_file, from_hf = ModelConfig.from_dict(config), ModelConfig.from_dict(
            {**hf.config.to_dict(), "architectures": ["GraniteMoeHybridForCausalLM"]})
        for name in ("num_layers", "layer_kinds", "no_rope_layers", "head_dim", "num_heads",
                     "num_kv_heads", "rope_theta", "rope_scaling", "tie_word_embeddings",
                     "num_experts", "num_experts_per_tok", "expert_gating",
                     "mamba_time_step_limit", "vocab_size"):
            assert getattr(from_file, name) == getattr(from_hf, name), (shape, name)
        # (the chunk size is not in the file: transformers' default)
        assert from_file.mamba_shape == (*from_hf.mamba_shape[:5], 256)
        for name in ("rms_norm_eps", "embedding_multiplier", "residual_multiplier",
                     "query_scale", "logits_scaling"):  # (float32 in the file)
            assert getattr(from_file, name) == pytest.approx(getattr(from_hf, name)), name


def metadata(tmp_path: Path, change: dict[str, Any], drop: str = "",
             shape: str = "h-tiny-like") -> dict[str, Any]:
    """``build_config`` of a file with ``shape``'s metadata (no tensors), its keys ``change``d
    (the architecture's prefix left out) and ``drop`` left out."""
    cfg = granite4_model(64, **SHAPES[shape]["model"]).config
    arch = "granite" if shape == "micro-like" else "granitehybrid"
    keys = {**granite4_keys(cfg), **change}
    keys.pop(drop, None)
    path = tmp_path / "keys.gguf"
    writer = GGUFWriter(str(path), arch)
    add_keys(writer, {f"{arch}.{k}": v for k, v in keys.items()})
    finish(writer)
    return build_config(open_header(path))


def test_granite4_gguf_metadata(tmp_path: Path) -> None:
    config = metadata(tmp_path, {})
    assert config["layer_types"] == ["mamba", "attention", "mamba", "mamba"]
    assert config["num_key_value_heads"] == 2 and config["num_local_experts"] == 4
    assert config["position_embedding_type"] == "nope"  # (as the converter writes hybrids)
    assert (config["mamba_n_heads"], config["mamba_d_head"], config["mamba_n_groups"],
            config["mamba_d_state"], config["mamba_d_conv"]) == (8, 16, 2, 16, 4)
    config = metadata(tmp_path, {"logit_scale": 0.0, "attention.scale": 0.0},
                      drop="rope.scaling.finetuned")
    assert config["logits_scaling"] == 1.0 and config["attention_multiplier"] == 0.25
    assert config["position_embedding_type"] == "rope"  # (llama.cpp's default: rotating)
    config = metadata(tmp_path, {}, shape="micro-like")
    assert config["architectures"] == ["GraniteForCausalLM"]
    assert config["num_key_value_heads"] == 2


@pytest.mark.parametrize("change,drop,match", [
    ({}, "ssm.group_count", "lacks 'granitehybrid.ssm.group_count'"),
    ({}, "ssm.time_step_rank", "lacks 'granitehybrid.ssm.time_step_rank'"),
    ({"ssm.inner_size": 100}, "", "ssm.inner_size 100 must split into the 8 Mamba heads"),
    ({"ssm.inner_size": 96, "ssm.time_step_rank": 6}, "", "96 must be a multiple of the hidden"),
    ({"ssm.conv_kernel": 0}, "", "ssm.conv_kernel must be a positive integer"),
    ({"attention.head_count_kv": [0, 2, 0]}, "", "has 3 values for 4 blocks"),
    ({"attention.head_count_kv": [0, 2, 4, 0]}, "", "all have the same KV heads"),
    ({"expert_used_count": 5}, "", "expert_count 4 / expert_used_count 5"),
    ({"expert_weights_scale": 2.5}, "", "expert_weights_scale 2.5"),
    ({"ssm.group_count": 3}, "", r"3 groups \(granitehybrid.ssm.group_count\)"),
])
def test_granite4_gguf_metadata_errors(tmp_path: Path, change: dict[str, Any], drop: str,
                                       match: str) -> None:
    with pytest.raises(ModelLoadError, match=match):
        ModelConfig.from_dict(metadata(tmp_path, change, drop))


def test_granite_micro_gguf_kv_heads_must_agree(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="granite.attention.head_count_kv .* same KV"):
        metadata(tmp_path, {"attention.head_count_kv": [2, 0, 2]}, shape="micro-like")
