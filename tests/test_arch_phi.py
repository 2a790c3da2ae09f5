"""Phi-1, Phi-1.5 and Phi-2 (``PhiForCausalLM`` directories, ``phi2`` GGUF files), exact
against transformers: greedy tokens and every position's logits, the prompt whole and in
chunks, on both engine paths.

Phi's differences from Llama: a parallel block (one LayerNorm with a bias, attention and
MLP both of its output), biases on q/k/v, on the attention's output, on the MLP's linears
and on the head, an MLP that is not gated (``fc2(gelu_new(fc1(x)))``, the tanh GELU), RoPE
on the first ``partial_rotary_factor`` of each head (Phi-2's 0.4: 6 of 16 dimensions
here; Phi-1's 0.5), the final LayerNorm with a bias, and optional per-head q/k LayerNorms
(``qk_layernorm``). The directories are tiny random models saved by transformers (Phi-2
like: 2 KV heads; Phi-1 like with q/k LayerNorms: as many KV heads as heads); the GGUF files are written as llama.cpp's converter
writes them (tests/gguf_phi2_files.py: q/k/v apart, or fused as its conversions of Phi's
original checkpoints are), their reference transformers' model holding the file's
dequantized weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_phi2_files import phi_model, random_phi, write_phi2_gguf
from test_arch_gemma3 import assert_chunks_match, engine_path
from test_arch_phi3 import save_model
from test_arch_qwen3_5 import assert_matches, generate, prompts_of, served
from test_gguf_rope_factors import greedy
from test_tensor_parallel import _check_tp_equals_one_rank
from tiny_models import build_tokenizer
from transformers import PhiConfig, PhiForCausalLM

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.gguf import convert_gguf
from freetoken_core.models.phi import PhiForCausalLM as NativePhi
from freetoken_core.models.phi3 import rotary_dim
from freetoken_core.models.registry import model_class
from freetoken_core.models.resolve import converted_dir

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VARIANTS: dict[str, dict[str, Any]] = {
    "phi2": {"partial_rotary_factor": 0.4, "layer_norm_eps": 1e-5},
    "phi1-qk-layernorm": {"partial_rotary_factor": 0.5, "layer_norm_eps": 1e-5,
                          "num_key_value_heads": 4, "qk_layernorm": True},
}


def save_phi(out_dir: Path, **overrides: Any) -> Path:
    """A tiny Phi directory saved by transformers (hidden 64, 4 heads of 16, 2 KV heads,
    2 layers unless ``overrides`` say otherwise; tests/tiny_models.py's tokenizer) with
    ``random_phi``'s weights."""
    tok = build_tokenizer(out_dir)
    config = PhiConfig(**{
        "vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 2048, "bos_token_id": 0, "eos_token_id": 2,
        "pad_token_id": 2, **overrides})
    return save_model(random_phi(config, 0), out_dir)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(variant: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_phi(tmp_path_factory.mktemp(variant), **VARIANTS[variant])


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> Any:
    return PhiForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("path", ["native", "torch"])
def test_phi_directory_matches_transformers(variant: str, model_dir: Path, hf: Any, path: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    native, _ = engine_path(path, monkeypatch)
    llm = served(model_dir)
    model = llm.engine.core.runner.model
    assert isinstance(model, NativePhi) and model.native is native
    cfg = model.config
    assert cfg.architecture == "phi" and not cfg.gated_mlp and cfg.attention_bias
    assert cfg.qk_norm == (variant == "phi1-qk-layernorm")
    assert rotary_dim(cfg) == (6 if variant == "phi2" else 8)
    assert not cfg.tie_word_embeddings
    assert model.lm_head.bias is not None and model.norm_bias is not None
    prompts = prompts_of(llm, 7)
    assert_matches(llm, hf, 7, [[], [1, 1, 70]])
    # (not one token winning every position)
    assert len({token for out in generate(llm, prompts) for token in out}) > 10


def test_phi_tensor_parallel_equals_one_rank(tmp_path: Path) -> None:
    """The LayerNorms on every rank, the o and MLP biases added once, the head's bias
    split with its rows."""
    model_dir = save_phi(tmp_path / "phi", **VARIANTS["phi2"])
    _check_tp_equals_one_rank(str(model_dir), dtype="float32")


def test_phi_config_defaults_and_errors() -> None:
    base = {"architectures": ["PhiForCausalLM"]}
    cfg, hf = ModelConfig.from_dict(base), PhiConfig()
    # transformers' PhiConfig defaults: Phi-1's shape, rotary fraction 0.5, eps 1e-5,
    # gelu_new, untied, as many KV heads as heads, biases, no q/k LayerNorms
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (
        hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (32, 32, 64)
    assert cfg.partial_rotary_factor == hf.rope_parameters["partial_rotary_factor"] == 0.5
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"] and cfg.rope_scaling is None
    assert (cfg.rms_norm_eps, cfg.hidden_act) == (hf.layer_norm_eps, hf.hidden_act)
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings is False
    assert cfg.max_position_embeddings == hf.max_position_embeddings
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (hf.bos_token_id, (hf.eos_token_id,))
    assert cfg.attention_bias and not cfg.qk_norm and not cfg.gated_mlp
    # the rope parameters' fraction wins over the top-level key, as in PhiConfig
    both = {**base, "partial_rotary_factor": 0.6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 100.0,
                                "partial_rotary_factor": 0.25}}
    assert ModelConfig.from_dict(both).partial_rotary_factor == PhiConfig(
        **{k: v for k, v in both.items() if k != "architectures"}
    ).rope_parameters["partial_rotary_factor"] == 0.25
    assert ModelConfig.from_dict({**base, "qk_layernorm": True}).qk_norm
    for bad, message in (({"hidden_act": "gelu"}, "gelu_new"),
                         ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}},
                          "rope type 'linear'"),
                         ({"partial_rotary_factor": 0}, "partial_rotary_factor"),
                         ({"layer_norm_eps": "x"}, "layer_norm_eps"),
                         ({"qk_layernorm": "yes"}, "qk_layernorm"),
                         ({"qk_layernorm": True, "head_dim": 32}, "head_dim"),
                         ({"model_type": "phi-msft"}, "phi-msft")):
        with pytest.raises(ModelLoadError, match=message):
            ModelConfig.from_dict({**base, **bad})
    # 5 of 16 dimensions rotated: odd, refused when the model is built
    odd = ModelConfig.from_dict({**base, "hidden_size": 64, "num_attention_heads": 4,
                                 "partial_rotary_factor": 0.3125})
    with pytest.raises(ModelLoadError, match="partial_rotary_factor"):
        model_class(odd)(odd, {}, 16)


@pytest.mark.parametrize(("qtype", "fused", "path"), [
    (GGMLQuantizationType.Q8_0, False, "native"),
    (GGMLQuantizationType.Q8_0, False, "torch"),
    (GGMLQuantizationType.Q4_0, True, "native"),
], ids=["q8_0", "q8_0-torch", "q4_0-fused-qkv"])
def test_phi2_gguf_matches_transformers(tmp_path: Path, qtype: int, fused: bool, path: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    native, _ = engine_path(path, monkeypatch)
    file = tmp_path / "phi2.gguf"
    hf = write_phi2_gguf(file, phi_model(seed=3), qtype, fused=fused)
    # (the same file each run: this code's conversion, not an earlier run's cached one)
    shutil.rmtree(converted_dir(file), ignore_errors=True)
    llm = served(file)
    model = llm.engine.core.runner.model
    assert isinstance(model, NativePhi) and model.native is native and model.uses_gguf_blocks
    assert model.config.architecture == "phi" and rotary_dim(model.config) == 6
    prompts = prompts_of(llm, 4)
    got = generate(llm, prompts)
    assert got == greedy(hf, prompts, 12)
    assert len({token for out in got for token in out}) > 10
    ids = prompts[1]
    assert_chunks_match(model, hf, ids, [1, 1, 70, len(ids) - 72])


def test_phi2_gguf_config_is_transformers_config(tmp_path: Path) -> None:
    # 30 of 44 dimensions rotated: rope.dimension_count 30, whose fraction 30 / 44 times 44
    # is a float just below 30 (the config's fraction must give 30 back)
    hf = phi_model(hidden_size=88, intermediate_size=352, num_attention_heads=2,
                   layer_norm_eps=1e-4, partial_rotary_factor=0.682,
                   max_position_embeddings=512)
    path = tmp_path / "phi2.gguf"
    write_phi2_gguf(path, hf, GGMLQuantizationType.F16)  # (rows of 88: not Q8_0 blocks)
    config = json.loads((convert_gguf(path, tmp_path / "out", progress=False)
                         / "config.json").read_text())
    assert config["architectures"] == ["PhiForCausalLM"]
    from_file, from_hf = ModelConfig.from_dict(config), ModelConfig.from_dict(
        hf.config.to_dict())
    for name in ("architecture", "vocab_size", "hidden_size", "intermediate_size",
                 "num_layers", "num_heads", "num_kv_heads", "head_dim", "rope_theta",
                 "rope_scaling", "max_position_embeddings", "tie_word_embeddings",
                 "attention_bias", "qk_norm", "gated_mlp", "hidden_act"):
        assert getattr(from_file, name) == getattr(from_hf, name), name
    assert from_file.rms_norm_eps == pytest.approx(from_hf.rms_norm_eps)
    assert rotary_dim(from_file) == rotary_dim(from_hf) == 30


@pytest.mark.parametrize(("keys", "message"), [
    ({"attention.layer_norm_epsilon": None}, "phi2.attention.layer_norm_epsilon"),
    ({"feed_forward_length": None}, "phi2.feed_forward_length"),
    ({"rope.dimension_count": 5}, "phi2.rope.dimension_count"),
    ({"rope.dimension_count": 32}, "phi2.rope.dimension_count"),
    ({"rope.scaling.type": "linear"}, "phi2.rope.scaling.type"),
])
def test_phi2_gguf_metadata_errors_name_the_key(tmp_path: Path, keys: dict[str, Any],
                                                message: str) -> None:
    path = tmp_path / "phi2.gguf"
    write_phi2_gguf(path, phi_model(), keys=keys)
    with pytest.raises(ModelLoadError, match=message):
        convert_gguf(path, tmp_path / "out", progress=False)
