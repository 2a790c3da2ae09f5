"""Nemotron-H GGUF files (``general.architecture`` ``nemotron_h``: Nemotron-H, Nemotron Nano
2; ``nemotron_h_moe``: Nemotron 3 Nano), exact against transformers: greedy tokens and every
position's logits, over the paged cache in chunks, the Mamba-2 blocks' states kept per
sequence.

The files are written as llama.cpp's converter writes them (tests/gguf_nemotron_h_files.py),
their reference transformers' model holding the file's weights (its chunk size 8, which the
file does not store: FreeToken's scan runs in its default chunks). Shapes (attention heads
of 32, not hidden / heads: the converter's ``rope.dimension_count`` is then wrong, as
Nemotron Nano 2's files have it):
- nano2-like: Mamba-2, ReLU² MLP and attention blocks (``M-M*-M``), Q8_0 weights, and Q4_0
  (nano2-q4; the MLP's rows of 96 whole Q4_0 blocks);
- nano3-like: Mamba-2, expert and attention blocks (``ME*EM``: 8 ungated ReLU² experts, 2
  chosen by sigmoid scores plus a selection bias among the best 2 of 4 groups, scaled by 2,
  beside a shared expert of 48, whose down projection the converter writes F16), with the
  multi-token-prediction block the converter appends, the norms' epsilon 1e-3 (the file's
  ``attention.layer_norm_epsilon``), Q8_0 weights; F32 (nano3-f32)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf_granite4_files import add_keys
from gguf_nemotron_h_files import nemotron_h_keys, nemotron_h_model, write_nemotron_h_gguf
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
DENSE: dict[str, Any] = {
    "layers_block_type": ["linear_attention", "mlp", "linear_attention", "full_attention",
                          "mlp", "linear_attention"], "intermediate_size": 96}
MOE: dict[str, Any] = {
    "layers_block_type": ["linear_attention", "moe", "full_attention", "moe",
                          "linear_attention"],
    "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 48, "n_group": 4, "topk_group": 2,
    "routed_scaling_factor": 2.0, "layer_norm_epsilon": 1e-3}
SHAPES: dict[str, dict[str, Any]] = {
    "nano2-like": {"model": DENSE, "file": {}},
    "nano2-q4": {"model": DENSE, "file": {"weight_type": GGMLQuantizationType.Q4_0}},
    "nano3-like": {"model": MOE, "file": {"mtp": True}},
    "nano3-f32": {"model": MOE, "file": {"mtp": True, "weight_type": 0}},
}
KINDS = {"nano2": ("mamba", "mlp", "mamba", "attention", "mlp", "mamba"),
         "nano3": ("mamba", "moe", "attention", "moe", "mamba")}


def written(tmp_path: Path, shape: str, seed: int = 3) -> tuple[Path, Any]:
    assert default_gguf_path().exists()
    path = tmp_path / f"{shape}.gguf"
    hf = write_nemotron_h_gguf(path, nemotron_h_model(VOCAB, seed=seed,
                                                      **SHAPES[shape]["model"]),
                               **SHAPES[shape]["file"])
    return path, hf


@pytest.mark.parametrize("shape,path", [("nano2-like", "native"), ("nano2-like", "torch"),
                                        ("nano2-q4", "native"), ("nano3-like", "native"),
                                        ("nano3-like", "torch"), ("nano3-f32", "native")])
def test_nemotron_h_gguf_matches_transformers(tmp_path: Path, shape: str, path: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    native, _ = engine_path(path, monkeypatch)
    file, hf = written(tmp_path, shape)
    model, prompts = served_file_matches(file, hf, native, PROMPTS)
    ids = prompts[2]
    assert len(prompts[-1]) > 256  # (past a chunk of the scan as FreeToken runs it)
    assert_chunks_match(model, hf, ids, [1, 1, 30, len(ids) - 32])
    cfg = model.config
    kinds = KINDS[shape[:5]]
    assert cfg.architecture == "nemotron_h" and cfg.layer_kinds == kinds
    assert kv_cache_dims(cfg) == (1, 2, 32)  # (the attention block alone)
    assert model.layers[0].mamba.in_proj.blocks is not None  # (the file's blocks)
    if shape == "nano3-f32":  # q/k rows back in transformers' order (attention without
        attention = kinds.index("attention")  # positions computes the same scores without)
        mixer = hf.model.layers[attention].mixer
        want = torch.cat([mixer.q_proj.weight, mixer.k_proj.weight, mixer.v_proj.weight])
        got = model.layers[attention].qkv_proj(torch.eye(64))
        torch.testing.assert_close(got, want.t(), atol=1e-5, rtol=1e-5)


def test_nemotron_h_gguf_config_is_transformers_config(tmp_path: Path) -> None:
    for shape in ("nano2-like", "nano3-like"):
        hf = nemotron_h_model(VOCAB, **SHAPES[shape]["model"])
        path = tmp_path / f"{shape}.gguf"
        write_nemotron_h_gguf(path, hf, **SHAPES[shape]["file"])
        config = json.loads((convert_gguf(path, tmp_path / shape, progress=False)
                             / "config.json").read_text())
        assert config["architectures"] == ["NemotronHForCausalLM"]
        from_file, from_hf = ModelConfig.from_dict(config), ModelConfig.from_dict(
            {**hf.config.to_dict(), "architectures": ["NemotronHForCausalLM"]})
        names = ["num_layers", "layer_kinds", "head_dim", "num_heads", "num_kv_heads",
                 "tie_word_embeddings", "mamba_time_step_limit", "vocab_size", "gated_mlp",
                 "hidden_act", "no_rope_layers", "query_scale"]
        if shape == "nano2-like":
            names.append("intermediate_size")
        else:
            names += ["num_experts", "num_experts_per_tok", "moe_intermediate_size",
                      "shared_expert_intermediate_size", "expert_gating",
                      "expert_selection_bias", "expert_groups", "norm_topk_prob",
                      "routed_scaling_factor", "moe_layers"]
        for name in names:
            assert getattr(from_file, name) == getattr(from_hf, name), (shape, name)
        # (the chunk size is not in the file: Nemotron-H's default)
        assert from_file.mamba_shape == (*from_hf.mamba_shape[:5], 128)
        assert from_file.rms_norm_eps == pytest.approx(from_hf.rms_norm_eps)


def metadata(tmp_path: Path, change: dict[str, Any], drop: str = "", moe: bool = False,
             mtp: bool = False) -> dict[str, Any]:
    """``build_config`` of a file with nano2-like's (``moe``: nano3-like's; ``mtp``: with the
    prediction block's) metadata, its keys ``change``d (the architecture's prefix left out)
    and ``drop`` left out; no tensors but, with ``mtp``, the first block's norm (the file is
    not the prediction block alone)."""
    cfg = nemotron_h_model(64, **(MOE if moe else DENSE)).config
    arch = "nemotron_h_moe" if moe else "nemotron_h"
    keys = {**nemotron_h_keys(cfg, mtp), **change}
    keys.pop(drop, None)
    path = tmp_path / "keys.gguf"
    writer = GGUFWriter(str(path), arch)
    add_keys(writer, {f"{arch}.{k}": v for k, v in keys.items()})
    if mtp:
        writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    finish(writer)
    return build_config(open_header(path))


def test_nemotron_h_gguf_metadata(tmp_path: Path) -> None:
    config = metadata(tmp_path, {})
    assert config["architectures"] == ["NemotronHForCausalLM"]
    assert config["layers_block_type"] == DENSE["layers_block_type"]
    assert (config["num_key_value_heads"], config["head_dim"], config["intermediate_size"]
            ) == (2, 32, 96)  # (head_dim from key_length; rope.dimension_count 16 moot)
    assert (config["mamba_num_heads"], config["mamba_head_dim"], config["n_groups"],
            config["ssm_state_size"], config["conv_kernel"]) == (8, 8, 2, 16, 4)
    assert config["rms_norm_eps"] == pytest.approx(1e-5)
    config = metadata(tmp_path, {"attention.layer_norm_rms_epsilon": 1e-6,
                                 "attention.layer_norm_epsilon": 1e-3})
    assert config["rms_norm_eps"] == pytest.approx(1e-6)  # (llama.cpp's: the RMS key wins)
    config = metadata(tmp_path, {}, moe=True, mtp=True)
    assert config["num_hidden_layers"] == 5 and "nemotron_h_moe" not in config["model_type"]
    assert config["layers_block_type"] == MOE["layers_block_type"]  # (without the MTP's)
    assert (config["n_routed_experts"], config["num_experts_per_tok"], config["n_group"],
            config["topk_group"], config["moe_intermediate_size"],
            config["moe_shared_expert_intermediate_size"], config["routed_scaling_factor"],
            config["norm_topk_prob"]) == (8, 2, 4, 2, 32, 48, 2.0, True)
    # llama.cpp's defaults: no normalization, no scale, the blocks' length over those used
    config = metadata(tmp_path, {"expert_weights_scale": 0.0}, drop="expert_weights_norm",
                      moe=True)
    assert not config["norm_topk_prob"] and config["routed_scaling_factor"] == 1.0
    config = metadata(tmp_path, {}, drop="expert_feed_forward_length", moe=True)
    assert config["moe_intermediate_size"] == 16


@pytest.mark.parametrize("change,drop,moe,match", [
    ({}, "attention.layer_norm_epsilon", False,
     "lacks 'nemotron_h.attention.layer_norm_epsilon'"),
    ({}, "ssm.group_count", False, "lacks 'nemotron_h.ssm.group_count'"),
    ({"ssm.inner_size": 100}, "", False, "ssm.inner_size 100 must split into the 8 Mamba"),
    ({}, "feed_forward_length", False, "lacks 'nemotron_h.feed_forward_length'"),
    ({"attention.head_count_kv": [0, 0, 0, 2, 0]}, "", False,
     "head_count_kv has 5 values for 6 blocks"),
    ({"attention.head_count_kv": [0, 0, 0, 2, 0, 0], "feed_forward_length":
      [0, 96, 0, 0, 64, 0]}, "", False, r"feed_forward_length \[0, 96, 0, 0, 64, 0\]"),
    ({"attention.head_count_kv": [0, 0, 4, 2, 0, 0], "feed_forward_length":
      [0, 96, 0, 0, 96, 0]}, "", False, "head_count_kv .* same KV heads"),
    ({"attention.scale": 0.5}, "", False, "nemotron_h.attention.scale 0.5"),
    ({"nextn_predict_layers": 6}, "", False, "nextn_predict_layers 6 must be"),
    ({"nextn_predict_layers": 1}, "", False, "multi-token-prediction block alone"),
    ({"moe_latent_size": 32}, "", True, "nemotron_h_moe.moe_latent_size"),
    ({"expert_used_count": 9}, "", True, "expert_count 8 / expert_used_count 9"),
    ({"expert_used_count": [2] * 5}, "", True, "expert_used_count is a number a block"),
    ({"expert_feed_forward_length": [0, 32, 0, 16, 0]}, "", True, "experts of one size"),
    ({}, "expert_group_used_count", True, "expert_group_count 4 / expert_group_used_count 0"),
    ({"expert_group_count": 3}, "", True, "the 8 experts must split into equal groups"),
    ({}, "expert_shared_feed_forward_length", True,
     "lacks 'nemotron_h_moe.expert_shared_feed_forward_length'"),
])
def test_nemotron_h_gguf_metadata_errors(tmp_path: Path, change: dict[str, Any], drop: str,
                                         moe: bool, match: str) -> None:
    with pytest.raises(ModelLoadError, match=match):
        ModelConfig.from_dict(metadata(tmp_path, change, drop, moe))
