"""The native model against Hugging Face transformers, token for token, in one batch.

The reference is transformers in float32 on the CPU; the native model runs on the CPU and,
where torch sees CUDA, on CUDA in float32 too (``pytest -m gpu`` selects those; without CUDA
they are skipped)."""

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


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


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
    check_greedy(tmp_path / arch, arch, device="cpu")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_on_cuda_matches_transformers(arch: str, tmp_path: Path) -> None:
    # float32 on CUDA (the default there is bfloat16); TF32 stays off (torch's default),
    # so every GEMM rounds as IEEE float32 does.
    check_greedy(tmp_path / arch, arch, device="cuda")


def check_greedy(model_dir: Path, arch: str, device: str) -> None:
    model_dir = make_tiny_model(model_dir, arch)
    llm = LLM(str(model_dir), kv_cache_tokens=8192, device=device, dtype="float32",
              progress=False)
    prompt_ids = [llm.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    outs = llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=24,
                                                   ignore_eos=True))
    expected = hf_greedy(model_dir, prompt_ids, 24)
    for out, ref in zip(outs, expected):
        assert out.outputs[0].token_ids == ref


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu,
                                                                        needs_cuda])])
def test_chunked_prefill_matches_transformers(device: str, tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "llama", "llama")
    # A tiny token budget forces every prompt through several chunks over cached prefixes.
    llm = LLM(str(model_dir), kv_cache_tokens=8192, max_num_batched_tokens=7, device=device,
              dtype="float32", progress=False)
    prompt_ids = [llm.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    outs = llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=12,
                                                   ignore_eos=True))
    for out, ref in zip(outs, hf_greedy(model_dir, prompt_ids, 12)):
        assert out.outputs[0].token_ids == ref
