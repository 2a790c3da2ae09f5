"""Cohere's Command models (``CohereForCausalLM`` and ``Cohere2ForCausalLM`` directories,
``command-r`` and ``cohere2`` GGUF files), exact against transformers: greedy tokens and
every position's logits.

Their differences from Llama: a parallel block (one LayerNorm, attention and MLP both of its
output), Cohere's mean-subtracting LayerNorm, RoPE on adjacent pairs (the q/k rows reordered
at load), the logits times ``logit_scale``, tied embeddings; Command R+'s per-head q/k
LayerNorms (``use_qk_norm``); Cohere 2's sliding layers (every 4th layer global; a window of
8 keys here, so the long prompt's queries see a part of it), rotated beside global layers
that are not (NoPE). The exact match covers the block, the norm and the pairs; the logit
scale, the q/k norms, the windows and the NoPE each move the logits when left out. The
directories are tiny random models saved by transformers; the GGUF files are written as
llama.cpp's converter writes them (one norm a block, ``attention.layer_norm_epsilon``,
``logit_scale``, the weights unpermuted), their reference transformers' model built from
gguf-py's dequantization (transformers' GGUF loader reads neither architecture)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf_models import Q4_0, Q8_0, write_gguf
from gguf_reference_families import hf_cohere_from_gguf
from test_arch_exaone4 import assert_windows_and_nope_matter, differs
from test_arch_moe import matching_logits, served_directory
from test_gguf_rope_factors import LONG, greedy, served
from transformers import Cohere2Config, Cohere2ForCausalLM, CohereConfig, CohereForCausalLM

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.cohere import CohereForCausalLM as NativeCohere
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.gguf import convert_gguf

PROMPTS = ["Hello world, this is", "def add(a, b):\n    return", LONG]
# (a logit scale of 0.5: transformers' 0.0625 would leave the random logits close together)
COHERE = {"num_hidden_layers": 2, "logit_scale": 0.5, "layer_norm_eps": 1e-5}
COHERE_QK = {**COHERE, "use_qk_norm": True}
COHERE2 = {"num_hidden_layers": 4, "sliding_window": 8, "sliding_window_pattern": 4,
           "logit_scale": 0.5, "layer_norm_eps": 1e-5}
KINDS = {"command-r": (CohereConfig, CohereForCausalLM, COHERE),
         "command-r-plus": (CohereConfig, CohereForCausalLM, COHERE_QK),
         "cohere2": (Cohere2Config, Cohere2ForCausalLM, COHERE2)}


def assert_logits_match(llm: Any, ids: list[int], ref: torch.nn.Module) -> None:
    """Every position's logits equal ``ref``'s (the prompt in two chunks); without the logit
    scale, the q/k norms (where there are some) or (Cohere 2) the windows or the global
    layers' NoPE they differ."""
    model, want = matching_logits(llm, ids, ref)
    assert isinstance(model, NativeCohere)
    cfg, saved = model.config, model.windows
    try:
        model.config = dataclasses.replace(cfg, logit_scale=1.0)
        assert differs(model, ids, want)
        model.config = cfg
        if cfg.qk_norm:
            norms = [(layer.q_norm, layer.k_norm) for layer in model.layers]
            assert norms[0][0].shape == (cfg.num_heads, cfg.head_dim)  # (a weight a head)
            for layer in model.layers:
                layer.q_norm, layer.k_norm = (torch.ones_like(w) for w in (layer.q_norm,
                                                                            layer.k_norm))
            assert differs(model, ids, want)
            for layer, (q, k) in zip(model.layers, norms):
                layer.q_norm, layer.k_norm = q, k
        if cfg.architecture == "cohere2":
            assert_windows_and_nope_matter(model, ids, want)
    finally:
        model.config, model.windows = cfg, saved


@pytest.mark.parametrize("kind", list(KINDS))
def test_cohere_directory_matches_transformers(tmp_path: Path, kind: str) -> None:
    config_class, model_class, config = KINDS[kind]
    hf, llm, prompts, got = served_directory(tmp_path / kind, config_class, model_class,
                                             **config)
    cfg = llm.engine.core.runner.model.config
    assert cfg.architecture == ("cohere2" if kind == "cohere2" else "cohere")
    assert cfg.logit_scale == 0.5 and cfg.rms_norm_eps == 1e-5 and cfg.tie_word_embeddings
    assert cfg.qk_norm == (kind == "command-r-plus")
    if kind == "cohere2":
        assert cfg.layer_windows == (8, 8, 8, None) and cfg.no_rope_layers == (1, 1, 1, 0)
    assert got == greedy(hf, prompts, 16)
    assert_logits_match(llm, prompts[-1], hf)


@pytest.mark.parametrize(("arch", "qk_norm"), [("command-r", False), ("command-r", True),
                                               ("cohere2", False)],
                         ids=["command-r", "command-r-plus", "cohere2"])
def test_cohere_gguf_matches_transformers(tmp_path: Path, arch: str, qk_norm: bool) -> None:
    layers = 4 if arch == "cohere2" else 2
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, hidden=64, layers=layers, heads=4,
                      kv_heads=2, ff=96, seed=5, weight_type=Q8_0, rope_theta=10000.0,
                      types={"attn_output.weight": Q4_0}, qk_norm=qk_norm,
                      metadata={"logit_scale": 0.5})
    hf = hf_cohere_from_gguf(path)
    llm, prompts, got = served(path, PROMPTS, 16)
    model = llm.engine.core.runner.model
    assert model.uses_gguf_blocks and model.config.qk_norm == qk_norm
    assert model.config.layer_windows == ((8, 8, 8, None) if arch == "cohere2" else ())
    assert got == greedy(hf, prompts, 16)
    assert_logits_match(llm, prompts[-1], hf)


@pytest.mark.parametrize(("metadata", "types", "scale"), [
    ({}, ["sliding_attention"] * 3 + ["full_attention"], 0.0625),  # (the converter's)
    ({"attention.sliding_window_pattern": 2, "rope.freq_base_swa": 5000.0},
     ["sliding_attention", "full_attention"] * 2, 0.0625),
    ({"attention.sliding_window_pattern": [True, False, True, True], "logit_scale": 0.25},
     ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"], 0.25),
])
def test_cohere2_files_as_llama_cpp_reads_them(tmp_path: Path, metadata: dict,
                                               types: list[str], scale: float) -> None:
    path = write_gguf(tmp_path / "cohere2.gguf", "cohere2", hidden=32, heads=2, kv_heads=1,
                      ff=32, layers=4, seed=1, metadata=metadata)
    config = json.loads((convert_gguf(path, tmp_path / "out", progress=False)
                         / "config.json").read_text())
    assert config["architectures"] == ["Cohere2ForCausalLM"]
    assert config["sliding_window"] == 8 and config["layer_types"] == types
    cfg = ModelConfig.from_dict(config)
    want = tuple(8 if t == "sliding_attention" else None for t in types)
    assert cfg.layer_windows == want
    assert cfg.no_rope_layers == tuple(int(w is not None) for w in want)
    # (llama.cpp's cohere2 graph rotates with rope.freq_base, not rope.freq_base_swa)
    assert cfg.rope_theta == 10000.0 and cfg.logit_scale == scale
    assert cfg.rms_norm_eps == pytest.approx(1e-5)


def test_command_r_file_without_logit_scale_and_config_defaults(tmp_path: Path) -> None:
    # llama.cpp: a command-r file's missing (or 0) logit_scale scales nothing
    path = write_gguf(tmp_path / "command-r.gguf", "command-r", hidden=32, heads=2,
                      kv_heads=1, ff=32, seed=1, metadata={"logit_scale": 0.0})
    config = json.loads((convert_gguf(path, tmp_path / "out", progress=False)
                         / "config.json").read_text())
    cfg = ModelConfig.from_dict(config)
    assert config["architectures"] == ["CohereForCausalLM"] and cfg.logit_scale == 1.0
    assert not cfg.qk_norm and not cfg.layer_windows
    base = {"architectures": ["CohereForCausalLM"], "vocab_size": 64, "hidden_size": 64,
            "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4}
    # transformers' defaults: logit scale 0.0625, eps 1e-5, rope base 500,000, tied
    cfg = ModelConfig.from_dict(base)
    assert (cfg.logit_scale, cfg.rms_norm_eps, cfg.rope_theta) == (0.0625, 1e-5, 500_000.0)
    assert cfg.tie_word_embeddings and not cfg.qk_norm
    two = ModelConfig.from_dict({**base, "architectures": ["Cohere2ForCausalLM"],
                                 "head_dim": 8})
    assert two.head_dim == 16 and two.rope_theta == 10000.0  # (hidden / heads, always)
    assert two.layer_windows == (4096, 4096, 4096, None)
    assert two.no_rope_layers == (1, 1, 1, 0)
    for bad, message in (({"logit_scale": None}, "logit_scale"),
                         ({"layer_norm_eps": "x"}, "layer_norm_eps"),
                         ({"hidden_act": "gelu"}, "silu")):
        with pytest.raises(ModelLoadError, match=message):
            ModelConfig.from_dict({**base, **bad})
    with pytest.raises(ModelLoadError, match="sliding_window_pattern"):
        ModelConfig.from_dict({**base, "architectures": ["Cohere2ForCausalLM"],
                               "sliding_window_pattern": 0})
