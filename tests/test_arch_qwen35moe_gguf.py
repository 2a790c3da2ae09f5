"""Qwen3.5-MoE and Qwen3-Next GGUF files (``general.architecture`` ``qwen35moe`` and
``qwen3next``), exact against transformers: greedy tokens and every position's logits, over
the paged cache in chunks, the Gated DeltaNet layers' states kept per sequence.

The files are written as llama.cpp's converter writes them (tests/gguf_qwen35moe_files.py),
their reference transformers' model holding the file's weights. Four tiny random shapes:
- qwen35moe 35B-like: each key head serving two value heads (stored tiled, kept so), the
  experts' gate and up split (``ffn_gate_exps`` / ``ffn_up_exps``), the layer kinds as
  ``attention.recurrent_layers``, a multi-token-prediction block, no
  ``feed_forward_length`` (Qwen3.5-MoE's config has no dense size);
- qwen35moe fused: ``ffn_gate_up_exps``, value heads of 8, tied embeddings, the layer kinds
  from ``full_attention_interval``, five layers, Q4_0;
- qwen3next 80B-like: the converter's ``in_proj_qkvz`` split into ``attn_qkv`` /
  ``attn_gate``, ``ssm_ba`` fused per key head (value heads grouped, not tiled), an MTP
  block;
- qwen3next legacy: ``in_proj_qkvz`` unsplit as ``ssm_in`` (older files), Q4_0, tied."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf_qwen35_files import add_keys
from gguf_qwen35moe_files import moe_keys, moe_model, write_moe_gguf
from gguf_writing import finish
from test_arch_gemma3 import chunked_logits, engine_path
from test_arch_qwen35_gguf import served_file_matches
from test_gguf_rope_factors import LONG

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.gguf import convert_gguf
from freetoken_core.models.gguf_metadata import build_config
from freetoken_core.models.gguf_reader import open_header
from freetoken_core.models.gguf_weights import read_gguf_weights
from freetoken_core.models.resolve import default_gguf_path

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 49152  # (the default model's vocabulary, which the files take)
PROMPTS = ["Hello world, this is", "def add(a, b):\n    return", LONG + " " + LONG]
LINEAR = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
          "linear_value_head_dim": 32}
SMALL = {**LINEAR, "linear_key_head_dim": 16, "linear_value_head_dim": 8,
         "num_hidden_layers": 5, "tie_word_embeddings": True}
Q4_0 = GGMLQuantizationType.Q4_0
SHAPES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "35b-like": ("qwen35moe", LINEAR, {"mtp": True}),
    "fused": ("qwen35moe", SMALL, {"recurrent_layers": False, "fused_experts": True,
                                   "weight_type": Q4_0}),
    "80b-like": ("qwen3next", LINEAR, {"mtp": True}),
    "legacy": ("qwen3next", SMALL, {"recurrent_layers": False, "legacy": True,
                                    "weight_type": Q4_0}),
}


def written(tmp_path: Path, shape: str, seed: int = 3) -> tuple[Path, Any]:
    assert default_gguf_path().exists()
    arch, model, file = SHAPES[shape]
    path = tmp_path / f"{arch}.gguf"
    return path, write_moe_gguf(path, arch, moe_model(arch, VOCAB, seed=seed, **model), **file)


def float64_logits(hf: Any, ids: list[int]) -> tuple[torch.Tensor, float]:
    """Every position's logits of transformers' model ``hf`` in float64 (its experts by the
    eager loop: its grouped matmul takes no float64): the reference; and the tolerance
    against it: the greatest distance of transformers' own float32 logits from them, or 5e-3
    where that is less. These random MoE models are ill-conditioned in float32 at a few
    positions: transformers' float32 logits stray from float64 by up to 1.9e-3 (35B-like)
    and 2.5e-2 (fused), FreeToken's by up to 1.5e-3 and 3.6e-3 with AVX-512 (its chunks of 1,
    40 and the rest; 4e-4 and 1.1e-3 in one chunk) and 1.4e-2 (fused, one chunk) with AVX2's
    8 lanes (Zen 3): as exact as transformers' float32, where a wrong weight moves logits by
    O(1)."""
    model = copy.deepcopy(hf).double()
    model.set_experts_implementation("eager")
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0]
        float32 = hf(torch.tensor([ids])).logits[0].double()
    return want, max(5e-3, (float32 - want).abs().max().item())


@pytest.mark.parametrize("shape,path", [("35b-like", "native"), ("35b-like", "torch"),
                                        ("fused", "native"), ("80b-like", "native"),
                                        ("80b-like", "torch"), ("legacy", "native")])
def test_qwen35moe_gguf_matches_transformers(tmp_path: Path, shape: str, path: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    native, _ = engine_path(path, monkeypatch)
    file, hf = written(tmp_path, shape)
    model, prompts = served_file_matches(file, hf, native, PROMPTS)
    ids = prompts[-1]
    assert len(ids) > 64  # (past a block of the chunked delta rule)
    want, atol = float64_logits(hf, ids)
    for chunks in ([len(ids)], [1, 40, len(ids) - 41]):
        torch.testing.assert_close(chunked_logits(model, ids, chunks).double(), want,
                                   atol=atol, rtol=1e-4)
    cfg = model.config
    arch = SHAPES[shape][0]
    assert cfg.architecture == ("qwen3_5_moe" if arch == "qwen35moe" else "qwen3_next")
    assert cfg.linear_value_heads_tiled is (arch == "qwen35moe")
    assert all(layer.moe is not None and layer.moe.shared is not None
               for layer in model.layers)
    # every expert computes from the file's blocks (a slice of its 3-d tensor), none
    # dequantized or reordered
    weights = read_gguf_weights(file, open_header(file), arch, cfg.num_layers, cfg.num_heads,
                                cfg.num_kv_heads, cfg.tie_word_embeddings)
    experts = [name for name in weights if ".mlp.experts." in name]
    assert len(experts) == cfg.num_layers * cfg.num_experts * (2 if "fused" in shape else 3)
    assert all(weights[name].type_name == ("Q4_0" if shape in ("fused", "legacy") else "Q8_0")
               and weights[name].order is None for name in experts)
    assert not any(f".layers.{cfg.num_layers}." in name for name in weights)  # (MTP: left)


def test_qwen35moe_gguf_config_is_transformers_config(tmp_path: Path) -> None:
    for shape, (arch, model, file) in SHAPES.items():
        hf = moe_model(arch, VOCAB, **model)
        path = tmp_path / f"{shape}.gguf"
        write_moe_gguf(path, arch, hf, **file)
        config = json.loads((convert_gguf(path, tmp_path / shape, progress=False)
                             / "config.json").read_text())
        assert config["architectures"] == hf.config.architectures
        from_file, from_hf = ModelConfig.from_dict(config), ModelConfig.from_dict(
            hf.config.to_dict())
        for name in ("architecture", "num_layers", "layer_kinds", "linear_attention_shape",
                     "partial_rotary_factor", "head_dim", "num_heads", "num_kv_heads",
                     "rope_theta", "rope_scaling", "tie_word_embeddings", "num_experts",
                     "num_experts_per_tok", "moe_intermediate_size",
                     "shared_expert_intermediate_size", "norm_topk_prob", "moe_layers",
                     "routed_scaling_factor", "attention_output_gate", "qk_norm"):
            assert getattr(from_file, name) == getattr(from_hf, name), (shape, name)
        assert from_file.rms_norm_eps == pytest.approx(from_hf.rms_norm_eps)  # (float32)


def metadata(tmp_path: Path, arch: str, change: dict[str, Any], drop: str = ""
             ) -> dict[str, Any]:
    """``build_config`` of an ``arch`` file with the 35B-like / 80B-like shape's metadata
    (no tensors), its keys ``change``d (``arch.`` left out) and ``drop`` left out."""
    keys = moe_keys(arch, moe_model(arch, 64, **LINEAR).config, mtp=True)
    keys.update({f"{arch}.{k}": v for k, v in change.items()})
    keys.pop(f"{arch}.{drop}", None)
    path = tmp_path / "keys.gguf"
    writer = GGUFWriter(str(path), arch)
    add_keys(writer, keys)
    finish(writer)
    return build_config(open_header(path))


def test_qwen35moe_gguf_metadata(tmp_path: Path) -> None:
    config = metadata(tmp_path, "qwen35moe", {})
    assert config["architectures"] == ["Qwen3_5MoeForCausalLM"]
    assert config["num_hidden_layers"] == 4  # (the block_count of 5 less the MTP block)
    assert (config["num_experts"], config["num_experts_per_tok"],
            config["moe_intermediate_size"], config["shared_expert_intermediate_size"],
            config["intermediate_size"]) == (4, 2, 32, 48, 32)
    assert config["linear_value_heads_tiled"]
    # llama.cpp's fallbacks: the dense length over the experts used, and for the shared one
    config = metadata(tmp_path, "qwen3next", {"feed_forward_length": 96},
                      drop="expert_feed_forward_length")
    assert config["architectures"] == ["Qwen3NextForCausalLM"]
    assert (config["moe_intermediate_size"], config["shared_expert_intermediate_size"],
            config["mlp_only_layers"]) == (48, 48, [])
    assert not config["linear_value_heads_tiled"]


@pytest.mark.parametrize("arch,change,drop,match", [
    ("qwen35moe", {}, "expert_count", "lacks 'qwen35moe.expert_count'"),
    ("qwen3next", {"expert_used_count": 5}, "", "expert_used_count 5 exceeds .*count 4"),
    ("qwen35moe", {}, "expert_shared_feed_forward_length",
     "lacks qwen35moe.expert_feed_forward_length or .*shared"),
    ("qwen3next", {"expert_gating_func": 2}, "", "expert_gating_func 2 .* softmax"),
    ("qwen35moe", {"expert_weights_scale": 2.5}, "", "expert_weights_scale 2.5"),
    ("qwen3next", {"ssm.inner_size": 102}, "", "qwen3next.ssm.inner_size 102 does not split"),
    ("qwen3next", {}, "ssm.group_count", "lacks 'qwen3next.ssm.group_count'"),
])
def test_qwen35moe_gguf_metadata_errors(tmp_path: Path, arch: str, change: dict[str, Any],
                                        drop: str, match: str) -> None:
    with pytest.raises(ModelLoadError, match=match):
        ModelConfig.from_dict(metadata(tmp_path, arch, change, drop))
