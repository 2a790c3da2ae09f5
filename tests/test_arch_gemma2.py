"""Gemma 2 (``Gemma2ForCausalLM`` directories, ``gemma2`` GGUF files) against transformers,
and attention logit softcapping on both attention paths.

A tiny random Gemma 2 with sliding-window layers (every other one, the first included;
window 6, shorter than the long prompt) beside global ones, head_dim unlike hidden / heads,
a query scale unlike head_dim's and tied embeddings. Its q/k projections are scaled so that
the attention scores reach several times the attention softcap (set low here, as are the
logits' cap), so the softcaps are in their non-linear range: leaving either out, or the
windows, moves the logits. FreeToken's logits of every position (the prompt fed in chunks
over the paged cache: prefill, chunked prefill and decode steps) match transformers'
float32 logits on both attention paths, and greedy tokens of a batch of prompts equal
transformers' ``generate``; the same for a GGUF file written as llama.cpp's converter
writes Gemma 2 (norms stored as 1 + w, the softcaps and window as keys), against
transformers' GGUF loader."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf_models import F16, F32, Q8_0, write_gguf
from gguf_reference import hf_from_gguf
from gguf_writing import finish
from test_arch_gemma3 import (
    PATHS,
    PROMPTS,
    build_native,
    chunked_logits,
    engine_path,
    hf_greedy,
)
from test_gguf_rope_factors import LONG, greedy, served
from tiny_models import build_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma2Config, GenerationConfig
from transformers import Gemma2ForCausalLM as HFGemma2

from freetoken_core import LLM, SamplingParams
from freetoken_core.errors import ModelLoadError
from freetoken_core.kernels import cpu_kernels_available
from freetoken_core.models.attention import AttentionMetadata, paged_attention
from freetoken_core.models.config import ModelConfig
from freetoken_core.models.gemma2 import Gemma2ForCausalLM
from freetoken_core.models.registry import model_class

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW = 6
ATTN_CAP, FINAL_CAP = 3.0, 8.0


def make_gemma2(out_dir: Path, seed: int = 0, **overrides: Any) -> Path:
    """A tiny Gemma 2 directory (weights, config, tokenizer): embeddings small beside the
    residual branches (post-norm multipliers ~3), so the tied head does not just echo the
    last token; q and k large, so that scores exceed ``ATTN_CAP``."""
    tok = build_tokenizer(out_dir)
    kwargs: dict[str, Any] = {
        "vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": WINDOW,
        "attn_logit_softcapping": ATTN_CAP, "final_logit_softcapping": FINAL_CAP,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 2, **overrides,
    }
    config = Gemma2Config(**kwargs)
    config.architectures = ["Gemma2ForCausalLM"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = HFGemma2(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    norm_centres = {"post_attention_layernorm": 2.0, "post_feedforward_layernorm": 2.0,
                    "model.norm": 3.0}
    with torch.no_grad():
        for name, param in model.named_parameters():
            kind = name.rsplit(".", 2)[-2] if name != "model.norm.weight" else "model.norm"
            if name.endswith("embed_tokens.weight"):
                param.normal_(0.0, 0.125, generator=gen)
                param[:7] *= 0.5  # special tokens: rarely greedy picks
            elif "norm" in name:
                centre = norm_centres.get(kind, 0.0)
                param.uniform_(centre - 0.1, centre + 0.1, generator=gen)
            else:
                gain = 3.0 if kind in ("q_proj", "k_proj") else 2.0
                param.normal_(0.0, gain / math.sqrt(param.shape[1]), generator=gen)
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=2, pad_token_id=2)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gemma2(tmp_path_factory.mktemp("gemma2"))


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def assert_caps_and_windows_matter(model: Any, ids: list[int], want: torch.Tensor) -> None:
    """Without the attention softcap, the logits' softcap or the sliding windows, the
    logits of ``ids`` move away from ``want`` by a tenth of their largest (each is in use,
    not a no-op here)."""
    layers, cfg, windows = model.layers, model.config, model.windows
    softcaps = [layer.softcap for layer in layers]
    assert all(s == ATTN_CAP for s in softcaps)
    apart = 0.1 * want.abs().max()
    try:
        for layer in layers:
            layer.softcap = 0.0
        assert (chunked_logits(model, ids, [len(ids)]) - want).abs().max() > apart
        for layer, softcap in zip(layers, softcaps):
            layer.softcap = softcap
        model.windows = [None] * len(windows)
        assert (chunked_logits(model, ids, [len(ids)]) - want).abs().max() > apart
        model.windows = windows
        model.config = dataclasses.replace(cfg, final_logit_softcap=None)
        assert (chunked_logits(model, ids, [len(ids)]) - want).abs().max() > apart
    finally:
        for layer, softcap in zip(layers, softcaps):
            layer.softcap = softcap
        model.windows, model.config = windows, cfg


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


def test_config_reads_gemma2(model_dir: Path) -> None:
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.architecture == "gemma2"
    assert model_class(cfg) is Gemma2ForCausalLM
    assert cfg.head_dim == 32 and not cfg.qk_norm and cfg.tie_word_embeddings
    assert cfg.hidden_act == "gelu_pytorch_tanh"
    assert cfg.layer_windows == (WINDOW, None, WINDOW, None)
    assert cfg.rope_theta == 10000.0 and cfg.rope_local_theta is None
    assert cfg.rope_scaling is None
    assert cfg.query_scale == 24 ** -0.5
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == (ATTN_CAP, FINAL_CAP)
    assert cfg.sliding_window is None  # the engine caps the context only for Mistral's


def test_config_takes_transformers_defaults(model_dir: Path) -> None:
    """Hub checkpoints (transformers 4.4x) have no layer_types; a key left out takes
    Gemma2Config's default: softcaps 50 and 30, query scalar 256, window 4096 on the even
    layers; a null softcap is none."""
    data = json.loads((model_dir / "config.json").read_text())
    for key in ("layer_types", "attn_logit_softcapping", "final_logit_softcapping",
                "query_pre_attn_scalar", "sliding_window", "rope_parameters"):
        data.pop(key, None)
    data.update(num_hidden_layers=5, rope_theta=20000.0)
    cfg = ModelConfig.from_dict(data)
    assert cfg.layer_windows == (4096, None, 4096, None, 4096)
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == (50.0, 30.0)
    assert cfg.query_scale == 256 ** -0.5 and cfg.rope_theta == 20000.0
    hub = Gemma2Config(**{k: v for k, v in data.items() if k != "architectures"})
    assert hub.layer_types[:2] == ["sliding_attention", "full_attention"]
    cfg = ModelConfig.from_dict({**data, "attn_logit_softcapping": None,
                                 "final_logit_softcapping": None})
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == (None, None)


@pytest.mark.parametrize(("change", "message"), [
    ({"attn_logit_softcapping": -1.0}, "attn_logit_softcapping must be a positive number"),
    ({"attn_logit_softcapping": "50"}, "attn_logit_softcapping must be a positive number"),
    ({"final_logit_softcapping": 0}, "final_logit_softcapping must be a positive number"),
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be a positive number"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "gelu"}, "hidden activation 'gelu' is not supported"),
    ({"sliding_window": None}, "needs sliding_window >= 1"),
    ({"layer_types": ["full_attention"]}, "layer_types .* expected 4 of"),
])
def test_config_errors_name_the_key(model_dir: Path, change: dict, message: str) -> None:
    data = json.loads((model_dir / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=f"Gemma2ForCausalLM.*{message}"):
        ModelConfig.from_dict({**data, **change})


# ---------------------------------------------------------------------------------------------
# The model against transformers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("native", [True, False])
def test_logits_match_transformers(model_dir: Path, hf_model: Any, native: bool,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    if native and not cpu_kernels_available():
        pytest.skip("the native kernels could not be built")
    model = build_native(model_dir, native, monkeypatch)
    ids = AutoTokenizer.from_pretrained(model_dir).encode(LONG, add_special_tokens=False)
    assert len(ids) > 3 * WINDOW
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0]
    assert ref.abs().max() > 4  # logits the final cap (8) bends
    for chunks in ([len(ids)], [5, 9, len(ids) - 14], [7] + [1] * (len(ids) - 7)):
        got = chunked_logits(model, ids, chunks)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4, msg=str(chunks))
    assert_caps_and_windows_matter(model, ids, ref)


@pytest.mark.parametrize("path", PATHS)
def test_batched_greedy_matches_transformers(model_dir: Path, hf_model: Any, path: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    native, device = engine_path(path, monkeypatch)
    llm = LLM(str(model_dir), kv_cache_tokens=4096, dtype="float32", progress=False,
              device=device, plugins="none")
    assert isinstance(llm.engine.core.runner.model, Gemma2ForCausalLM)
    assert llm.engine.core.runner.model.native is native
    prompts = [llm.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    assert max(len(p) for p in prompts) > WINDOW
    # All prompts in one batch: prefills side by side, then decode steps of five sequences.
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32,
                                                ignore_eos=True))
    expected = hf_greedy(hf_model, prompts, 32)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(len(set(ref)) > 8 for ref in expected)  # not a degenerate model


# ---------------------------------------------------------------------------------------------
# GGUF
# ---------------------------------------------------------------------------------------------


def test_gguf_matches_transformers(tmp_path: Path) -> None:
    """A ``gemma2`` file (Q8_0 and F16 weights, F32 norms stored as 1 + w) with its softcaps
    and window as keys: greedy tokens and every position's logits equal transformers' GGUF
    model's (whose loader reads the window but not the softcaps or the query scalar: they
    are given to it as llama.cpp derives them, the scalar from ``attention.key_length``).
    The file's logits are small (its embeddings, tied, are scaled down by sqrt(hidden)):
    its logits' cap is 0.5."""
    final_cap = 0.5
    metadata = {"attn_logit_softcapping": ATTN_CAP, "final_logit_softcapping": final_cap}
    path = write_gguf(tmp_path / "gemma2.gguf", "gemma2", hidden=64, layers=4, heads=4,
                      kv_heads=2, head_dim=32, ff=128, weight_type=Q8_0, seed=7,
                      sliding_window=WINDOW, metadata=metadata,
                      types={"token_embd.weight": F16, "attn_q.weight": F32,
                             "attn_k.weight": F32})
    hf = hf_from_gguf(path, query_pre_attn_scalar=32, attn_logit_softcapping=ATTN_CAP,
                      final_logit_softcapping=final_cap)
    assert hf.config.sliding_window == WINDOW
    llm, prompts, got = served(path, PROMPTS[:4] + [LONG], 16)
    model = llm.engine.core.runner.model
    assert isinstance(model, Gemma2ForCausalLM) and model.uses_gguf_blocks
    cfg = model.config
    assert cfg.layer_windows == (WINDOW, None, WINDOW, None) and cfg.query_scale == 32 ** -0.5
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == (ATTN_CAP, final_cap)
    assert got == greedy(hf, prompts, 16)
    ids = prompts[-1]
    assert len(ids) > 3 * WINDOW
    half = len(ids) // 2
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(chunked_logits(model, ids, [half, len(ids) - half]), want,
                               atol=2e-4, rtol=1e-4)
    assert_caps_and_windows_matter(model, ids, want)


def test_gguf_keys_as_llama_cpp_reads_them(tmp_path: Path) -> None:
    """Without the softcap and window keys, llama.cpp's defaults (50, 30, 4096); the
    46-layer 27B's query scalar is hidden / heads, the others' the head size."""
    from gguf import GGUFReader, GGUFWriter

    from freetoken_core.models.gguf_metadata import build_config

    path = write_gguf(tmp_path / "bare.gguf", "gemma2", hidden=64, layers=2, heads=4,
                      kv_heads=2, head_dim=32, ff=128, weight_type=Q8_0)
    config = build_config(GGUFReader(path))
    assert config["query_pre_attn_scalar"] == 32 and config["sliding_window"] == 8
    assert (config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (50.0, 30.0)
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    # The keys alone of a 27B-shaped file (46 layers, hidden 4608, 32 heads of 128).
    bare = tmp_path / "keys.gguf"
    writer = GGUFWriter(str(bare), "gemma2")
    for key, value in (("embedding_length", 4608), ("block_count", 46),
                       ("feed_forward_length", 64), ("attention.head_count", 32),
                       ("attention.key_length", 128), ("context_length", 8192)):
        writer.add_uint32(f"gemma2.{key}", value)
    finish(writer)
    config = build_config(GGUFReader(bare))
    assert config["query_pre_attn_scalar"] == 144 and config["sliding_window"] == 4096
    assert (config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (50.0, 30.0)
    assert config["layer_types"][:3] == ["sliding_attention", "full_attention",
                                         "sliding_attention"]


# ---------------------------------------------------------------------------------------------
# Attention softcapping (attention.py's torch path, the native kernel's softcap argument)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [None, 5])
def test_softcapped_attention_native_and_torch_paths(window: int | None) -> None:
    """Both paths of ``paged_attention`` with a softcap (decoding tokens, a prefill chunk,
    contexts over several of the kernel's 64-key chunks, lengths that are not multiples of
    its 8 lanes) against the softmax of each query's softcapped scores, computed directly;
    the scores reach several times the cap, and without it the result differs."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, block, cap, scale = 4, 2, 32, 4, 2.0, 0.3
    lens, queries = [9, 13, 150], [1, 6, 70]
    tables, used = [], 0
    for n in lens:  # each sequence's blocks in reverse order
        count = -(-n // block)
        tables.append(list(range(used, used + count))[::-1])
        used += count
    cache = torch.zeros(used * block, 2, kv_heads, dim)
    keys = [torch.randn(n, 2, kv_heads, dim, generator=gen) for n in lens]
    for table, kv in zip(tables, keys):  # the cached part of each context
        for pos in range(len(kv)):
            cache[table[pos // block] * block + pos % block] = kv[pos]
    q = torch.randn(sum(queries), heads, dim, generator=gen) * 3
    step_kv = torch.cat([kv[n - m:] for kv, n, m in zip(keys, lens, queries)])

    want, start, top = [], 0, 0.0
    for kv, n, m in zip(keys, lens, queries):
        for i in range(m):
            pos = n - m + i
            lo = 0 if window is None else max(0, pos + 1 - window)
            k = kv[lo:pos + 1, 0].repeat_interleave(2, dim=1)  # [keys, heads, dim]
            v = kv[lo:pos + 1, 1].repeat_interleave(2, dim=1)
            scores = torch.einsum("hd,khd->hk", q[start + i], k) * scale
            top = max(top, scores.abs().max().item())
            probs = torch.softmax(cap * torch.tanh(scores / cap), dim=1)
            want.append(torch.einsum("hk,khd->hd", probs, v))
        start += m
    assert top > 3 * cap
    want = torch.stack(want).reshape(len(want), heads * dim)
    paths = [False, True] if cpu_kernels_available() else [False]
    for native in paths:
        meta = AttentionMetadata.build(tables, lens, queries, block, torch.device("cpu"),
                                       native=native).with_window(window)
        got = paged_attention(q, step_kv, cache.clone(), meta, scale, softcap=cap)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"native={native}")
        plain = paged_attention(q, step_kv, cache.clone(), meta, scale)
        assert (plain - want).abs().max() > 0.1


def test_softcapped_native_attention_of_a_token_does_not_depend_on_its_step() -> None:
    """Batch invariance holds with a softcap: a prompt's tokens get bit-identical attention
    as one chunk, or in chunks of 7 or 1 (each query's scores capped by the same lanes)."""
    if not cpu_kernels_available():
        pytest.skip("the native kernels could not be built")
    gen = torch.Generator().manual_seed(4)
    block_size, length = 16, 75
    table = [4, 0, 3, 1, 2]
    cache = torch.randn(5 * block_size, 2, 2, 32, generator=gen)
    q = torch.randn(length, 4, 32, generator=gen) * 3
    kv = torch.randn(length, 2, 2, 32, generator=gen)

    def attend(start: int, end: int) -> torch.Tensor:
        meta = AttentionMetadata.build([table], [end], [end - start], block_size,
                                       torch.device("cpu"), native=True)
        return paged_attention(q[start:end], kv[start:end], cache, meta, 0.3, softcap=2.0)

    whole = attend(0, length)
    for size in (7, 1):
        parts = [attend(i, min(i + size, length)) for i in range(0, length, size)]
        assert torch.equal(torch.cat(parts), whole), size
