"""Apertus (``ApertusForCausalLM`` directories: Apertus 8B, 70B; Apertus 1.5's text model,
``Apertus1p5TextForCausalLM``; ``apertus`` GGUF files), exact against transformers: greedy
tokens and every position's logits, the prompt whole and in chunks.

A tiny random Apertus: Llama's blocks under Apertus's norm names, per-head q/k RMSNorms before
the rotation, an MLP without a gate whose xIELU has its own scalars in every layer (softplus
arguments, beta and eps; eps as wide as -0.3 in one layer, so that ``min(x, eps)`` matters),
llama3 rope scaling with pairs of every kind. The GGUF files are written as llama.cpp's
converter writes them (tests/gguf_apertus_files.py: the xIELU scalars in ``xielu.*``
metadata, the llama3 scaling as ``rope_freqs`` factors); their metadata errors name the
key."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_apertus_files import EPS, ROPE, apertus_model, write_apertus_gguf
from test_arch_gemma3 import engine_path
from test_arch_phi3 import save_model
from test_arch_qwen3_5 import assert_matches, served
from tiny_models import build_tokenizer
from transformers import (
    Apertus1p5TextConfig,
    Apertus1p5TextForCausalLM,
    ApertusConfig,
    ApertusForCausalLM,
)
from transformers.activations import XIELUActivation

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.apertus import XIELU
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.gguf_metadata import build_config
from freetoken_core.models.gguf_reader import open_header
from freetoken_core.models.layers import rope_inv_freq

pytestmark = pytest.mark.usefixtures("one_torch_thread")
VOCAB = 49152  # (the default model's vocabulary, which the GGUF files take)
CHUNKINGS = [[], [70], [33, 64]]  # (the 150-token prompt whole, in two and three steps)
MODELS = {"apertus": (ApertusConfig, ApertusForCausalLM),
          "apertus1p5": (Apertus1p5TextConfig, Apertus1p5TextForCausalLM)}


def assert_apertus_layers(model: Any) -> None:
    """The served model is Apertus's: q/k norms, no gate, each layer's own xIELU."""
    cfg = model.config
    assert cfg.architecture == "apertus" and cfg.qk_norm and not cfg.gated_mlp
    assert cfg.hidden_act == "xielu"
    assert all(layer.q_norm is not None and not layer.gated and layer.one_call is None
               for layer in model.layers)
    assert [float(layer.xielu.eps) for layer in model.layers] == pytest.approx(EPS, rel=1e-6)


@pytest.mark.parametrize(("kind", "path"), [("apertus", "native"), ("apertus", "torch"),
                                            ("apertus1p5", "native")])
def test_apertus_directory_matches_transformers(tmp_path: Path, kind: str, path: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    native, _ = engine_path(path, monkeypatch)
    tok = build_tokenizer(tmp_path)
    model_dir = save_model(apertus_model(*MODELS[kind], len(tok), seed=3), tmp_path)
    hf = MODELS[kind][1].from_pretrained(model_dir, dtype=torch.float32).eval()
    assert float(hf.model.layers[2].mlp.act_fn.eps) == pytest.approx(EPS[2])  # (saved)
    llm = served(model_dir)
    model = llm.engine.core.runner.model
    assert model.native is native
    assert_apertus_layers(model)
    assert model.config.rope_scaling["rope_type"] == "llama3"
    assert_matches(llm, hf, 5, CHUNKINGS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_xielu_is_transformers_bit_for_bit(dtype: torch.dtype) -> None:
    act = XIELUActivation(dtype=dtype)
    with torch.no_grad():  # (eps wide enough that min(x, eps) clamps some inputs)
        for name, value in (("alpha_p", 0.3), ("alpha_n", -0.7), ("beta", 0.45),
                            ("eps", -0.05)):
            getattr(act, name).fill_(value)
        weights = {f"act_fn.{name}": getattr(act, name).clone()
                   for name in ("alpha_p", "alpha_n", "beta", "eps")}
        x = (torch.randn(256, 64, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
        x[0, :4] = torch.tensor([-0.01, -0.05, 0.0, 1e-3])
        want = act(x)
    got = XIELU(weights, "act_fn.")(x)
    assert not weights and got.dtype == dtype and torch.equal(got, want)


def test_apertus_config_defaults_and_errors() -> None:
    base = {"architectures": ["ApertusForCausalLM"], "vocab_size": 64, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    # transformers' ApertusConfig: llama3 scaling of base 12M where config.json has no rope
    # (its rope_theta then not read), the config's rope of its own or the config's base else
    for extra in ({}, {"rope_theta": 10000.0}, {"rope_scaling": None},
                  {"rope_scaling": {"rope_type": "linear", "factor": 2.0},
                   "rope_theta": 5e5},
                  {"rope_parameters": {"rope_type": "default", "rope_theta": 3e4}},
                  {"rope_scaling": {k: v for k, v in ROPE.items() if k != "rope_theta"},
                   "rope_theta": 2e4}):
        cfg = ModelConfig.from_dict({**base, **extra})
        want = ApertusConfig.from_dict({**base, **extra})
        params = dict(want.rope_parameters)
        assert cfg.rope_theta == params.pop("rope_theta"), extra
        if params["rope_type"] == "default":
            assert cfg.rope_scaling is None
        else:
            assert {k: cfg.rope_scaling[k] for k in params} == params, extra
    cfg = ModelConfig.from_dict(base)
    want = ApertusConfig.from_dict(base)
    assert (cfg.max_position_embeddings, cfg.rms_norm_eps, cfg.num_kv_heads,
            cfg.tie_word_embeddings, cfg.bos_token_id, cfg.eos_token_ids) == (
        want.max_position_embeddings, want.rms_norm_eps, want.num_key_value_heads,
        want.tie_word_embeddings, want.bos_token_id, (want.eos_token_id,))
    assert cfg.hidden_act == "xielu" and not cfg.gated_mlp and cfg.qk_norm
    assert not cfg.attention_bias and cfg.head_dim == 16
    unset = ModelConfig.from_dict({"architectures": ["ApertusForCausalLM"]})
    assert (unset.vocab_size, unset.hidden_size, unset.intermediate_size, unset.num_layers,
            unset.num_heads) == (131072, 4096, 14336, 32, 32)  # (ApertusConfig's)
    text1p5 = ModelConfig.from_dict({"architectures": ["Apertus1p5TextForCausalLM"]})
    assert text1p5.vocab_size == Apertus1p5TextConfig().vocab_size == 266752
    assert ModelConfig.from_dict({**base, "architectures": ["Apertus1p5TextForCausalLM"],
                                  "output_vocab_size": 64}).vocab_size == 64  # (not pruned)
    for bad, match in (({"hidden_act": "silu"}, "xielu"),
                       ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
                        "rope_type 'dynamic'"),
                       ({"architectures": ["Apertus1p5TextForCausalLM"],
                         "output_vocab_size": 32}, "output_vocab_size 32")):
        with pytest.raises(ModelLoadError, match=match):
            ModelConfig.from_dict({**base, **bad})


# ---------------------------------------------------------------------------------------------
# GGUF files
# ---------------------------------------------------------------------------------------------


def gguf_served(path: Path) -> Any:
    """``path`` served, its config built afresh (the files here are the same bytes at every
    run: a conversion cached by an earlier run would stand in for the metadata's reading)."""
    from freetoken_core.models.resolve import converted_dir, default_gguf_path

    assert default_gguf_path().exists()
    shutil.rmtree(converted_dir(path), ignore_errors=True)
    return served(path)


@pytest.mark.parametrize(("weight_type", "path"), [
    (GGMLQuantizationType.Q8_0, "native"), (GGMLQuantizationType.Q4_1, "native"),
    (GGMLQuantizationType.Q8_0, "torch")])
def test_apertus_gguf_matches_transformers(tmp_path: Path, weight_type: int, path: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    native, _ = engine_path(path, monkeypatch)
    file = tmp_path / "apertus.gguf"
    hf = write_apertus_gguf(file, apertus_model(ApertusConfig, ApertusForCausalLM, VOCAB,
                                                seed=5), weight_type)
    llm = gguf_served(file)
    model = llm.engine.core.runner.model
    assert model.uses_gguf_blocks and model.native is native
    assert_apertus_layers(model)
    assert model.config.rope_scaling["rope_type"] == "factors"  # (the file's rope_freqs)
    assert_matches(llm, hf, 5, CHUNKINGS)


def test_apertus_gguf_config_is_transformers_config(tmp_path: Path) -> None:
    hf = apertus_model(ApertusConfig, ApertusForCausalLM, VOCAB)
    path = tmp_path / "apertus.gguf"
    write_apertus_gguf(path, hf)
    from_file = ModelConfig.from_dict(build_config(open_header(path)))
    from_hf = ModelConfig.from_dict(hf.config.to_dict())
    for name in ("architecture", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                 "intermediate_size", "vocab_size", "rope_theta", "qk_norm", "gated_mlp",
                 "hidden_act", "attention_bias", "tie_word_embeddings"):
        assert getattr(from_file, name) == getattr(from_hf, name), name
    assert from_file.rms_norm_eps == pytest.approx(from_hf.rms_norm_eps)  # (float32 in the file)
    torch.testing.assert_close(  # (the factors are the llama3 scaling's, as llama.cpp turns)
        rope_inv_freq(16, from_file.rope_theta, from_file.rope_scaling),
        rope_inv_freq(16, from_hf.rope_theta, from_hf.rope_scaling), rtol=1e-6, atol=0)
    # without rope_freqs (a checkpoint without llama3 scaling): plain rope, as llama.cpp's
    plain = apertus_model(ApertusConfig, ApertusForCausalLM, VOCAB,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    write_apertus_gguf(path, plain)
    unscaled = ModelConfig.from_dict(build_config(open_header(path)))
    assert unscaled.rope_scaling is None and unscaled.rope_theta == 10000.0


def test_apertus_gguf_xielu_scalar_keys_serve_every_layer(tmp_path: Path) -> None:
    # (llama.cpp's get_key_or_arr: one value for every layer)
    hf = apertus_model(ApertusConfig, ApertusForCausalLM, VOCAB, seed=2)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.act_fn.eps.fill_(-0.05)
            layer.mlp.act_fn.beta.fill_(0.4)
    path = tmp_path / "apertus.gguf"
    write_apertus_gguf(path, hf, keys={"xielu.eps": -0.05, "xielu.beta": 0.4})
    llm = gguf_served(path)
    model = llm.engine.core.runner.model
    assert [float(layer.xielu.beta) for layer in model.layers] == pytest.approx([0.4] * 3)
    assert_matches(llm, hf, 2, [[]])


@pytest.mark.parametrize(("drop", "keys", "match"), [
    (("xielu.alpha_p",), {}, "lacks 'xielu.alpha_p'"),
    (("xielu.eps",), {}, "lacks 'xielu.eps'"),
    ((), {"xielu.beta": [0.5, 0.5]}, r"xielu\.beta has 2 values for 3 layers"),
    ((), {"xielu.alpha_n": [0.1, float("nan"), 0.2]}, r"xielu\.alpha_n holds a value"),
    (("apertus.attention.head_count",), {}, "lacks 'apertus.attention.head_count'"),
])
def test_apertus_gguf_metadata_errors_name_the_key(tmp_path: Path, drop: tuple[str, ...],
                                                   keys: dict[str, Any], match: str) -> None:
    path = tmp_path / "bad.gguf"
    write_apertus_gguf(path, apertus_model(ApertusConfig, ApertusForCausalLM, VOCAB),
                       drop_keys=drop, keys=keys)
    with pytest.raises(ModelLoadError, match=match):
        gguf_served(path)
