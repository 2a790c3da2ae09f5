"""The native model against Hugging Face transformers, token for token, in one batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import ARCHS, make_tiny_model
from transformers import AutoModelForCausalLM

from freetoken_core import LLM, SamplingParams

PROMPTS = [
    "Hello world, this is",
    "def add(a, b):",
    "The quick brown fox jumps over the lazy dog. " * 12,
    "x",
    "Sampling turns the logits into probabilities",
    "Once upon a time there was a little robot",
]


def hf_greedy(model_dir: Path, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    for ids in prompts:
        gen = hf.generate(torch.tensor([ids]), max_new_tokens=num_tokens, do_sample=False,
                          min_new_tokens=num_tokens, pad_token_id=0)
        out.append(gen[0, len(ids):].tolist())
    return out


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_matches_transformers(arch: str, tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / arch, arch)
    llm = LLM(str(model_dir), kv_cache_tokens=8192, progress=False)
    prompt_ids = [llm.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    outs = llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=24,
                                                   ignore_eos=True))
    expected = hf_greedy(model_dir, prompt_ids, 24)
    for out, ref in zip(outs, expected):
        assert out.outputs[0].token_ids == ref


def test_chunked_prefill_matches_transformers(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "llama", "llama")
    # A tiny token budget forces every prompt through several chunks over cached prefixes.
    llm = LLM(str(model_dir), kv_cache_tokens=8192, max_num_batched_tokens=7, progress=False)
    prompt_ids = [llm.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    outs = llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=12,
                                                   ignore_eos=True))
    for out, ref in zip(outs, hf_greedy(model_dir, prompt_ids, 12)):
        assert out.outputs[0].token_ids == ref
