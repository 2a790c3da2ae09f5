"""Granite (transformers' ``GraniteForCausalLM``, llama.cpp's ``granite``): Llama with four
multipliers (the embeddings', each residual branch's, the attention scores' in place of
``head_dim ** -0.5``, the logits' divisor), from a directory and from a GGUF file.

The directory: a tiny random Granite saved by transformers (with multipliers), whose
greedy tokens and logits FreeToken matches. The GGUF: a random file written as llama.cpp's
converter writes Granite (llama's tensors, q/k permuted; ``granite.embedding_scale``,
``residual_scale``, ``attention.scale``, ``logit_scale``), against transformers' Granite
holding the same weights (its GGUF loader reads them from the same file written as
``llama``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from gguf_models import Q8_0, write_gguf
from gguf_reference import hf_with_weights_of
from test_arch_gemma3 import chunked_logits
from test_arch_phi3 import save_tiny_model
from test_gguf_rope_factors import LONG, greedy
from transformers import GraniteConfig, GraniteForCausalLM

from freetoken_core import LLM, SamplingParams

PROMPTS = ["Hello world, this is", "def add(a, b):\n    return", LONG]
# (Granite 3's are 12, 0.22, 1/128 and 8; here the residual branches keep the random
# model's greedy tokens varied.)
MULTIPLIERS = {"embedding_multiplier": 0.5, "residual_multiplier": 1.5,
               "attention_multiplier": 0.125, "logits_scaling": 8.0}


def check(model: Path, ref: Any) -> None:
    llm = LLM(str(model), kv_cache_tokens=1024, dtype="float32", progress=False,
              plugins="none")
    cfg = llm.engine.core.runner.model.config
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.query_scale,
            cfg.logits_scaling) == (0.5, 1.5, 0.125, 8.0)
    prompts = [llm.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16,
                                                ignore_eos=True))
    got = [o.outputs[0].token_ids for o in outs]
    assert got == greedy(ref, prompts, 16)
    assert all(len(set(t)) > 4 for t in got)
    ids = prompts[-1]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(chunked_logits(llm.engine.core.runner.model, ids,
                                              [5, len(ids) - 5]), want, atol=2e-4, rtol=1e-4)


def test_directory_matches_transformers(tmp_path: Path) -> None:
    model_dir = save_tiny_model(tmp_path / "granite", GraniteConfig, GraniteForCausalLM,
                                **MULTIPLIERS)
    check(model_dir, GraniteForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval())


def test_gguf_matches_transformers(tmp_path: Path) -> None:
    shape = {"hidden": 64, "ff": 128, "heads": 4, "kv_heads": 2, "weight_type": Q8_0,
             "seed": 13, "tied": False}
    path = write_gguf(tmp_path / "granite.gguf", "granite", **shape, metadata={
        "embedding_scale": 0.5, "residual_scale": 1.5, "attention.scale": 0.125,
        "logit_scale": 8.0})
    ref = hf_with_weights_of(write_gguf(tmp_path / "as-llama.gguf", "llama", **shape),
                             GraniteConfig, GraniteForCausalLM, rope_theta=10000.0,
                             **MULTIPLIERS)
    check(path, ref)
