"""Qwen3.5 (``Qwen3_5ForCausalLM``, ``Qwen3_5ForConditionalGeneration`` and
``Qwen3_5MoeForCausalLM`` directories),
exact against transformers: greedy tokens and every position's logits, with its Gated
DeltaNet layers' recurrent states kept per sequence by the engine.

A tiny random model: three linear-attention layers in four (two key heads, each serving two
value heads), attention every fourth with an output gate and RoPE on half of each head.
Each of the engine's ways of running a sequence must leave its states as transformers'
single pass leaves them: prompts in one step or in chunks of any size (the chunked form's
64-token blocks crossed), several sequences decoding together in one batched update, more
requests than slots (a finished sequence's slot reused from zero), preemption (a sequence
recomputed from its first token in a slot it may not have had), and the same prompt twice
(no prefix-cache hit may skip a state)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_arch_gemma3 import chunked_logits, engine_path
from test_arch_phi3 import save_model, save_tiny_model
from test_gguf_rope_factors import greedy
from tiny_models import build_tokenizer
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from freetoken_core import LLM, SamplingParams
from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.gated_deltanet import chunked_delta_rule, recurrent_step
from freetoken_core.models.kv_layout import kv_cache_dims

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHAPE: dict[str, Any] = {
    "num_hidden_layers": 4, "head_dim": 16, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 8,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.5}}
TEXT = ("Once upon a time there was a little robot who wanted to learn how to write stories, "
        "so it read every book in the library twice and then wrote one of its own. ")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("qwen3_5"), Qwen3_5TextConfig,
                           Qwen3_5ForCausalLM, **SHAPE)


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> Any:
    return Qwen3_5ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def prompts_of(llm: LLM, count: int) -> list[list[int]]:
    """``count`` prompts of 5 to ~150 tokens (past two of the chunked form's blocks)."""
    ids = llm.tokenizer.encode(TEXT * 3, add_special_tokens=False)
    return [ids[:n] for n in (5, 150, 33, 64, 65, 1, 97)[:count]]


def served(model_dir: Path, **engine: Any) -> LLM:
    return LLM(str(model_dir), dtype="float32", progress=False, plugins="none",
               **{"kv_cache_tokens": 2048, **engine})


def generate(llm: LLM, prompts: list[list[int]], n: int = 12) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n,
                                                ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def assert_matches(llm: LLM, hf: Any, count: int, chunkings: list[list[int]]) -> Any:
    """Greedy tokens of ``count`` prompts equal ``hf``'s, and every position's logits of the
    150-token one, fed in each of ``chunkings``' chunks; returns the served model."""
    model = llm.engine.core.runner.model
    prompts = prompts_of(llm, count)
    assert generate(llm, prompts) == greedy(hf, prompts, 12)
    ids = prompts[1]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    for chunks in chunkings:
        torch.testing.assert_close(chunked_logits(model, ids, [*chunks, len(ids) - sum(chunks)]),
                                   want, atol=1e-3, rtol=1e-4)
    return model


@pytest.mark.parametrize("path", ["native", "torch"])
def test_qwen3_5_directory_matches_transformers(model_dir: Path, hf: Any, path: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    native, _ = engine_path(path, monkeypatch)
    llm = served(model_dir)
    model = llm.engine.core.runner.model
    assert model.native is native and llm.engine.core.runner.recurrent
    cfg = model.config
    assert cfg.layer_kinds == ("linear_attention",) * 3 + ("attention",)
    assert kv_cache_dims(cfg) == (1, 2, 16)  # (the attention layer alone)
    assert_matches(llm, hf, 7, [[], [1, 1, 70], [64, 64]])


def test_qwen3_5_moe_directory_matches_transformers(tmp_path: Path) -> None:
    model_dir = save_tiny_model(tmp_path, Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM,
                                **SHAPE, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=32, shared_expert_intermediate_size=48)
    hf = Qwen3_5MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = served(model_dir)
    model = llm.engine.core.runner.model
    assert model.config.architecture == "qwen3_5_moe"
    assert all(layer.moe is not None and layer.moe.shared is not None for layer in model.layers)
    assert_matches(llm, hf, 4, [[70]])


def test_qwen3_next_directory_matches_transformers(tmp_path: Path) -> None:
    # (its linear attention's projections fused per key head; one dense layer)
    model_dir = save_tiny_model(tmp_path, Qwen3NextConfig, Qwen3NextForCausalLM, **SHAPE,
                                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48, mlp_only_layers=[1])
    hf = Qwen3NextForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = served(model_dir)
    model = llm.engine.core.runner.model
    assert model.config.architecture == "qwen3_next"
    assert [layer.moe is None for layer in model.layers] == [False, True, False, False]
    prompts = prompts_of(llm, 4)
    assert generate(llm, prompts) == greedy(hf, prompts, 12)


def test_qwen3_5_states_across_slots_chunks_and_preemption(model_dir: Path, hf: Any) -> None:
    prompts = prompts_of(served(model_dir, max_num_seqs=1), 7)
    want = greedy(hf, prompts, 12)
    # more requests than slots; prompts cut into chunks of 16 tokens beside decodes
    llm = served(model_dir, max_num_seqs=2, max_num_batched_tokens=16)
    assert generate(llm, prompts) == want
    # a cache too small for all of them at once: sequences preempted and recomputed
    llm = served(model_dir, kv_cache_tokens=192, block_size=8, max_num_seqs=4)
    assert generate(llm, prompts) == want
    assert llm.engine.core.scheduler.num_preemptions > 0
    # the same prompt again: computed again, not taken from a prefix cache
    assert not llm.engine.core.scheduler.block_manager.enable_prefix_caching
    assert generate(llm, [prompts[1], prompts[1]]) == [want[1], want[1]]


def test_qwen3_5_conditional_generation_directory(tmp_path: Path, hf: Any) -> None:
    build_tokenizer(tmp_path)
    config = Qwen3_5Config(text_config=hf.config.to_dict())
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    wrapped = Qwen3_5ForConditionalGeneration(config).float().eval()
    wrapped.model.language_model.load_state_dict(hf.model.state_dict())
    wrapped.lm_head.load_state_dict(hf.lm_head.state_dict())
    save_model(wrapped, tmp_path)
    llm = served(tmp_path)
    assert llm.engine.core.runner.model.config.text_of == "Qwen3_5ForConditionalGeneration"
    prompts = prompts_of(llm, 3)
    assert generate(llm, prompts) == greedy(hf, prompts, 12)


def test_chunked_delta_rule_is_the_recurrence() -> None:
    gen = torch.Generator().manual_seed(0)
    heads, length, dk, dv = 3, 150, 8, 4
    q, k = (torch.nn.functional.normalize(torch.randn(heads, length, dk, generator=gen), dim=-1)
            for _ in range(2))
    v = torch.randn(heads, length, dv, generator=gen)
    g = -torch.rand(heads, length, generator=gen)
    beta = torch.rand(heads, length, generator=gen)
    state = torch.randn(heads, dk, dv, generator=gen)
    out, final = chunked_delta_rule(q, k, v, g, beta, state)
    s, outs = state[None], []
    for t in range(length):
        o, s = recurrent_step(q[None, :, t], k[None, :, t], v[None, :, t], g[None, :, t],
                              beta[None, :, t], s)
        outs.append(o[0])
    torch.testing.assert_close(out, torch.stack(outs, dim=1), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, s[0], atol=1e-4, rtol=1e-4)


def test_qwen3_5_config_defaults_and_errors() -> None:
    base = {"architectures": ["Qwen3_5ForCausalLM"], "vocab_size": 64, "hidden_size": 64,
            "intermediate_size": 64, "num_hidden_layers": 8}
    cfg = ModelConfig.from_dict(base)
    assert cfg.layer_kinds == (("linear_attention",) * 3 + ("attention",)) * 2
    assert cfg.linear_attention_shape == (16, 32, 128, 128, 4)
    assert (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads) == (256, 16, 4)
    assert cfg.partial_rotary_factor == 0.25 and cfg.qk_norm and cfg.attention_output_gate
    assert not cfg.tie_word_embeddings
    for bad, match in (({"linear_num_value_heads": 24, "linear_num_key_heads": 16},
                        "multiple"),
                       ({"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim"),
                       ({"layer_types": ["mamba"] * 8}, "layer_types"),
                       ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "yarn"),
                       ({"hidden_act": "gelu"}, "silu")):
        with pytest.raises(ModelLoadError, match=match):
            ModelConfig.from_dict({**base, **bad})
