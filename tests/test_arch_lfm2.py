"""LFM2 (``Lfm2ForCausalLM`` and ``Lfm2MoeForCausalLM`` directories, ``lfm2`` and ``lfm2moe``
GGUF files), exact against transformers: greedy tokens and every position's logits, its
short-convolution layers' states kept per sequence by the engine.

A tiny random LFM2: convolution layers (a kernel of 3, with biases) beside attention layers
with q/k norms. As for Qwen3.5 (tests/test_arch_qwen3_5.py), the states must come out as
transformers' single pass leaves them however the engine runs a sequence: prompts whole or
in chunks, several sequences decoding together, more requests than slots, preemption.
The GGUF files are written as llama.cpp's converter writes them (tests/gguf_lfm2_files.py);
their reference is transformers' model holding the file's weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf_lfm2_files import lfm2_model, write_lfm2_gguf
from test_arch_gemma3 import assert_chunks_match, engine_path
from test_arch_phi3 import save_tiny_model
from test_arch_qwen3_5 import assert_matches, generate, prompts_of, served
from test_gguf_rope_factors import greedy
from transformers import Lfm2Config, Lfm2MoeConfig, Lfm2MoeForCausalLM
from transformers import Lfm2ForCausalLM as HFLfm2

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.gguf import convert_gguf
from freetoken_core.models.kv_layout import kv_cache_dims
from freetoken_core.models.resolve import converted_dir

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHAPE: dict[str, Any] = {"num_hidden_layers": 4, "conv_bias": True,
                         "layer_types": ["conv", "full_attention", "conv", "conv"],
                         "block_auto_adjust_ff_dim": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("lfm2"), Lfm2Config, HFLfm2, **SHAPE)


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> Any:
    return HFLfm2.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("path", ["native", "torch"])
def test_lfm2_directory_matches_transformers(model_dir: Path, hf: Any, path: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    native, _ = engine_path(path, monkeypatch)
    llm = served(model_dir)
    model = llm.engine.core.runner.model
    assert model.native is native and model.config.architecture == "lfm2"
    assert model.config.layer_kinds == ("short_conv", "attention", "short_conv", "short_conv")
    assert kv_cache_dims(model.config) == (1, 2, 16)
    assert_matches(llm, hf, 7, [[], [1, 1, 70]])


def test_lfm2_moe_directory_matches_transformers(tmp_path: Path) -> None:
    # (experts past the first layer, chosen by sigmoid scores plus a per-expert bias)
    model_dir = save_tiny_model(tmp_path, Lfm2MoeConfig, Lfm2MoeForCausalLM, **SHAPE,
                                num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=32, routed_scaling_factor=1.5)
    hf = Lfm2MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in hf.model.layers[1:]:  # (the bias changes which experts are chosen)
            layer.feed_forward.expert_bias.normal_(0.0, 0.5,
                                                   generator=torch.Generator().manual_seed(3))
    hf.save_pretrained(model_dir)
    llm = served(model_dir)
    model = llm.engine.core.runner.model
    assert model.config.architecture == "lfm2_moe"
    assert [layer.moe is None for layer in model.layers] == [True, False, False, False]
    assert_matches(llm, hf, 4, [[70]])


def test_lfm2_states_across_slots_chunks_and_preemption(model_dir: Path, hf: Any) -> None:
    prompts = prompts_of(served(model_dir, max_num_seqs=1), 7)
    want = greedy(hf, prompts, 12)
    assert generate(served(model_dir, max_num_seqs=2, max_num_batched_tokens=16),
                    prompts) == want
    llm = served(model_dir, kv_cache_tokens=192, block_size=8, max_num_seqs=4)
    assert generate(llm, prompts) == want
    assert llm.engine.core.scheduler.num_preemptions > 0


def test_lfm2_config_keys_defaults_and_errors() -> None:
    base = {"architectures": ["Lfm2ForCausalLM"], "vocab_size": 64, "hidden_size": 64,
            "num_hidden_layers": 4, "num_attention_heads": 4, "norm_eps": 1e-4,
            "block_ff_dim": 96, "full_attn_idxs": [1, 3]}
    cfg = ModelConfig.from_dict(base)
    assert cfg.layer_kinds == ("short_conv", "attention") * 2
    assert (cfg.rms_norm_eps, cfg.intermediate_size, cfg.short_conv_kernel) == (1e-4, 96, 3)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 1e6 and cfg.qk_norm
    for bad, match in (({"conv_L_cache": 1}, "conv_L_cache"),
                       ({"layer_types": ["mamba"] * 4}, "layer_types"),
                       ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "yarn")):
        with pytest.raises(ModelLoadError, match=match):
            ModelConfig.from_dict({**base, **bad})


@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("arch", ["lfm2", "lfm2moe"])
def test_lfm2_gguf_matches_transformers(tmp_path: Path, arch: str, path: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    native, _ = engine_path(path, monkeypatch)
    file = tmp_path / f"{arch}.gguf"
    hf = write_lfm2_gguf(file, lfm2_model(arch, seed=3))
    # (the same file each run: this code's conversion, not an earlier run's cached one)
    shutil.rmtree(converted_dir(file), ignore_errors=True)
    llm = served(file)
    model = llm.engine.core.runner.model
    assert model.native is native and model.uses_gguf_blocks
    assert model.config.architecture == {"lfm2": "lfm2", "lfm2moe": "lfm2_moe"}[arch]
    assert model.config.layer_kinds == ("short_conv", "attention", "short_conv", "short_conv")
    assert kv_cache_dims(model.config) == (1, 2, 16)
    if arch == "lfm2moe":
        assert [layer.moe is None for layer in model.layers] == [True, False, False, False]
    prompts = prompts_of(llm, 4)
    got = generate(llm, prompts)
    assert got == greedy(hf, prompts, 12) and len(set(got[1])) > 3
    ids = prompts[1]
    assert_chunks_match(model, hf, ids, [1, 1, 70, len(ids) - 72])


@pytest.mark.parametrize("arch", ["lfm2", "lfm2moe"])
def test_lfm2_gguf_config_is_transformers_config(tmp_path: Path, arch: str) -> None:
    hf = lfm2_model(arch, num_hidden_layers=5, norm_eps=1e-4, conv_L_cache=4,
                    layer_types=["conv", "full_attention", "conv", "full_attention", "conv"],
                    **({"num_dense_layers": 2} if arch == "lfm2moe" else {}))
    path = tmp_path / f"{arch}.gguf"
    write_lfm2_gguf(path, hf)
    config = json.loads((convert_gguf(path, tmp_path / "out", progress=False)
                         / "config.json").read_text())
    from_file, from_hf = ModelConfig.from_dict(config), ModelConfig.from_dict(
        hf.config.to_dict())
    for name in ("architecture", "layer_kinds", "short_conv_kernel", "num_heads",
                 "num_kv_heads", "head_dim", "intermediate_size",
                 "rope_theta", "qk_norm", "tie_word_embeddings", "num_experts",
                 "num_experts_per_tok", "moe_intermediate_size", "moe_layers", "expert_gating",
                 "norm_topk_prob", "routed_scaling_factor", "expert_selection_bias"):
        assert getattr(from_file, name) == getattr(from_hf, name), name
    assert from_file.short_conv_kernel == 4  # (the eps: float32 in the file)
    assert from_file.rms_norm_eps == pytest.approx(1e-4) and from_hf.rms_norm_eps == 1e-4


@pytest.mark.parametrize(("arch", "keys", "match"), [
    ("lfm2", {"attention.layer_norm_rms_epsilon": None}, "'lfm2.attention.layer_norm_rms_"),
    ("lfm2", {"shortconv.l_cache": None}, "'lfm2.shortconv.l_cache'"),
    ("lfm2", {"attention.head_count_kv": None}, "'lfm2.attention.head_count_kv'"),
    ("lfm2", {"attention.head_count_kv": [0, 2, 0]}, "head_count_kv has 3 values for 4"),
    ("lfm2", {"attention.head_count_kv": [0, 2, 1, 0]}, "head_count_kv \\[0, 2, 1, 0\\]"),
    ("lfm2", {"attention.sliding_window": 8}, "lfm2.attention.sliding_window"),
    ("lfm2moe", {"expert_gating_func": 1}, "lfm2moe.expert_gating_func 1"),
    ("lfm2moe", {"expert_used_count": None}, "'lfm2moe.expert_used_count'"),
])
def test_lfm2_gguf_metadata_errors(tmp_path: Path, arch: str, keys: dict[str, Any],
                                   match: str) -> None:
    path = tmp_path / f"{arch}.gguf"
    write_lfm2_gguf(path, lfm2_model(arch, num_hidden_layers=4), keys=keys)
    with pytest.raises(ModelLoadError, match=match):
        convert_gguf(path, tmp_path / "out", progress=False)
