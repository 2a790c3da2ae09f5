"""GGUF rotary scaling, applied as llama.cpp applies it.

Llama 3.1 and later files carry their llama3 rope scaling as ``rope_freqs.weight`` (one
factor per rotary pair, which llama.cpp's converter computes from the config); LongRoPE Phi-3
files (Phi-3 128k, Phi-3.5, Phi-4-mini) carry ``rope_factors_long`` / ``_short`` with
``rope.scaling.attn_factor`` and ``rope.scaling.original_context_length``, Phi-4-mini also a
partial rotary ``rope.dimension_count``; Gemma 3 4B and larger have linear scaling in the
metadata, for the global layers. transformers' GGUF loader drops all of these, so the oracle
here is transformers' model of the same weights (its GGUF loader's) with the config the file
was made from: llama3 ``rope_scaling``, Phi-3's ``longrope`` and ``partial_rotary_factor``,
Gemma 3's linear ``full_attention`` rope. The logits without the scaling differ (checked
too)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf_models import Q4_0, Q4_K, Q8_0, write_gguf
from gguf_reference import hf_from_gguf
from test_arch_gemma3 import chunked_logits
from transformers import Gemma3ForCausalLM, LlamaForCausalLM, Phi3ForCausalLM

from freetoken_core import LLM, SamplingParams
from freetoken_core.errors import ModelLoadError

PROMPTS = [
    "Hello world, this is",
    "def add(a, b):\n    return",
    "The quick brown fox jumps over the lazy dog. " * 3,
]
LONG = ("Once upon a time there was a little robot who wanted to learn how to write stories. "
        "Every morning it read a book, and every evening it wrote a short paragraph about what "
        "it had learned.")

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def llama3_factors(head_dim: int, base: float, scaling: dict[str, Any]) -> list[float]:
    """``rope_freqs.weight`` as llama.cpp's converter computes it from llama3 scaling
    (conversion/llama.py ``generate_extra_tensors``)."""
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def reference(path: Path, model_class: type, **config: Any) -> torch.nn.Module:
    """transformers' model of ``path``'s weights with ``config`` changed."""
    loaded = hf_from_gguf(path)
    cfg = loaded.config.__class__.from_dict({**loaded.config.to_dict(), **config})
    model = model_class(cfg).float().eval()
    model.load_state_dict(loaded.state_dict())
    return model


def greedy(model: torch.nn.Module, prompts: list[list[int]], n: int) -> list[list[int]]:
    out = []
    for ids in prompts:
        prompt = torch.tensor([ids])
        with torch.no_grad():
            gen = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                 max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=0)
        out.append(gen[0, len(ids):].tolist())
    return out


def assert_logits_match(llm: LLM, ids: list[int], ref: torch.nn.Module,
                        unscaled: torch.nn.Module, apart: float = 1.0) -> None:
    """The native model's logits of every position of ``ids`` (fed in chunks) equal
    ``ref``'s, and are more than ``apart`` from ``unscaled``'s."""
    half = len(ids) // 2
    got = chunked_logits(llm.engine.core.runner.model, ids, [half, len(ids) - half])
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
        other = unscaled(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    assert (got - other).abs().max() > apart


def served(path: Path, texts: list[str], n: int, **kwargs: Any) -> tuple[LLM, list[list[int]],
                                                                       list[list[int]]]:
    llm = LLM(str(path), kv_cache_tokens=2048, dtype="float32", progress=False,
              plugins="none", **kwargs)
    prompts = [llm.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return llm, prompts, [o.outputs[0].token_ids for o in outs]


def test_llama_rope_freqs_are_llama3_scaling(tmp_path: Path) -> None:
    # head_dim 64, base 10,000, pre-training length 64: pairs of every kind (unscaled,
    # smoothed, divided by the factor).
    factors = llama3_factors(64, 10000.0, LLAMA3)
    assert min(factors) == 1.0 and max(factors) == 8.0 and len(set(factors)) > 4
    path = write_gguf(tmp_path / "llama3.gguf", "llama", hidden=256, ff=512, heads=4,
                      kv_heads=2, weight_type=Q4_K, seed=3,
                      rope_factors={"rope_freqs.weight": factors})
    llm, prompts, got = served(path, PROMPTS + [LONG], 20)
    assert llm.engine.core.runner.model.config.rope_scaling["rope_type"] == "factors"
    ref = reference(path, LlamaForCausalLM, rope_scaling=LLAMA3)
    assert got == greedy(ref, prompts, 20)
    # transformers' GGUF model, which drops the factors, computes other logits.
    assert_logits_match(llm, prompts[-1], ref, hf_from_gguf(path))


def test_gemma3_linear_scaling_on_the_global_layers(tmp_path: Path) -> None:
    """Gemma 3 4B and larger: ``rope.scaling.type`` linear, factor 8, which llama.cpp and
    transformers apply to the global layers only (the local ones keep base 10,000)."""
    path = write_gguf(tmp_path / "gemma3.gguf", "gemma3", hidden=64, ff=128, heads=2,
                      kv_heads=1, head_dim=256, layers=6, rope_theta=1e6, weight_type=Q4_0,
                      sliding_window=6, seed=6,
                      metadata={"rope.scaling.type": "linear", "rope.scaling.factor": 8.0})
    llm, prompts, got = served(path, PROMPTS + [LONG], 12)
    assert llm.engine.core.runner.model.config.rope_scaling == {
        "rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    unscaled = hf_from_gguf(path)  # transformers' GGUF loader drops the scaling
    params = dict(unscaled.config.rope_parameters)
    params["full_attention"] = {**params["full_attention"], "rope_type": "linear",
                                "factor": 8.0}
    ref = reference(path, Gemma3ForCausalLM, rope_parameters=params)
    assert got == greedy(ref, prompts, 12)
    # (Base 1e6 over 256-wide heads turns slowly: over 40 positions the factor moves the
    # logits by ~0.01.)
    assert_logits_match(llm, prompts[-1], ref, unscaled, apart=2e-3)


def phi3_file(tmp_path: Path, original: int) -> tuple[Path, dict[str, Any]]:
    """A Phi-4-mini-shaped Phi-3: half of each 16-wide head rotated, LongRoPE, tied
    embeddings."""
    short, long = [1.0, 1.1, 1.3, 1.6], [2.0, 3.0, 5.0, 8.0]
    context = 2048
    attn_factor = math.sqrt(1 + math.log(context / original) / math.log(original))
    path = write_gguf(tmp_path / "phi3.gguf", "phi3", hidden=64, ff=128, heads=4, kv_heads=2,
                      weight_type=Q8_0, seed=5, context=context, rope_dims=8,
                      rope_factors={"rope_factors_long.weight": long,
                                    "rope_factors_short.weight": short},
                      metadata={"rope.scaling.attn_factor": attn_factor,
                                "rope.scaling.original_context_length": original})
    config = {"partial_rotary_factor": 0.5, "max_position_embeddings": context,
              "original_max_position_embeddings": original,
              "rope_scaling": {"rope_type": "longrope", "short_factor": short,
                               "long_factor": long,
                               "original_max_position_embeddings": original}}
    return path, config


def test_phi3_longrope_factors_and_partial_rotary(tmp_path: Path) -> None:
    original = 24
    path, config = phi3_file(tmp_path, original)
    ref = reference(path, Phi3ForCausalLM, **config)
    # The context limit within the pre-training length: the short factors (short prompts);
    # beyond it: the long ones (prompts longer than it, as transformers switches then).
    for texts, limit in ((["Hello world, this is", "x"], original), ([LONG, LONG[30:]], 512)):
        llm, prompts, got = served(path, texts, 8, max_model_len=limit)
        cfg = llm.engine.core.runner.model.config
        assert cfg.partial_rotary_factor == 0.5 and cfg.rope_scaling["rope_type"] == "longrope"
        assert all((len(p) + 8 <= original) == (limit == original) for p in prompts)
        assert got == greedy(ref, prompts, 8), limit
        unscaled = reference(path, Phi3ForCausalLM, partial_rotary_factor=0.5)
        assert_logits_match(llm, prompts[0], ref, unscaled)


def test_bad_factor_tensors_are_named(tmp_path: Path) -> None:
    cases = [
        ({"rope_freqs.weight": [1.0] * 5}, ("'rope_freqs.weight'.*F32 of shape \\[8\\].*"
                                           "not F32 of shape \\[5\\]")),
        ({"rope_freqs.weight": [1.0] * 7 + [0.0]}, "finite and positive"),
    ]
    for i, (factors, message) in enumerate(cases):
        path = write_gguf(tmp_path / f"bad{i}.gguf", "llama", rope_factors=factors)
        with pytest.raises(ModelLoadError, match=message):
            LLM(str(path), kv_cache_tokens=256, dtype="float32", progress=False, plugins="none")
    path = write_gguf(tmp_path / "half.gguf", "phi3", rope_dims=16,
                      rope_factors={"rope_factors_long.weight": [1.0] * 8},
                      metadata={"rope.scaling.original_context_length": 64})
    with pytest.raises(ModelLoadError, match="not 'rope_factors_short.weight'"):
        LLM(str(path), kv_cache_tokens=256, dtype="float32", progress=False, plugins="none")
    path = write_gguf(tmp_path / "partial.gguf", "qwen2", rope_dims=8)
    with pytest.raises(ModelLoadError, match="rope.dimension_count 8 != head_dim 16 "
                       r"\(partial rotary\) is supported for phi3, .*qwen35 families only"):
        LLM(str(path), kv_cache_tokens=256, dtype="float32", progress=False, plugins="none")
