"""Mixture-of-experts models (``freetoken_core/models/moe.py``): Qwen3-MoE
(``Qwen3MoeForCausalLM`` directories, ``qwen3moe`` GGUF files) and Mixtral
(``MixtralForCausalLM`` directories, ``llama`` GGUF files with experts), each exact against
transformers: greedy tokens and every position's logits.

The directories are tiny random models saved by transformers (the Qwen3-MoE one with a dense
layer among its sparse ones, ``mlp_only_layers``); the GGUF files are written as llama.cpp's
converter writes them (3-d expert tensors, an F32 router), read by transformers' GGUF loader
(qwen3moe) or, for Mixtral's, which that loader reads as a dense Llama, dequantized by gguf-py
into transformers' Mixtral. The routing details matter: without renormalizing the top k
weights the logits move."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gguf_models import MXFP4, Q4_K, Q6_K, Q8_0, write_gguf
from gguf_reference import hf_from_gguf, hf_mixtral_from_gguf
from test_arch_gemma3 import chunked_logits
from test_arch_phi3 import save_tiny_model
from test_gguf_rope_factors import LONG, greedy, served
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from freetoken_core import LLM, SamplingParams
from freetoken_core.errors import ModelLoadError
from freetoken_core.models.config import ModelConfig

PROMPTS = ["Hello world, this is", "def add(a, b):\n    return", LONG]
QWEN3_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "norm_topk_prob": True, "head_dim": 16, "num_hidden_layers": 3,
             "mlp_only_layers": [1]}
MIXTRAL = {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 48}
QWEN2_MOE = {"num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 96, "num_hidden_layers": 2}


def served_directory(path: Path, config_class: type, model_class: type, **config: Any
                     ) -> tuple[Any, LLM, list[list[int]], list[list[int]]]:
    """A tiny ``model_class`` directory saved by transformers at ``path``: transformers' model
    of it, and ``served``'s engine, prompt ids and greedy tokens of ``PROMPTS``."""
    model_dir = save_tiny_model(path, config_class, model_class, **config)
    hf = model_class.from_pretrained(model_dir, dtype=torch.float32).eval()
    return (hf, *served(model_dir, PROMPTS, 16))


def matching_logits(llm: LLM, ids: list[int], ref: Any) -> tuple[Any, torch.Tensor]:
    """The served model and ``ref``'s logits of every position of ``ids``, which the model's
    equal (the prompt in two chunks)."""
    model = llm.engine.core.runner.model
    half = len(ids) // 2
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(chunked_logits(model, ids, [half, len(ids) - half]), want,
                               atol=2e-4, rtol=1e-4)
    return model, want


def assert_logits_match(llm: LLM, ids: list[int], ref: Any, renormalized: bool = True
                        ) -> None:
    """Every position's logits equal ``ref``'s (the prompt in two chunks); with the top k
    renormalized the other way round they differ."""
    model, want = matching_logits(llm, ids, ref)
    sparse = [layer.moe for layer in model.layers if layer.moe is not None]
    assert sparse
    for moe in sparse:
        moe.norm_topk_prob = not renormalized
    try:
        assert (chunked_logits(model, ids, [len(ids)]) - want).abs().max() > 0.05
    finally:
        for moe in sparse:
            moe.norm_topk_prob = renormalized


def test_qwen3_moe_directory_matches_transformers(tmp_path: Path) -> None:
    hf, llm, prompts, got = served_directory(tmp_path / "qwen3moe", Qwen3MoeConfig, Qwen3MoeForCausalLM,
                                             **QWEN3_MOE)
    model = llm.engine.core.runner.model
    cfg = model.config
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok) == ("qwen3_moe", 8, 2)
    assert cfg.moe_layers == (1, 0, 1) and cfg.qk_norm
    assert [layer.moe is not None for layer in model.layers] == [True, False, True]
    assert got == greedy(hf, prompts, 16)
    assert_logits_match(llm, prompts[-1], hf)


def test_qwen2_moe_directory_matches_transformers(tmp_path: Path) -> None:
    """Qwen2-MoE: q/k/v biases, the top k not renormalized, a shared expert gated by a
    sigmoid."""
    hf, llm, prompts, got = served_directory(tmp_path / "qwen2moe", Qwen2MoeConfig, Qwen2MoeForCausalLM,
                                             **QWEN2_MOE)
    cfg = llm.engine.core.runner.model.config
    assert (cfg.architecture, cfg.shared_expert_intermediate_size) == ("qwen2_moe", 96)
    assert cfg.attention_bias and not cfg.norm_topk_prob
    assert got == greedy(hf, prompts, 16)
    assert_logits_match(llm, prompts[-1], hf, renormalized=False)


def test_qwen2moe_gguf_matches_transformers(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "qwen2moe.gguf", "qwen2moe", hidden=64, layers=2, heads=4,
                      kv_heads=2, ff=128, expert_ff=32, shared_ff=96, experts=8,
                      experts_used=3, weight_type=Q8_0, tied=False, seed=8)
    # (transformers' GGUF loader reads neither expert length)
    hf = hf_from_gguf(path, moe_intermediate_size=32, shared_expert_intermediate_size=96)
    llm, prompts, got = served(path, PROMPTS, 16)
    cfg = llm.engine.core.runner.model.config
    assert (cfg.architecture, cfg.num_experts_per_tok, cfg.shared_expert_intermediate_size) == (
        "qwen2_moe", 3, 96)
    assert got == greedy(hf, prompts, 16)
    assert_logits_match(llm, prompts[-1], hf, renormalized=False)


def test_mixtral_directory_matches_transformers(tmp_path: Path) -> None:
    hf, llm, prompts, got = served_directory(tmp_path / "mixtral", MixtralConfig, MixtralForCausalLM,
                                             **MIXTRAL)
    cfg = llm.engine.core.runner.model.config
    assert (cfg.architecture, cfg.num_experts, cfg.moe_intermediate_size) == ("mixtral", 4, 48)
    assert got == greedy(hf, prompts, 16)
    assert_logits_match(llm, prompts[-1], hf)


@pytest.mark.parametrize("mix", ["Q8_0", "Q4_K+Q6_K", "MXFP4 experts"])
def test_qwen3moe_gguf_matches_transformers(tmp_path: Path, mix: str) -> None:
    """Experts of one type, a K-quant mix (Q4_K gate/up, Q6_K down, 256 wide), and MXFP4
    experts beside Q8_0 attention (as gpt-oss's files store their experts)."""
    shape: dict[str, Any] = {"hidden": 64, "ff": 128, "expert_ff": 32, "weight_type": Q8_0}
    if mix == "MXFP4 experts":
        shape["types"] = {f"ffn_{name}_exps.weight": MXFP4 for name in ("gate", "up", "down")}
    elif mix != "Q8_0":
        shape = {"hidden": 256, "ff": 512, "expert_ff": 256, "weight_type": Q4_K,
                 "types": {"ffn_down_exps.weight": Q6_K, "attn_v.weight": Q6_K}}
    path = write_gguf(tmp_path / "qwen3moe.gguf", "qwen3moe", layers=2, heads=4, kv_heads=2,
                      experts=8, experts_used=2, seed=3, **shape)
    # (transformers' GGUF loader does not read qwen3moe.expert_feed_forward_length)
    hf = hf_from_gguf(path, moe_intermediate_size=shape["expert_ff"])
    assert hf.config.norm_topk_prob
    llm, prompts, got = served(path, PROMPTS, 16)
    cfg = llm.engine.core.runner.model.config
    assert (cfg.architecture, cfg.num_experts, cfg.moe_intermediate_size) == (
        "qwen3_moe", 8, shape["expert_ff"])
    assert got == greedy(hf, prompts, 16)
    assert_logits_match(llm, prompts[-1], hf)


def test_mixtral_gguf_matches_transformers(tmp_path: Path) -> None:
    """A llama file with experts is Mixtral's (q/k permuted as for any llama file)."""
    path = write_gguf(tmp_path / "mixtral.gguf", "llama", hidden=64, layers=2, heads=4,
                      kv_heads=2, ff=64, experts=4, experts_used=2, weight_type=Q8_0,
                      tied=False, seed=5)
    hf = hf_mixtral_from_gguf(path)
    llm, prompts, got = served(path, PROMPTS, 16)
    cfg = llm.engine.core.runner.model.config
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok) == ("mixtral", 4, 2)
    assert got == greedy(hf, prompts, 16)
    assert_logits_match(llm, prompts[-1], hf)


def test_a_token_routes_the_same_in_any_batch(tmp_path: Path) -> None:
    """A seeded request draws the same tokens with the same logprobs alone and among others,
    its prompt cut into chunks of 32 tokens (a few rows an expert: one thread an expert) or
    prefilled in one step (an expert of 16 rows or more shares its features among the
    threads): each expert computes its tokens' rows, every row on its own, and a token's
    experts are summed in one order."""
    path = write_gguf(tmp_path / "qwen3moe.gguf", "qwen3moe", hidden=64, layers=2, ff=128,
                      expert_ff=32, experts=8, experts_used=2, weight_type=Q8_0, seed=4)
    seeded = SamplingParams(seed=7, temperature=1.0, max_tokens=12, ignore_eos=True,
                            logprobs=0)

    def draw(llm: LLM, prompts: list[list[int]]) -> tuple[list[int], list[float]]:
        out = llm.generate(prompts, seeded)[-1].outputs[0]
        return out.token_ids, [lp.logprob for lp in out.logprobs]

    draws = []
    for step_tokens in (32, 1024):
        llm = LLM(str(path), kv_cache_tokens=4096, dtype="float32", progress=False,
                  plugins="none", max_num_batched_tokens=step_tokens,
                  enable_prefix_caching=False)
        ids = [llm.tokenizer.encode(p, add_special_tokens=False)
               for p in [*PROMPTS[:2], " ".join([LONG] * 3)]]
        assert len(ids[-1]) * 2 // 8 > 16  # (2 of 8 experts a token: > 16 rows an expert)
        draws += [draw(llm, [ids[-1]]), draw(llm, [ids[0], ids[1], ids[0] + ids[1], ids[-1]])]
    assert all(d == draws[0] for d in draws)


def test_moe_config_errors_name_the_field() -> None:
    base = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    assert ModelConfig.from_dict(base).num_experts == 4
    for bad, field in (({"num_experts_per_tok": 5}, "num_experts_per_tok"),
                       ({"num_experts": 0}, "num_experts"),
                       ({"moe_intermediate_size": None}, "moe_intermediate_size"),
                       ({"routed_scaling_factor": -1}, "routed_scaling_factor")):
        with pytest.raises(ModelLoadError, match=field):
            ModelConfig.from_dict({**base, **bad})


def test_gguf_expert_counts_are_checked(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "bad.gguf", "qwen3moe", hidden=64, layers=1, ff=128,
                      expert_ff=32, experts=4, experts_used=6, weight_type=Q8_0)
    with pytest.raises(ModelLoadError, match="expert_used_count 6"):
        LLM(str(path), kv_cache_tokens=256, dtype="float32", progress=False, plugins="none")


def test_the_experts_in_one_native_call_compute_what_the_python_loop_computes(
        tmp_path: Path) -> None:
    """``moe_experts`` runs the experts' kernels from C++ in the order ``SparseMoE.loop``
    runs them from Python: every logit to the bit, in the exact and the q8 arithmetic."""
    path = write_gguf(tmp_path / "qwen3moe.gguf", "qwen3moe", hidden=64, layers=2, ff=128,
                      expert_ff=32, experts=8, experts_used=2, weight_type=Q8_0, seed=6)
    assert_native_experts_equal_loop(path)


def assert_native_experts_equal_loop(path: Path, args: Any = None) -> None:
    """The GGUF model ``path`` (every layer sparse) computes every logit of the long prompt
    the same to the bit with its experts in ``moe_experts`` and in ``SparseMoE.loop``, in
    the exact and the q8 arithmetic; ``args(native_args)`` checks the native call's
    arguments."""
    for activations in ("auto", "q8"):
        llm = LLM(str(path), kv_cache_tokens=1024, dtype="float32", progress=False,
                  plugins="none", activations=activations)
        model = llm.engine.core.runner.model
        ids = llm.tokenizer.encode(LONG, add_special_tokens=False)
        sparse = [layer.moe for layer in model.layers]
        assert all(moe is not None and moe.native_args is not None for moe in sparse)
        assert args is None or all(args(moe.native_args) for moe in sparse)
        native = chunked_logits(model, ids, [len(ids) - 3, 1, 1, 1])
        for moe in sparse:
            moe.native_args = None
        assert torch.equal(chunked_logits(model, ids, [len(ids) - 3, 1, 1, 1]), native)


def test_tensor_parallelism_of_an_moe_model_is_refused() -> None:
    from freetoken_core.models.llama import LlamaForCausalLM
    from freetoken_core.models.sharding import Shard

    cfg = ModelConfig.from_dict({
        "architectures": ["MixtralForCausalLM"], "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2})
    with pytest.raises(ModelLoadError, match="tensor parallelism of a mixture-of-experts"):
        LlamaForCausalLM(cfg, {}, 16, shard=Shard(rank=0, world_size=2, comm=None))
