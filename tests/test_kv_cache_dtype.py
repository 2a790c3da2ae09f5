"""``kv_cache_dtype`` (``--kv-cache-dtype``): a float16 or bfloat16 KV cache under a float32
model. Each key and value is rounded once, when it is written; every path attends to the
stored values in float32 (the native kernel reads them widened, the torch path gathers and
widens them, and a prefill chunk's own keys and values are the rounded ones too), so the
paths agree with each other, a token's attention does not depend on how its prompt was cut
into steps, and the engine stays batch-invariant. It is not exact against a float32 cache:
close, and tested as close."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from test_native_kernels import DISABLED, paged_case

from freetoken_core import LLM, SamplingParams
from freetoken_core.cli import _engine_options, build_parser
from freetoken_core.config import EngineConfig
from freetoken_core.errors import InvalidRequest
from freetoken_core.models import llama
from freetoken_core.models.attention import AttentionMetadata, paged_attention

HALF_TYPES = [torch.float16, torch.bfloat16]
CPU = torch.device("cpu")
needs_native = pytest.mark.skipif(DISABLED, reason="FREETOKEN_NATIVE_KERNELS=0")


def test_the_option_defaults_to_the_models_dtype_and_refuses_other_names() -> None:
    assert EngineConfig().kv_torch_dtype(CPU) == torch.float32
    assert EngineConfig(dtype="bfloat16").kv_torch_dtype(CPU) == torch.bfloat16
    assert EngineConfig(kv_cache_dtype="float16").kv_torch_dtype(CPU) == torch.float16
    with pytest.raises(InvalidRequest, match="kv_cache_dtype: must be auto or one of"):
        EngineConfig(kv_cache_dtype="int8")
    parser = build_parser()
    assert _engine_options(parser.parse_args(["serve"]))["kv_cache_dtype"] == "auto"
    options = _engine_options(parser.parse_args(["serve", "--kv-cache-dtype", "bfloat16"]))
    assert EngineConfig(**options).kv_torch_dtype(CPU) == torch.bfloat16
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--kv-cache-dtype", "fp8"])


@needs_native
@pytest.mark.parametrize("kv_dtype", HALF_TYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), [
    (9, 3, 64, 16), (8, 2, 128, 16), (6, 3, 40, 5)])
def test_native_decode_over_a_16_bit_cache_matches_the_torch_path(
        kv_dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
        block_size: int) -> None:
    """Float32 queries against a float16 / bfloat16 cache: the kernel (keys and values
    widened as it reads them) gives the torch path's output (the cache gathered and widened)."""
    rng = random.Random(head_dim)
    lens = [1, block_size, block_size + 1, 37, 300, 2]
    cache, _, tables = paged_case(rng, lens, num_heads, num_kv_heads, head_dim, block_size,
                                  kv_dtype)
    q = torch.randn(len(lens), num_heads, head_dim)
    kv = torch.stack([cache[t[(n - 1) // block_size] * block_size + (n - 1) % block_size]
                      for t, n in zip(tables, lens)]).float()
    outs = []
    for native in (True, False):
        meta = AttentionMetadata.build(tables, lens, [1] * len(lens), block_size, CPU,
                                       native=native)
        outs.append(paged_attention(q, kv, cache.clone(), meta))
    assert outs[0].dtype == torch.float32
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("native", [True, False] if not DISABLED else [False])
@pytest.mark.parametrize("kv_dtype", HALF_TYPES)
def test_a_prefill_chunk_attends_to_its_keys_as_the_cache_stores_them(
        native: bool, kv_dtype: torch.dtype) -> None:
    """A prompt's one chunk (whose keys and values the torch path takes from the step rather
    than from the cache) attends to them rounded to the cache's dtype: the same output as a
    float32 cache given keys and values rounded beforehand, and the cache holds them rounded."""
    block_size, length = 8, 29
    tables = [[7, 2, 5, 0]]
    q = torch.randn(length, 9, 64)
    kv = torch.randn(length, 2, 3, 64) * 3
    meta = AttentionMetadata.build(tables, [length], [length], block_size, CPU, native=native)
    cache = torch.zeros(8 * block_size, 2, 3, 64, dtype=kv_dtype)
    got = paged_attention(q, kv, cache, meta)
    rounded = kv.to(kv_dtype).float()
    want = paged_attention(q, rounded, torch.zeros(8 * block_size, 2, 3, 64), meta)
    assert torch.equal(got, want)
    slots = [tables[0][t // block_size] * block_size + t % block_size for t in range(length)]
    assert torch.equal(cache[slots], kv.to(kv_dtype))


@needs_native
@pytest.mark.parametrize("kv_dtype", HALF_TYPES)
def test_native_attention_over_a_16_bit_cache_does_not_depend_on_the_step(
        kv_dtype: torch.dtype) -> None:
    """Batch invariance with a 16-bit cache: each token of a 50-token prompt gets
    bit-identical attention as one chunk, in chunks of 7, or one token a step."""
    rng = random.Random(3)
    block_size, length = 16, 50
    cache, _, tables = paged_case(rng, [length], 9, 3, 64, block_size, kv_dtype)
    q = torch.randn(length, 9, 64)
    kv = torch.randn(length, 2, 3, 64)

    def attend(start: int, end: int) -> torch.Tensor:
        meta = AttentionMetadata.build(tables, [end], [end - start], block_size, CPU,
                                       native=True)
        return paged_attention(q[start:end], kv[start:end], cache, meta)

    whole = attend(0, length)
    for size in (7, 1):
        parts = [attend(i, min(i + size, length)) for i in range(0, length, size)]
        assert torch.equal(torch.cat(parts), whole), size


@needs_native
def test_the_engine_with_a_float16_cache(tiny_model_dir: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A float16 cache: half the bytes; the fused native layers (which write the cache
    themselves) and the torch path give the same greedy tokens; a sequence decodes the same
    alone and among others; prompt logprobs stay within a few thousandths (on average) of a float32
    cache's."""
    rng = random.Random(5)
    prompts = [[rng.randrange(7, 600) for _ in range(n)] for n in (3, 40, 150, 17)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=0)

    def run(**options: object) -> tuple[LLM, list]:
        llm = LLM(str(tiny_model_dir), kv_cache_tokens=4096, progress=False, plugins="none",
                  **options)
        return llm, llm.generate(prompts, params)

    llm32, full = run()
    llm16, half = run(kv_cache_dtype="float16")
    caches = llm32.engine.core.runner.kv_caches, llm16.engine.core.runner.kv_caches
    assert caches[1].dtype == torch.float16 and caches[1].shape == caches[0].shape
    assert caches[1].nbytes * 2 == caches[0].nbytes
    assert llm16.engine.core.runner.model.native
    alone = [llm16.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert alone == [o.outputs[0].token_ids for o in half]
    diffs = [abs(next(iter(a.values())).logprob - next(iter(b.values())).logprob)
             for x, y in zip(full, half)
             for a, b in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:])]
    assert max(diffs) < 3e-2 and sum(diffs) / len(diffs) < 5e-3, (max(diffs), sum(diffs))
    assert any(d > 0 for d in diffs)  # rounded: not the float32 cache's numbers
    monkeypatch.setattr(llama, "cpu_kernels_available", lambda: False)
    _, plain = run(kv_cache_dtype="float16")
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in half]
