"""Ministral 3 (transformers' ``Ministral3ForCausalLM``, llama.cpp's ``mistral3``: Ministral
3 3B/8B/14B, Devstral Small 2): Llama with YaRN and Llama 4's attention temperature, from a
directory and from a GGUF file.

The temperature: after rotation, a query at position p is multiplied by ``1 + beta ln(1 +
floor(p / L))`` (``llama_4_scaling_beta``, L the original context length): 1 below L, so only
long contexts see it. Here L = 16 and the long prompt runs past 2 L, so its queries take
three multipliers. The directory: a tiny random model saved by transformers. The GGUF: a
random file written as llama.cpp's converter writes ``mistral3`` (llama's tensors, q/k
permuted; YaRN and ``attention.temperature_scale`` keys), against transformers' Ministral 3
holding the same weights (its GGUF loader reads them from the same file written as
``llama``). Without the temperature the logits differ."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf_models import Q8_0, write_gguf
from gguf_reference import hf_with_weights_of
from test_arch_gemma3 import chunked_logits
from test_arch_phi3 import save_tiny_model
from test_gguf_rope_factors import LONG, greedy, served
from transformers import Ministral3Config, Ministral3ForCausalLM

from freetoken_core import LLM
from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config import ModelConfig

PROMPTS = ["Hello world, this is", "def add(a, b):\n    return", LONG]
ROPE = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
        "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.5}
GGUF_ROPE = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
             "rope.scaling.original_context_length": 16, "rope.scaling.yarn_beta_fast": 32.0,
             "rope.scaling.yarn_beta_slow": 1.0, "rope.scaling.yarn_log_multiplier": 1.0,
             "attention.temperature_scale": 0.5}


def assert_temperature_matters(llm: LLM, ids: list[int], ref: Any) -> None:
    """Logits of every position equal ``ref``'s (the prompt in two chunks, then in one);
    without the temperature they differ."""
    model = llm.engine.core.runner.model
    assert len(ids) > 2 * 16
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    half = len(ids) // 2
    for chunks in ([half, len(ids) - half], [len(ids)]):
        torch.testing.assert_close(chunked_logits(model, ids, chunks), want, atol=2e-4,
                                   rtol=1e-4)
    config = model.config
    model.config = dataclasses.replace(config, attention_temperature_beta=0.0)
    try:
        assert (chunked_logits(model, ids, [len(ids)]) - want).abs().max() > 0.05
    finally:
        model.config = config


def test_directory_matches_transformers(tmp_path: Path) -> None:
    model_dir = save_tiny_model(tmp_path / "ministral3", Ministral3Config,
                                Ministral3ForCausalLM, 3, head_dim=16, num_hidden_layers=3,
                                rope_parameters=ROPE)
    hf = Ministral3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm, prompts, got = served(model_dir, PROMPTS, 16)
    cfg = llm.engine.core.runner.model.config
    assert cfg.architecture == "ministral3" and cfg.rope_scaling["rope_type"] == "yarn"
    assert (cfg.attention_temperature_beta, cfg.attention_temperature_length) == (0.5, 16)
    assert got == greedy(hf, prompts, 16)
    assert_temperature_matters(llm, prompts[-1], hf)


def test_gguf_matches_transformers(tmp_path: Path) -> None:
    shape = {"hidden": 64, "ff": 128, "heads": 4, "kv_heads": 2, "layers": 3,
             "weight_type": Q8_0, "seed": 13, "rope_theta": 1e6}
    path = write_gguf(tmp_path / "mistral3.gguf", "mistral3", metadata=GGUF_ROPE, **shape)
    ref = hf_with_weights_of(write_gguf(tmp_path / "as-llama.gguf", "llama", **shape),
                             Ministral3Config, Ministral3ForCausalLM, head_dim=16,
                             rope_parameters=ROPE)
    llm, prompts, got = served(path, PROMPTS, 16)
    cfg = llm.engine.core.runner.model.config
    assert cfg.architecture == "ministral3"
    assert cfg.rope_scaling["attention_factor"] == 1.0  # (llama.cpp's graph: cos, sin as is)
    assert (cfg.attention_temperature_beta, cfg.attention_temperature_length) == (0.5, 16)
    assert got == greedy(ref, prompts, 16)
    assert_temperature_matters(llm, prompts[-1], ref)


def test_mixture_of_experts_files_and_bad_temperatures_are_refused(tmp_path: Path) -> None:
    from freetoken_core.models.gguf import convert_gguf

    path = write_gguf(tmp_path / "moe.gguf", "mistral3", experts=4, seed=2)
    with pytest.raises(ModelLoadError, match="mistral3 with experts"):
        convert_gguf(path, tmp_path / "out", progress=False)
    base = {"architectures": ["Ministral3ForCausalLM"], "vocab_size": 64, "hidden_size": 64,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    with pytest.raises(ModelLoadError, match="original_max_position_embeddings"):
        ModelConfig.from_dict({**base, "rope_parameters": {"rope_type": "default",
                                                           "llama_4_scaling_beta": 0.1}})
