"""gpt-oss (``GptOssForCausalLM`` directories, ``gpt-oss`` GGUF files), exact against
transformers: greedy tokens and every position's logits.

Its differences from the other mixture-of-experts models, each of which moves the logits
when left out: a sink logit per attention head in every query's softmax, biases on the
attention's four projections, the router and the experts, the router's top k logits
softmaxed into the weights, the clamped SwiGLU, and sliding-window layers (every other one;
a window of 8 keys here, so the long prompt's queries see a part of it) beside global ones,
with YaRN's rope. The directory is a tiny random model saved by transformers; the GGUF file
is written as llama.cpp's converter writes gpt-oss (F32 biases and sinks, 3-d expert
tensors), its reference transformers' model built from gguf-py's dequantization
(transformers' GGUF loader does not read gpt-oss)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gguf_models import MXFP4, Q8_0, write_gguf
from gguf_reference import hf_gpt_oss_from_gguf
from test_arch_gemma3 import chunked_logits
from test_arch_moe import assert_native_experts_equal_loop, matching_logits, served_directory
from test_arch_phi3 import save_tiny_model
from test_gguf_rope_factors import LONG, greedy, served
from transformers import GptOssConfig, GptOssForCausalLM

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.attention import AttentionMetadata, paged_attention
from freetoken_core.models.config import ModelConfig

PROMPTS = ["Hello world, this is", "def add(a, b):\n    return", LONG]
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 64, "rope_theta": 150000.0}
GPT_OSS = {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 48,
           "head_dim": 16, "num_hidden_layers": 4, "sliding_window": 8,
           "layer_types": ["sliding_attention", "full_attention"] * 2,
           "rope_parameters": {**YARN, "truncate": False}}
GGUF_YARN = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
             "rope.scaling.original_context_length": 64, "rope.scaling.yarn_beta_fast": 32.0,
             "rope.scaling.yarn_beta_slow": 1.0}


def assert_logits_match(llm: Any, ids: list[int], ref: torch.nn.Module) -> None:
    """Every position's logits equal ``ref``'s (the prompt in two chunks), and without
    the sinks, or without the sliding windows, they differ."""
    model, want = matching_logits(llm, ids, ref)
    sinks = [layer.sinks for layer in model.layers]
    windows = model.windows
    try:
        for layer in model.layers:
            layer.sinks = None
        assert (chunked_logits(model, ids, [len(ids)]) - want).abs().max() > 0.05
        for layer, sink in zip(model.layers, sinks):
            layer.sinks = sink
        model.windows = [None] * len(windows)
        assert (chunked_logits(model, ids, [len(ids)]) - want).abs().max() > 0.05
    finally:
        for layer, sink in zip(model.layers, sinks):
            layer.sinks = sink
        model.windows = windows


def test_gpt_oss_directory_matches_transformers(tmp_path: Path) -> None:
    hf, llm, prompts, got = served_directory(tmp_path / "gpt-oss", GptOssConfig,
                                             GptOssForCausalLM, **GPT_OSS)
    model = llm.engine.core.runner.model
    cfg = model.config
    assert (cfg.architecture, cfg.num_experts, cfg.moe_intermediate_size) == ("gpt_oss", 4, 48)
    assert cfg.layer_windows == (8, None, 8, None) and cfg.expert_gating == "softmax_weight"
    assert len(prompts[-1]) > 4 * 8  # (the windows cut the long prompt)
    assert got == greedy(hf, prompts, 16)
    assert_logits_match(llm, prompts[-1], hf)


@pytest.mark.parametrize("experts", ["Q8_0", "MXFP4"])
def test_gpt_oss_gguf_matches_transformers(tmp_path: Path, experts: str) -> None:
    """Experts of Q8_0, and of MXFP4 as gpt-oss's files have them (the rest Q8_0)."""
    types = {f"ffn_{w}_exps.weight": MXFP4 for w in ("gate", "up", "down")}
    path = write_gguf(tmp_path / "gpt-oss.gguf", "gpt-oss", hidden=64, layers=4, heads=4,
                      kv_heads=2, head_dim=16, ff=48, expert_ff=32, experts=4,
                      experts_used=2, weight_type=Q8_0, tied=False, seed=5, sliding_window=8,
                      rope_theta=150000.0, metadata=GGUF_YARN,
                      types=types if experts == "MXFP4" else None)
    hf = hf_gpt_oss_from_gguf(path)
    llm, prompts, got = served(path, PROMPTS, 16)
    cfg = llm.engine.core.runner.model.config
    assert (cfg.architecture, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (
        "gpt_oss", 2, 32)
    assert cfg.layer_windows == (8, None, 8, None)
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["factor"] == 4.0
    expert = llm.engine.core.runner.model.layers[0].moe.experts[0][0]
    assert expert.blocks is not None and expert.blocks[0] & 0xFF == (
        MXFP4 if experts == "MXFP4" else Q8_0)
    assert got == greedy(hf, prompts, 16)
    assert_logits_match(llm, prompts[-1], hf)


@pytest.mark.parametrize("window", [None, 5])
def test_attention_sinks_native_and_torch_paths(window: int | None) -> None:
    """Both paths of ``paged_attention`` with sinks (prefill chunks and decoding tokens)
    against the softmax over each query's scores and its head's sink, computed directly."""
    from freetoken_core.kernels import cpu_kernels_available

    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, block = 4, 2, 16, 4
    lens = [9, 13]  # two sequences: the first decodes its last token, the second prefills 6
    queries = [1, 6]
    tables = [[3, 1, 0], [5, 2, 4, 6]]
    cache = torch.zeros(8 * block, 2, kv_heads, dim)
    keys = [torch.randn(n, 2, kv_heads, dim, generator=gen) for n in lens]
    for table, kv in zip(tables, keys):  # the cached part of each context
        for pos in range(len(kv)):
            cache[table[pos // block] * block + pos % block] = kv[pos]
    q = torch.randn(sum(queries), heads, dim, generator=gen)
    sinks = torch.randn(heads, generator=gen) * 2
    step_kv = torch.cat([kv[n - m:] for kv, n, m in zip(keys, lens, queries)])

    want = []
    for kv, n, m, start in zip(keys, lens, queries, (0, 1)):
        for i in range(m):
            pos = n - m + i
            lo = 0 if window is None else max(0, pos + 1 - window)
            k = kv[lo:pos + 1, 0].repeat_interleave(2, dim=1)  # [keys, heads, dim]
            v = kv[lo:pos + 1, 1].repeat_interleave(2, dim=1)
            scores = torch.einsum("hd,khd->hk", q[start + i], k) * dim ** -0.5
            probs = torch.softmax(torch.cat([scores, sinks[:, None]], dim=1), dim=1)[:, :-1]
            want.append(torch.einsum("hk,khd->hd", probs, v))
    want = torch.stack(want).reshape(len(want), heads * dim)
    paths = [False, True] if cpu_kernels_available() else [False]
    for native in paths:
        meta = AttentionMetadata.build(tables, lens, queries, block, torch.device("cpu"),
                                       native=native).with_window(window)
        got = paged_attention(q, step_kv, cache.clone(), meta, None, sinks)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_gpt_oss_config_errors_name_the_field() -> None:
    base = {"architectures": ["GptOssForCausalLM"], "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_local_experts": 4, "num_experts_per_tok": 2}
    cfg = ModelConfig.from_dict(base)
    assert cfg.layer_windows == (128, None) and cfg.swiglu_limit == 7.0
    assert cfg.attention_sinks and cfg.attention_bias and cfg.expert_bias
    for bad, field in (({"num_experts_per_tok": 5}, "num_experts_per_tok"),
                       ({"swiglu_limit": -1}, "swiglu_limit"),
                       ({"layer_types": ["full_attention"]}, "layer_types"),
                       ({"sliding_window": 0}, "sliding_window"),
                       ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope type")):
        with pytest.raises(ModelLoadError, match=field):
            ModelConfig.from_dict({**base, **bad})


def test_mxfp4_blocks_decode_as_transformers_dequantizes_them() -> None:
    """The checkpoints' MXFP4 (codes of weights 2i, 2i + 1 in byte i, an E8M0 byte a block)
    as GGUF blocks decode to transformers' ``convert_moe_packed_tensors`` floats, bit for
    bit: every code in every nibble, every exponent byte."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from freetoken_core.models.gguf_weights import GGUFWeight
    from freetoken_core.models.mxfp4 import gguf_blocks

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (256, 3, 16), dtype=torch.uint8, generator=gen)
    blocks[:, 0] = torch.arange(256, dtype=torch.uint8)[:, None]  # each byte in each place
    scales = torch.randperm(256, generator=gen).to(torch.uint8)[:, None].repeat(1, 3)
    want = convert_moe_packed_tensors(blocks[None], scales[None], dtype=torch.float32)[0].T
    got = GGUFWeight("w", MXFP4, (256, 96), gguf_blocks(blocks, scales)).dequantize()
    assert torch.equal(got, want) and want.isfinite().sum() > 256 * 90


def test_mxfp4_experts_are_split_per_expert_and_dequantized_off_the_native_path() -> None:
    """Without the native kernels (another dtype or device) each expert's weights are
    transformers' dequantized ones, the gate and up rows de-interleaved, in that dtype."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from freetoken_core.models.mxfp4 import split_experts

    gen = torch.Generator().manual_seed(1)
    experts = "model.layers.0.mlp.experts."
    shapes = {"gate_up_proj": (3, 8, 2), "down_proj": (3, 4, 1)}  # (experts, out, groups)
    weights: dict[str, Any] = {}
    for name, (e, n, g) in shapes.items():
        weights[experts + name + "_blocks"] = torch.randint(0, 256, (e, n, g, 16),
                                                            dtype=torch.uint8, generator=gen)
        weights[experts + name + "_scales"] = torch.randint(120, 130, (e, n, g),
                                                            dtype=torch.uint8, generator=gen)
        weights[experts + name + "_bias"] = torch.randn(e, n, generator=gen)
    want = {name: convert_moe_packed_tensors(weights[experts + name + "_blocks"],
                                             weights[experts + name + "_scales"],
                                             dtype=torch.float32) for name in shapes}
    bias = weights[experts + "gate_up_proj_bias"]
    split_experts(weights, 1, 3, False, torch.bfloat16, torch.device("cpu"))
    for e in range(3):
        got = {w: weights.pop(f"{experts}{e}.{w}_proj.weight") for w in ("gate", "up", "down")}
        assert all(t.dtype == torch.bfloat16 for t in got.values())
        assert torch.equal(got["gate"], want["gate_up_proj"][e][:, 0::2].T.bfloat16())
        assert torch.equal(got["up"], want["gate_up_proj"][e][:, 1::2].T.bfloat16())
        assert torch.equal(got["down"], want["down_proj"][e].T.bfloat16())
        assert torch.equal(weights.pop(f"{experts}{e}.up_proj.bias"),
                           bias[e][1::2].bfloat16())
        for w in ("gate", "down"):
            weights.pop(f"{experts}{e}.{w}_proj.bias")
    assert not weights


def mxfp4_directory(path: Path, seed: int) -> tuple[Path, GptOssForCausalLM]:
    """A tiny gpt-oss directory as OpenAI released gpt-oss (config.json's quantization_config
    ``mxfp4``; each layer's experts as ``*_blocks`` / ``*_scales``, random codes with
    exponents of 2^-5..2^-3), and transformers' model with those experts dequantized by its
    own ``convert_moe_packed_tensors``."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    save_tiny_model(path, GptOssConfig, GptOssForCausalLM, **{**GPT_OSS,
                                                              "intermediate_size": 64})
    hf = GptOssForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tensors = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    for layer, block in enumerate(hf.model.layers):
        experts = block.mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(experts, name)  # [experts, in, out]
            e, k, n = param.shape
            codes = torch.randint(0, 256, (e, n, k // 32, 16), dtype=torch.uint8, generator=gen)
            scales = torch.randint(122, 125, (e, n, k // 32), dtype=torch.uint8, generator=gen)
            with torch.no_grad():
                param.copy_(convert_moe_packed_tensors(codes, scales, dtype=torch.float32))
            key = f"model.layers.{layer}.mlp.experts.{name}"
            del tensors[key]
            tensors[key + "_blocks"], tensors[key + "_scales"] = codes, scales
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    return path, hf


def test_gpt_oss_mxfp4_directory_matches_transformers(tmp_path: Path) -> None:
    """The released checkpoints' MXFP4 experts are served from their blocks (the GGUF MXFP4
    kernels, no float copy), exact against transformers' dequantized experts."""
    path, hf = mxfp4_directory(tmp_path / "gpt-oss-mxfp4", seed=7)
    llm, prompts, got = served(path, PROMPTS, 16)
    model = llm.engine.core.runner.model
    assert model.config.mxfp4_experts
    for layer in model.layers:
        for linear in (w for expert in layer.moe.experts for w in expert[:2]):
            assert linear.blocks is not None and linear.blocks[0] & 0xFF == MXFP4
    assert got == greedy(hf, prompts, 16)
    assert_logits_match(llm, prompts[-1], hf)


def test_other_quantized_directories_are_refused_naming_the_method() -> None:
    base = {"architectures": ["GptOssForCausalLM"], "vocab_size": 64, "hidden_size": 64,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    assert ModelConfig.from_dict({**base, "quantization_config": {
        "quant_method": "mxfp4"}}).mxfp4_experts
    assert not ModelConfig.from_dict(base).mxfp4_experts
    for arch, method in (("GptOssForCausalLM", "gptq"), ("LlamaForCausalLM", "mxfp4"),
                         ("LlamaForCausalLM", "awq"), ("LlamaForCausalLM", "fp8")):
        with pytest.raises(ModelLoadError, match=f"quant_method '{method}' is not supported"):
            ModelConfig.from_dict({**base, "architectures": [arch],
                                   "quantization_config": {"quant_method": method}})


def test_the_experts_in_one_native_call_compute_what_the_python_loop_computes(
        tmp_path: Path) -> None:
    """``moe_experts`` with gpt-oss's expert biases and clamped SwiGLU: every logit to the
    bit of ``SparseMoE.loop``'s, in the exact and the q8 arithmetic."""
    path = write_gguf(tmp_path / "gpt-oss.gguf", "gpt-oss", hidden=64, layers=2, heads=4,
                      kv_heads=2, head_dim=16, ff=48, expert_ff=32, experts=4,
                      experts_used=2, weight_type=Q8_0, tied=False, seed=6, sliding_window=8,
                      metadata=GGUF_YARN)
    # (the biases passed, and the SwiGLU's limit)
    assert_native_experts_equal_loop(path, lambda args: args[4] and args[7] == 7.0)


def test_a_gguf_files_fused_gate_up_experts_are_split() -> None:
    """``ffn_gate_up_exps`` (llama.cpp's converter can write gpt-oss's gate and up in one
    tensor, gate rows first, and its bias likewise): each expert's first half of rows is
    its gate, the second its up, the blocks still the file's."""
    import numpy as np

    from freetoken_core.models.gguf_weights import GGUFWeight
    from freetoken_core.models.moe import _expert_weights

    rows = np.arange(8 * 34, dtype=np.uint8).reshape(8, 34)  # 8 features of one Q8_0 block
    down = GGUFWeight("ffn_down_exps.weight[0]", Q8_0, (32, 32), np.zeros((32, 34), np.uint8))
    p = "model.layers.0.mlp."
    weights = {p + "gate.weight": torch.zeros(1, 32), p + "gate.bias": torch.zeros(1),
               p + "experts.0.gate_up_proj.weight": GGUFWeight(
                   "ffn_gate_up_exps.weight[0]", Q8_0, (8, 32), rows),
               p + "experts.0.gate_up_proj.bias": torch.arange(8.0),
               p + "experts.0.down_proj.weight": down, p + "experts.0.down_proj.bias":
                   torch.ones(32)}
    _, bias, [(gate, up, got_down, gate_b, up_b, down_b)] = _expert_weights(
        weights, "model.layers.0.", 1)
    assert not weights and bias is not None and got_down is down
    assert np.array_equal(gate.rows, rows[:4]) and np.array_equal(up.rows, rows[4:])
    assert gate_b.tolist() == [0, 1, 2, 3] and up_b.tolist() == [4, 5, 6, 7]
    assert torch.equal(down_b, torch.ones(32))
