"""YaRN rope scaling (Qwen2.5 / Qwen3's long-context setting, ``rope_scaling`` type
``yarn``), in Hugging Face directories and GGUF files, against transformers.

transformers' YaRN: each rotary pair's frequency a ramp between the scaled and the
unscaled one (``beta_fast`` / ``beta_slow`` turns over the original length, floored and
ceiled), cos and sin times the attention factor (``0.1 ln(factor) + 1``). llama.cpp
computes the same from a GGUF's ``rope.scaling.type`` yarn, ``rope.scaling.factor`` and
``rope.scaling.original_context_length`` (its default betas; the attention factor times
``rope.scaling.attn_factor``), which transformers' GGUF loader drops: the GGUF oracle is
transformers' model of the same weights with the YaRN config."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from gguf_models import Q8_0, write_gguf
from gguf_reference import hf_from_gguf
from test_gguf_rope_factors import LONG, assert_logits_match, greedy, reference, served
from tiny_models import make_tiny_model
from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

from freetoken_core import LLM, SamplingParams
from freetoken_core.models.layers import rope_attention_factor, rope_inv_freq

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
TEXTS = ["Hello world, this is", "def add(a, b):\n    return", LONG]


def test_inv_freq_and_attention_factor_are_transformers() -> None:
    from transformers import Qwen2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for extra in ({}, {"beta_fast": 16.0, "beta_slow": 2.0}, {"attention_factor": 1.25},
                  {"factor": 8.0, "mscale": 1.0, "mscale_all_dim": 0.5}):
        scaling = {**YARN, **extra}
        config = Qwen2Config(hidden_size=512, num_attention_heads=4, head_dim=128,
                             rope_theta=1e6, max_position_embeddings=4096,
                             rope_scaling=dict(scaling))
        want, factor = ROPE_INIT_FUNCTIONS["yarn"](config, torch.device("cpu"))
        torch.testing.assert_close(rope_inv_freq(128, 1e6, scaling), want, rtol=1e-6,
                                   atol=0)
        assert rope_attention_factor(scaling) == pytest.approx(factor, rel=1e-6), extra
    assert rope_attention_factor(None) == 1.0


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_hf_directory_with_yarn_matches_transformers(arch: str, tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / arch, arch, rope_scaling=dict(YARN))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert hf.config.rope_parameters["rope_type"] == "yarn"
    llm = LLM(str(model_dir), kv_cache_tokens=2048, dtype="float32", progress=False,
              plugins="none")
    prompts = [llm.tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16,
                                                ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == greedy(hf, prompts, 16)


@pytest.mark.parametrize("attn_factor", [None, 0.8])
def test_gguf_yarn_metadata_is_applied(attn_factor: float | None, tmp_path: Path) -> None:
    metadata: dict[str, float | int | str] = {
        "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
        "rope.scaling.original_context_length": 64}
    yarn = dict(YARN)
    if attn_factor is not None:  # llama.cpp multiplies YaRN's own factor by it
        metadata["rope.scaling.attn_factor"] = attn_factor
        yarn["attention_factor"] = attn_factor * (0.1 * math.log(4.0) + 1)
    path = write_gguf(tmp_path / "qwen3-yarn.gguf", "qwen3", hidden=64, ff=128, heads=2,
                      kv_heads=1, head_dim=128, weight_type=Q8_0, seed=9, rope_theta=1e6,
                      metadata=metadata)
    llm, prompts, got = served(path, TEXTS, 16)
    assert llm.engine.core.runner.model.config.rope_scaling["rope_type"] == "yarn"
    ref = reference(path, Qwen3ForCausalLM, rope_parameters={"rope_theta": 1e6, **yarn})
    assert got == greedy(ref, prompts, 16)
    assert_logits_match(llm, prompts[-1], ref, hf_from_gguf(path), apart=0.1)
