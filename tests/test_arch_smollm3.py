"""SmolLM3 (transformers' ``SmolLM3ForCausalLM``, llama.cpp's ``smollm3``): Llama with every
4th layer not rotating queries and keys (NoPE), from a directory and from a GGUF file.

The directory: a tiny random SmolLM3 saved by transformers, whose greedy tokens and logits
FreeToken matches. The GGUF: a random file written as llama.cpp's converter writes SmolLM3
(llama's tensors, q/k permuted), against transformers' SmolLM3 holding the same weights
(transformers' GGUF loader reads them from the same file written as ``llama``); llama.cpp
puts NoPE on every 4th layer, as transformers' default does. The NoPE layers matter: the
same weights with every layer rotating give other logits."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from gguf_models import Q8_0, write_gguf
from gguf_reference import hf_with_weights_of
from test_arch_gemma3 import chunked_logits
from test_arch_phi3 import save_tiny_model
from test_gguf_rope_factors import LONG, greedy, served
from transformers import SmolLM3Config, SmolLM3ForCausalLM

from freetoken_core import LLM

PROMPTS = ["Hello world, this is", "def add(a, b):\n    return", LONG]


def make_smollm3(out_dir: Path, seed: int = 0) -> Path:
    """A tiny SmolLM3 of 4 layers (the last without RoPE), rope base 10,000."""
    return save_tiny_model(out_dir, SmolLM3Config, SmolLM3ForCausalLM, seed,
                           num_hidden_layers=4, rope_theta=10000.0)


def assert_nope_matters(llm: LLM, ids: list[int], ref: Any) -> None:
    """Logits of every position equal ``ref``'s; with every layer rotating they differ."""
    model = llm.engine.core.runner.model
    half = len(ids) // 2
    got = chunked_logits(model, ids, [half, len(ids) - half])
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    config = model.config
    model.config = dataclasses.replace(config, no_rope_layers=())
    try:
        assert (chunked_logits(model, ids, [len(ids)]) - want).abs().max() > 0.1
    finally:
        model.config = config


def test_directory_matches_transformers(tmp_path: Path) -> None:
    model_dir = make_smollm3(tmp_path / "smollm3")
    hf = SmolLM3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert hf.config.no_rope_layers == [1, 1, 1, 0]
    llm, prompts, got = served(model_dir, PROMPTS, 16)
    cfg = llm.engine.core.runner.model.config
    assert cfg.architecture == "smollm3" and cfg.no_rope_layers == (1, 1, 1, 0)
    assert cfg.tie_word_embeddings
    assert got == greedy(hf, prompts, 16)
    assert_nope_matters(llm, prompts[-1], hf)


def test_gguf_matches_transformers(tmp_path: Path) -> None:
    shape = {"hidden": 64, "ff": 128, "heads": 4, "kv_heads": 2, "layers": 4,
             "weight_type": Q8_0, "seed": 11}
    smol = write_gguf(tmp_path / "smollm3.gguf", "smollm3", **shape)
    ref = hf_with_weights_of(write_gguf(tmp_path / "as-llama.gguf", "llama", **shape),
                             SmolLM3Config, SmolLM3ForCausalLM, rope_theta=10000.0)
    llm, prompts, got = served(smol, PROMPTS, 16)
    assert llm.engine.core.runner.model.config.no_rope_layers == (1, 1, 1, 0)
    assert got == greedy(ref, prompts, 16)
    assert_nope_matters(llm, prompts[-1], ref)
