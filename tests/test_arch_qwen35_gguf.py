"""Qwen3.5 GGUF files (``general.architecture`` ``qwen35``), exact against transformers: greedy
tokens and every position's logits, over the paged cache in chunks, the Gated DeltaNet
layers' states kept per sequence.

The files are written as llama.cpp's converter writes them (tests/gguf_qwen35_files.py), their
reference transformers' model holding the file's weights. Three tiny random shapes:
- 9B-like: each key head serving two value heads (the converter stores the value heads
  tiled: FreeToken reads them back grouped, ``ssm_out``'s columns as whole Q8_0 blocks),
  the layer kinds as ``attention.recurrent_layers``, a multi-token-prediction block;
- small-heads: value heads of 8 (``ssm_out``'s Q8_0 blocks hold four heads: dequantized to
  be reordered), key heads of 16, tied embeddings, the layer kinds from
  ``full_attention_interval`` alone, five layers;
- equal-heads: as many value heads as key heads (nothing reordered), Q4_0 weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from gguf_qwen35_files import add_keys, qwen35_keys, qwen35_model, write_qwen35_gguf
from gguf_writing import finish
from test_arch_gemma3 import assert_chunks_match, engine_path
from test_gguf_rope_factors import LONG, greedy, served

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.gguf import convert_gguf
from freetoken_core.models.gguf_metadata import build_config
from freetoken_core.models.gguf_reader import open_header
from freetoken_core.models.gguf_weights import read_gguf_weights
from freetoken_core.models.kv_layout import kv_cache_dims
from freetoken_core.models.resolve import default_gguf_path

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 49152  # (the default model's vocabulary, which the files take)
PROMPTS = ["Hello world, this is", "def add(a, b):\n    return", LONG + " " + LONG]
LINEAR = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
          "linear_value_head_dim": 32}
SHAPES: dict[str, dict[str, Any]] = {
    "9b-like": {"model": LINEAR, "file": {"mtp": True}},
    "small-heads": {"model": {**LINEAR, "linear_key_head_dim": 16, "linear_value_head_dim": 8,
                              "num_hidden_layers": 5, "tie_word_embeddings": True},
                    "file": {"recurrent_layers": False}},
    "equal-heads": {"model": {**LINEAR, "linear_num_value_heads": 2,
                              "linear_key_head_dim": 16, "linear_value_head_dim": 16},
                    "file": {"weight_type": GGMLQuantizationType.Q4_0}},
}


def written(tmp_path: Path, shape: str, seed: int = 3) -> tuple[Path, Any]:
    assert default_gguf_path().exists()
    path = tmp_path / "qwen35.gguf"
    hf = write_qwen35_gguf(path, qwen35_model(VOCAB, seed=seed, **SHAPES[shape]["model"]),
                           **SHAPES[shape]["file"])
    return path, hf


def served_file_matches(file: Path, hf: Any, native: bool, texts: list[str] = PROMPTS
                        ) -> tuple[Any, list[list[int]]]:
    """``file`` served: its greedy tokens of ``texts`` equal ``hf``'s, are not one token
    over and over, on the path ``native`` says, from the file's blocks; the served model and
    the texts' ids."""
    llm, prompts, got = served(file, texts, 16)
    assert got == greedy(hf, prompts, 16)
    assert len(set(got[-1])) > 3  # (the generation is not one token over and over)
    model = llm.engine.core.runner.model
    assert model.native is native and model.uses_gguf_blocks
    return model, prompts


@pytest.mark.parametrize("shape,path", [("9b-like", "native"), ("9b-like", "torch"),
                                        ("small-heads", "native"), ("equal-heads", "native")])
def test_qwen35_gguf_matches_transformers(tmp_path: Path, shape: str, path: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    native, _ = engine_path(path, monkeypatch)
    file, hf = written(tmp_path, shape)
    model, prompts = served_file_matches(file, hf, native)
    ids = prompts[-1]
    assert len(ids) > 64  # (past a block of the chunked delta rule)
    assert_chunks_match(model, hf, ids, [1, 40, len(ids) - 41])
    cfg = model.config
    kinds = ("linear_attention",) * 3 + ("attention",)
    assert cfg.layer_kinds == (kinds + ("linear_attention",))[:cfg.num_layers]
    assert kv_cache_dims(cfg) == (1, 2, 16)
    # the value heads left in the converter's tiled order: every weight the file's blocks,
    # ssm_out's too (whatever a head's width in blocks), none reordered
    assert cfg.linear_value_heads_tiled
    weights = read_gguf_weights(file, open_header(file), "qwen35", cfg.num_layers,
                                cfg.num_heads, cfg.num_kv_heads, cfg.tie_word_embeddings)
    out_proj = weights["model.layers.0.linear_attn.out_proj.weight"]
    assert out_proj.type_name == ("Q4_0" if shape == "equal-heads" else "Q8_0")
    assert all(getattr(w, "order", None) is None for w in weights.values())
    assert not any(".layers.4." in name for name in weights) or shape == "small-heads"


def test_qwen35_gguf_config_is_transformers_config(tmp_path: Path) -> None:
    for shape in SHAPES:
        hf = qwen35_model(VOCAB, **SHAPES[shape]["model"])
        path = tmp_path / f"{shape}.gguf"
        write_qwen35_gguf(path, hf, **SHAPES[shape]["file"])
        config = json.loads((convert_gguf(path, tmp_path / shape, progress=False)
                             / "config.json").read_text())
        assert config["architectures"] == ["Qwen3_5ForCausalLM"]
        from_file, from_hf = ModelConfig.from_dict(config), ModelConfig.from_dict(
            {**hf.config.to_dict(), "architectures": ["Qwen3_5ForCausalLM"]})
        for name in ("num_layers", "layer_kinds", "linear_attention_shape",
                     "partial_rotary_factor", "head_dim", "num_heads", "num_kv_heads",
                     "rope_theta", "rope_scaling", "tie_word_embeddings",
                     "attention_output_gate", "qk_norm", "intermediate_size"):
            assert getattr(from_file, name) == getattr(from_hf, name), (shape, name)
        assert from_file.rms_norm_eps == pytest.approx(from_hf.rms_norm_eps)  # (float32)


def metadata(tmp_path: Path, change: dict[str, Any], drop: str = "") -> dict[str, Any]:
    """``build_config`` of a file with the 9B-like shape's metadata (no tensors), its keys
    ``change``d (``qwen35.`` left out) and ``drop`` left out."""
    keys = qwen35_keys(qwen35_model(64, **LINEAR).config, mtp=True)
    keys.update({"qwen35." + k: v for k, v in change.items()})
    keys.pop("qwen35." + drop, None)
    path = tmp_path / "keys.gguf"
    writer = GGUFWriter(str(path), "qwen35")
    add_keys(writer, keys)
    finish(writer)
    return build_config(open_header(path))


def test_qwen35_gguf_metadata(tmp_path: Path) -> None:
    config = metadata(tmp_path, {})
    assert config["num_hidden_layers"] == 4  # (the block_count of 5 less the MTP block)
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert config["partial_rotary_factor"] == 0.5
    assert (config["linear_num_key_heads"], config["linear_num_value_heads"],
            config["linear_key_head_dim"], config["linear_value_head_dim"]) == (2, 4, 32, 32)
    # without recurrent_layers: every full_attention_interval-th layer attention
    config = metadata(tmp_path, {"full_attention_interval": 2}, drop="attention.recurrent_layers")
    assert config["layer_types"] == ["linear_attention", "full_attention"] * 2
    config = metadata(tmp_path, {"attention.recurrent_layers": [True, False] * 2 + [False]})
    assert config["layer_types"] == ["linear_attention", "full_attention"] * 2


@pytest.mark.parametrize("change,drop,match", [
    ({}, "ssm.group_count", "lacks 'qwen35.ssm.group_count'"),
    ({}, "ssm.inner_size", "lacks 'qwen35.ssm.inner_size'"),
    ({"ssm.inner_size": 102}, "", "qwen35.ssm.inner_size 102 does not split into 4"),
    ({"ssm.conv_kernel": 0}, "", "qwen35.ssm.conv_kernel must be a positive integer"),
    ({"attention.recurrent_layers": [True] * 3}, "", "recurrent_layers has 3 values for 5"),
    ({"nextn_predict_layers": 5}, "", "nextn_predict_layers 5 leaves no layers"),
    ({"rope.dimension_sections": [0, 1, 1, 2]}, "", "dimension_sections .* leave 2 of the 4"),
    ({"rope.dimension_count": 7}, "", "rope.dimension_count 7 must be an even number"),
    ({"rope.scaling.type": "yarn"}, "", "qwen35.rope.scaling.type 'yarn'"),
    ({"attention.value_length": 32}, "", "qwen35.attention.value_length 32 != "),
])
def test_qwen35_gguf_metadata_errors(tmp_path: Path, change: dict[str, Any], drop: str,
                                     match: str) -> None:
    with pytest.raises(ModelLoadError, match=match):
        config = metadata(tmp_path, change, drop)
        ModelConfig.from_dict(config)
