"""Gemma 3n (text: ``Gemma3nForCausalLM`` and ``Gemma3nForConditionalGeneration`` directories,
``gemma3n`` GGUF files), exact against transformers: greedy tokens and every position's
logits, over the paged cache in chunks.

Two tiny random shapes, each with sliding layers (a window of 8 keys: the long prompt's
queries see a part of it) beside global ones, per-layer inputs and LAuReL:
- E2B-like: AltUp's 4 copies, the computing copy 0; the last two layers' keys and values
  those of earlier layers (``num_kv_shared_layers``); the first two layers' MLPs sparse
  (0.95, 0.9); an MLP width a layer;
- copy-1: AltUp's 3 copies, the computing copy 1 (the per-layer input still joins copies 1
  and 2, the final magnitudes still copy 0's), its correction unscaled
  (``altup_correct_scale`` false), the second layer sparse, ``altup_coef_clip`` below the
  coefficients (transformers clamps them in training only), and, as a directory, fewer
  per-layer embedding rows than tokens (a token past them takes token 0's).
The GGUF files are written as llama.cpp's converter writes them (tests/gguf_gemma3n_files.py);
their reference is transformers' model holding the file's weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf_gemma3n_files import gemma3n_model, write_gemma3n_gguf
from test_arch_gemma3 import engine_path
from test_arch_gemma4 import PROMPTS, assert_matches
from test_arch_phi3 import save_model
from test_gguf_rope_factors import served
from tiny_models import build_tokenizer

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.gemma3n import Gemma3nForCausalLM
from freetoken_core.models.gguf import convert_gguf
from freetoken_core.models.kv_layout import kv_sources
from freetoken_core.models.sharding import Shard

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TYPES = ["sliding_attention", "full_attention"]
SHAPES: dict[str, dict[str, Any]] = {
    "e2b-like": {"num_hidden_layers": 6, "layer_types": TYPES * 3, "num_kv_shared_layers": 2,
                 "intermediate_size": [96, 64, 96, 128, 64, 96],
                 "activation_sparsity_pattern": [0.95, 0.9, 0.0, 0.0, 0.0, 0.0]},
    "copy-1": {"layer_types": TYPES * 2, "altup_num_inputs": 3, "altup_active_idx": 1,
               "altup_correct_scale": False, "altup_coef_clip": 0.05,
               "activation_sparsity_pattern": [0.0, 0.8, 0.0, 0.0]},
}
PER_LAYER_ROWS = 560  # (copy-1's directory: the long prompt has tokens past them)


def gemma3n_dir(tmp_path: Path, shape: str) -> torch.nn.Module:
    """transformers' model of ``shape``, saved at ``tmp_path`` with the test tokenizer."""
    tok = build_tokenizer(tmp_path)
    rows = {"vocab_size_per_layer_input": PER_LAYER_ROWS} if shape == "copy-1" else {}
    hf = gemma3n_model(len(tok), **SHAPES[shape], **rows)
    save_model(hf, tmp_path)
    return hf


@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gemma3n_directory_matches_transformers(tmp_path: Path, shape: str, path: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    native, _ = engine_path(path, monkeypatch)
    hf = gemma3n_dir(tmp_path, shape)
    llm, prompts, got = served(tmp_path, PROMPTS, 16)
    model = assert_matches(llm, hf, prompts, got)
    assert model.native is native
    cfg = model.config
    assert cfg.architecture == "gemma3n" and cfg.laurel_rank == 8
    if shape == "e2b-like":
        assert cfg.altup == (4, 0, 1) and kv_sources(cfg) == (0, 1, 2, 3, 2, 3)
        assert [layer.std_multiplier is not None for layer in model.layers] == [
            True, True, False, False, False, False]
        assert [layer.down_proj.in_features for layer in model.layers] == [
            96, 64, 96, 128, 64, 96]
    else:
        assert cfg.altup == (3, 1, 0) and cfg.per_layer_vocab_size == PER_LAYER_ROWS
        assert max(prompts[-1]) >= PER_LAYER_ROWS


def test_gemma3n_conditional_generation_directory_serves_its_language_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``Gemma3nForConditionalGeneration`` saved by transformers (its vision tower, which
    needs timm, a stand-in module: it is not read), served for text and held to the
    wrapper's own logits."""
    import transformers.models.gemma3n.modeling_gemma3n as modeling
    from transformers import Gemma3nConfig, Gemma3nForConditionalGeneration

    tok = build_tokenizer(tmp_path)
    text = gemma3n_model(len(tok), **SHAPES["e2b-like"])
    config = Gemma3nConfig(
        text_config=text.config.to_dict(), vision_config={"hidden_size": 32},
        audio_config={"hidden_size": 32, "conf_num_hidden_layers": 1,
                      "conf_num_attention_heads": 2, "sscp_conv_channel_size": [4, 4]})
    config.architectures = ["Gemma3nForConditionalGeneration"]
    build = modeling.AutoModel.from_config
    monkeypatch.setattr(modeling.AutoModel, "from_config", lambda c, **kw: (
        torch.nn.Linear(2, 2) if c.model_type == "gemma3n_vision" else build(c, **kw)))
    wrapped = Gemma3nForConditionalGeneration(config).float().eval()
    missing, unexpected = wrapped.model.language_model.load_state_dict(
        text.model.state_dict(), strict=False)
    assert not unexpected and all("embed_scale" in k or "inv_freq" in k for k in missing)
    save_model(wrapped, tmp_path)
    names = wrapped.state_dict()
    assert any(k.startswith("model.vision_tower.") for k in names)
    assert any(k.startswith("model.audio_tower.") for k in names)
    llm, prompts, got = served(tmp_path, PROMPTS, 16)
    assert llm.engine.core.runner.model.config.text_of == "Gemma3nForConditionalGeneration"
    assert_matches(llm, wrapped, prompts, got)


@pytest.mark.parametrize("shape,path", [("e2b-like", "native"), ("e2b-like", "torch"),
                                        ("copy-1", "native")])
def test_gemma3n_gguf_matches_transformers(tmp_path: Path, shape: str, path: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from freetoken_core.models.resolve import converted_dir, default_gguf_path

    native, _ = engine_path(path, monkeypatch)
    vocab = 49152  # (the default model's vocabulary, which the file takes)
    assert default_gguf_path().exists()
    # (a file's correction is always scaled: llama.cpp's graph has no key for it)
    file = tmp_path / "gemma3n.gguf"
    hf = write_gemma3n_gguf(file, gemma3n_model(
        vocab, seed=3, **{**SHAPES[shape], "altup_correct_scale": True}))
    # (its config built afresh: the file is the same bytes at every run, and a conversion
    # cached by an earlier run would stand in for the metadata's reading)
    shutil.rmtree(converted_dir(file), ignore_errors=True)
    llm, prompts, got = served(file, PROMPTS, 16)
    model = assert_matches(llm, hf, prompts, got)
    assert model.native is native and model.uses_gguf_blocks
    assert model.config.altup == (hf.config.altup_num_inputs, hf.config.altup_active_idx, 1)


def test_gemma3n_gguf_config_is_transformers_config(tmp_path: Path) -> None:
    vocab = 49152
    hf = gemma3n_model(vocab, **SHAPES["e2b-like"])
    path = tmp_path / "gemma3n.gguf"
    write_gemma3n_gguf(path, hf)
    config = json.loads((convert_gguf(path, tmp_path / "out", progress=False)
                         / "config.json").read_text())
    from_file, from_hf = ModelConfig.from_dict(config), ModelConfig.from_dict(
        {**hf.config.to_dict(), "architectures": ["Gemma3nForCausalLM"]})
    for name in ("layer_windows", "kv_shared_layers", "per_layer_input_size",
                 "per_layer_vocab_size", "altup", "laurel_rank", "layer_intermediate_sizes",
                 "intermediate_size", "rope_local_theta", "rope_theta", "rope_scaling",
                 "head_dim", "num_kv_heads", "final_logit_softcap", "query_scale",
                 "tie_word_embeddings"):
        assert getattr(from_file, name) == getattr(from_hf, name), name
    # the sparsities through the file's quantiles: the same float32 values
    assert from_file.activation_sparsity == pytest.approx(from_hf.activation_sparsity,
                                                          abs=1e-7)
    assert from_file.activation_sparsity[0] == float(torch.tensor(0.95))


@pytest.mark.parametrize("omit", ["altup.num_inputs", "altup.active_idx",
                                  "attention.shared_kv_layers",
                                  "embedding_length_per_layer_input",
                                  "activation_sparsity_scale", "attention.sliding_window"])
def test_gemma3n_gguf_metadata_errors_name_the_key(tmp_path: Path, omit: str) -> None:
    path = tmp_path / "gemma3n.gguf"
    write_gemma3n_gguf(path, gemma3n_model(49152, **SHAPES["e2b-like"]), omit=(omit,))
    with pytest.raises(ModelLoadError, match=f"gemma3n.{omit}"):
        convert_gguf(path, tmp_path / "out", progress=False)


def test_gemma3n_config_defaults_and_errors() -> None:
    base = {"architectures": ["Gemma3nForCausalLM"], "vocab_size": 64, "hidden_size": 64,
            "num_hidden_layers": 20}
    cfg = ModelConfig.from_dict(base)
    # transformers' defaults: 8 heads of 256 / 2 KV heads, MLPs of 16,384, every 5th layer
    # global, windows of 512; the last 15 layers shared; 4 AltUp copies computing on copy 0,
    # scaled; LAuReL of rank 64; per-layer inputs of 256 for 262,144 tokens; the first 10
    # layers sparse (0.95); bases 1e6 / 1e4; logits softcapped at 30
    assert (cfg.num_heads, cfg.head_dim, cfg.num_kv_heads) == (8, 256, 2)
    assert cfg.layer_intermediate_sizes == (16_384,) * 20 and cfg.intermediate_size == 16_384
    assert cfg.layer_windows == ((512,) * 4 + (None,)) * 4
    assert cfg.kv_shared_layers == 15 and cfg.altup == (4, 0, 1) and cfg.laurel_rank == 64
    assert (cfg.per_layer_input_size, cfg.per_layer_vocab_size) == (256, 262_144)
    assert cfg.activation_sparsity == (0.95,) * 10 + (0.0,) * 10
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling) == (1e6, 1e4, None)
    assert (cfg.query_scale, cfg.final_logit_softcap, cfg.tie_word_embeddings) == (
        1.0, 30.0, True)
    assert cfg.eos_token_ids == (1,) and cfg.bos_token_id == 2
    small = ModelConfig.from_dict({**base, "num_hidden_layers": 10, "num_kv_shared_layers": 5})
    assert small.activation_sparsity == (0.0,) * 10  # (10 layers or fewer: none sparse)
    legacy = ModelConfig.from_dict({**base, "rope_theta": 5e5, "rope_local_base_freq": 2e3})
    assert (legacy.rope_theta, legacy.rope_local_theta) == (5e5, 2e3)
    for bad, match in (({"num_hidden_layers": 4}, "num_kv_shared_layers"),
                       ({"layer_types": ["sliding_attention"] * 19 + ["full_attention"]},
                        "num_kv_shared_layers"),
                       ({"intermediate_size": [64] * 19}, "intermediate_size"),
                       ({"activation_sparsity_pattern": 0.5}, "activation_sparsity_pattern"),
                       ({"activation_sparsity_pattern": [1.5] * 20},
                        "activation_sparsity_pattern"),
                       ({"altup_active_idx": 4}, "altup_active_idx"),
                       ({"altup_num_inputs": 0}, "altup_num_inputs"),
                       ({"laurel_rank": 0}, "laurel_rank"),
                       ({"hidden_size_per_layer_input": 0}, "hidden_size_per_layer_input"),
                       ({"attention_bias": True}, "attention_bias"),
                       ({"final_logit_softcapping": None}, "final_logit_softcapping"),
                       ({"num_attention_heads": 6}, "num_attention_heads"),
                       ({"hidden_activation": "silu"}, "gelu_pytorch_tanh")):
        with pytest.raises(ModelLoadError, match=match):
            ModelConfig.from_dict({**base, **bad})


def test_gemma3n_refuses_tensor_parallelism() -> None:
    cfg = ModelConfig.from_dict({"architectures": ["Gemma3nForCausalLM"], "vocab_size": 64,
                                 "hidden_size": 64, "num_hidden_layers": 2,
                                 "num_kv_shared_layers": 0})
    with pytest.raises(ModelLoadError, match="tensor parallelism of Gemma 3n"):
        Gemma3nForCausalLM(cfg, {}, 64, shard=Shard(0, 2, None))
