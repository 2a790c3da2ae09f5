"""The native CPU kernels (decode attention, fused element-wise layers) against the torch
paths they replace."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType

from freetoken_core import LLM, SamplingParams
from freetoken_core.engine.sampler import counter_uniform
from freetoken_core.kernels import cpu_kernels_available
from freetoken_core.models import llama
from freetoken_core.models.attention import AttentionMetadata, paged_attention
from freetoken_core.models.block_layout import (
    GGUF_BLOCK_TYPES,
    KERNEL_GROUP,
    interleave_blocks,
    kernel_blocks,
    narrow_scales,
)
from freetoken_core.models.layers import add_rms_norm, apply_rope, rms_norm, silu_and_mul

DISABLED = os.environ.get("FREETOKEN_NATIVE_KERNELS", "1").lower() in ("0", "false", "no", "off")
pytestmark = pytest.mark.skipif(DISABLED, reason="FREETOKEN_NATIVE_KERNELS=0")


def test_kernels_build_here() -> None:
    # A machine with a C++ compiler (every machine this project runs on) must get them;
    # a silent fallback would hide a broken build.
    assert cpu_kernels_available()


def test_switching_off_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FREETOKEN_NATIVE_KERNELS", "0")
    assert cpu_kernels_available.__wrapped__() is False


def paged_case(rng: random.Random, lens: list[int], num_heads: int, num_kv_heads: int,
               head_dim: int, block_size: int, dtype: torch.dtype):
    """Random keys/values in shuffled blocks, decode queries, and the block tables."""
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    cache = torch.randn(num_blocks * block_size, 2, num_kv_heads, head_dim).to(dtype)
    q = torch.randn(len(lens), num_heads, head_dim).to(dtype)
    return cache, q, tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), [
    (9, 3, 64, 16),     # the default model's shape
    (4, 4, 32, 4),      # no grouping, tiny blocks
    (8, 2, 128, 16),    # Llama-3-style groups of 4
    (6, 3, 40, 5),      # a head_dim that is not a multiple of the vector width
])
def test_decode_matches_the_torch_path(dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                                       head_dim: int, block_size: int) -> None:
    rng = random.Random(head_dim)
    lens = [1, block_size, block_size + 1, 37, 300, 2]
    cache, q, tables = paged_case(rng, lens, num_heads, num_kv_heads, head_dim, block_size,
                                  dtype)
    # The step's own keys/values: write the last position of each sequence again.
    kv = torch.stack([cache[t[(n - 1) // block_size] * block_size + (n - 1) % block_size]
                      for t, n in zip(tables, lens)])
    outs = []
    for native in (True, False):
        meta = AttentionMetadata.build(tables, lens, [1] * len(lens), block_size,
                                       torch.device("cpu"), native=native)
        assert (meta.decode_block_tables is not None) is native
        outs.append(paged_attention(q, kv, cache.clone(), meta).float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[0], outs[1], atol=tol, rtol=tol)


@pytest.mark.parametrize("peak", [3, 100, 190])  # the dominant key: first, a middle, last chunk
@pytest.mark.parametrize("window", [0, 70])  # 70: the first key (130) inside a chunk
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_decode_softmax_runs_over_the_chunks_of_keys(peak: int, window: int,
                                                     cache_dtype: torch.dtype) -> None:
    """The kernel takes a context 64 keys at a time with a running maximum and sum: a
    context of 200 whose largest score lies in its first, a middle or its last chunk (the
    sums so far rescaled when a later chunk raises the maximum), with and without a window,
    against a float64 softmax."""
    torch.manual_seed(peak + window)
    heads, kv_heads, head_dim, block_size, length = 4, 2, 64, 16, 200
    blocks = -(-length // block_size)
    tables = torch.randperm(blocks + 2)[:blocks].to(torch.int32).view(1, blocks)
    cache = (0.3 * torch.randn((blocks + 2) * block_size, 2, kv_heads, head_dim)).to(cache_dtype)
    q = torch.randn(1, heads, head_dim)
    slots = [int(tables[0, t // block_size]) * block_size + t % block_size for t in range(length)]
    for h in range(kv_heads):  # key `peak` along the group's first query: a score far above
        cache[slots[peak], 0, h] = (q[0, h * 2] * 2).to(cache_dtype)
    out = torch.empty_like(q)
    scale = head_dim ** -0.5
    torch.ops.freetoken.paged_decode_attention(q, cache, tables, torch.tensor([length],
                                               dtype=torch.int32), block_size, scale, out,
                                               window)
    first = max(0, length - window) if window else 0
    keys = cache[slots, 0].double()[first:]  # [T, KVH, hd]
    values = cache[slots, 1].double()[first:]
    want = torch.empty(heads, head_dim, dtype=torch.float64)
    for head in range(heads):
        kv = head // (heads // kv_heads)
        p = torch.softmax(keys[:, kv] @ q[0, head].double() * scale, dim=0)
        want[head] = p @ values[:, kv]
    if first <= peak:
        assert torch.softmax(keys[:, 0] @ q[0, 0].double() * scale, 0).max() > 0.5  # peaked
    torch.testing.assert_close(out[0].double(), want, atol=1e-5, rtol=1e-5)


def test_decode_and_prefill_in_one_step() -> None:
    """Decodes and a prefill chunk in one step: natively every token is one query of the
    kernel; the torch path gathers the chunk's context for SDPA. Same output."""
    rng = random.Random(1)
    block_size, lens, chunk = 16, [20, 45], 7
    cache, _, tables = paged_case(rng, lens + [30], 9, 3, 64, block_size, torch.float32)
    q = torch.randn(2 + chunk, 9, 64)
    kv = torch.randn(2 + chunk, 2, 3, 64)
    outs = []
    for native in (True, False):
        meta = AttentionMetadata.build(tables, lens + [30], [1, 1, chunk], block_size,
                                       torch.device("cpu"), native=native)
        outs.append(paged_attention(q, kv, cache.clone(), meta))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_engine_tokens_are_the_same_on_both_paths(tiny_model_dir: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(7, 600) for _ in range(n)] for n in (3, 40, 150, 17)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = LLM(str(tiny_model_dir), kv_cache_tokens=4096, progress=False)
    assert llm.engine.core.runner.model.native
    native = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    monkeypatch.setattr(llama, "cpu_kernels_available", lambda: False)
    llm = LLM(str(tiny_model_dir), kv_cache_tokens=4096, progress=False)
    assert not llm.engine.core.runner.model.native
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert native == plain


@pytest.mark.parametrize("length", [50, 150])  # 150: past the kernel's chunks of 64 keys
def test_native_attention_of_a_token_does_not_depend_on_its_step(length: int) -> None:
    """Batch invariance: each token of a prompt gets bit-identical attention whether
    the prompt is one chunk, chunks of 7, or one token a step, and whatever other sequences
    share the step."""
    rng = random.Random(3)
    block_size = 16
    cache, _, tables = paged_case(rng, [length, 33, 70], 9, 3, 64, block_size, torch.float32)
    q = torch.randn(length, 9, 64)
    kv = torch.randn(length, 2, 3, 64)
    others_q, others_kv = torch.randn(2, 9, 64), torch.randn(2, 2, 3, 64)

    def attend(start: int, end: int, with_others: bool) -> torch.Tensor:
        """Tokens start:end of the prompt as one chunk, after two decoding sequences."""
        lead_tables, lead_lens = (tables[1:], [33, 70]) if with_others else ([], [])
        meta = AttentionMetadata.build(lead_tables + tables[:1], lead_lens + [end],
                                       [1] * len(lead_lens) + [end - start], block_size,
                                       torch.device("cpu"), native=True)
        lead = len(lead_lens)
        step_q = torch.cat([others_q[:lead], q[start:end]])
        step_kv = torch.cat([others_kv[:lead], kv[start:end]])
        return paged_attention(step_q, step_kv, cache, meta)[lead:]

    whole = attend(0, length, False)
    for size, with_others in ((7, True), (1, False), (16, True)):
        parts = [attend(i, min(i + size, length), with_others)
                 for i in range(0, length, size)]
        assert torch.equal(torch.cat(parts), whole), size


DTYPE_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 16, 300])  # 300 rows: split over threads
def test_fused_layers_match_torch(dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    tol = DTYPE_TOL[dtype]
    x, w, res = randn(rows, 580), randn(580), randn(rows, 580)
    torch.testing.assert_close(rms_norm(x, w, 1e-6, native=True), rms_norm(x, w, 1e-6),
                               atol=tol, rtol=tol)
    got = add_rms_norm(x.clone(), res.clone(), w, 1e-6, native=True)
    want = add_rms_norm(x, res, w, 1e-6)
    # The sum is rounded once either way: the residual stream is bit-exact.
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], atol=tol, rtol=tol)
    gate_up = randn(rows, 2 * 100) * 4
    torch.testing.assert_close(silu_and_mul(gate_up, native=True), silu_and_mul(gate_up),
                               atol=tol, rtol=tol)
    # RoPE on a strided view (queries and keys of a fused qkv output), bit-exact.
    qkv = randn(rows, 7 * 64)
    cos, sin = randn(rows, 64), randn(rows, 64)
    want = apply_rope(qkv[:, :6 * 64].view(rows, 6, 64), cos, sin)
    got = apply_rope(qkv.clone()[:, :6 * 64].view(rows, 6, 64), cos, sin, native=True)
    assert torch.equal(got, want)


def test_bfloat16_model_is_as_accurate_natively_as_with_torch(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 rounds differently in the two attention paths (the kernel sums in float32 and
    rounds once), so their tokens may part at near-ties: hold both to float32 instead.
    The second token's log-probabilities come from a decode step."""
    rng = random.Random(9)
    prompts = [[rng.randrange(7, 600) for _ in range(n)] for n in (4, 60, 25)]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=5)

    def run(dtype: str) -> tuple[list, bool]:
        llm = LLM(str(tiny_model_dir), dtype=dtype, kv_cache_tokens=2048, progress=False)
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        return outs, llm.engine.core.runner.model.native

    native, used = run("bfloat16")
    assert used
    monkeypatch.setattr(llama, "cpu_kernels_available", lambda: False)
    plain, used = run("bfloat16")
    assert not used
    reference, _ = run("float32")
    for ref, a, b in zip(reference, native, plain):
        assert ref.token_ids[0] == a.token_ids[0] == b.token_ids[0]
        want, got_a, got_b = (dict(x.logprobs[1].top) for x in (ref, a, b))
        common = want.keys() & got_a.keys() & got_b.keys()
        assert len(common) >= 3
        err_native = max(abs(got_a[t] - want[t]) for t in common)
        err_torch = max(abs(got_b[t] - want[t]) for t in common)
        assert err_native <= 1.5 * err_torch + 0.02, (err_native, err_torch)


@pytest.mark.parametrize("qtype", [3, 8])  # Q4_1, Q8_0
@pytest.mark.parametrize("n", [1, 3, 4, 9, 70])  # whole groups and every remainder
def test_interleave_blocks_puts_each_block_where_the_kernels_read_it(qtype: int,
                                                                     n: int) -> None:
    """Block b of feature f lies at its group's start (f's group's first feature times the
    row bytes) + (b * group size + f's place in the group) * block bytes; the last group
    holds what is left."""
    size = 20 if qtype == 3 else 34
    num_blocks = 3
    rows = torch.randint(0, 256, (n, num_blocks * size), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(n))
    flat = interleave_blocks(rows, size).view(-1)
    assert flat.numel() == rows.numel()
    for f in range(n):
        g0 = f - f % KERNEL_GROUP
        group = min(KERNEL_GROUP, n - g0)
        for b in range(num_blocks):
            at = g0 * num_blocks * size + (b * group + f - g0) * size
            assert torch.equal(flat[at:at + size], rows[f, b * size:(b + 1) * size]), (f, b)


@pytest.mark.parametrize("qtype", [3, 8])  # Q4_1, Q8_0
def test_kernel_blocks_widen_q4_1_scales_to_float32_and_narrow_scales_undoes_it(
        qtype: int) -> None:
    """The exact kernel's Q4_1 block: d and m as float32 (the file's float16 values), then
    the 16 nibble bytes; Q8_0 blocks as in the file. Interleaved as interleave_blocks does
    for that block size; narrow_scales gives back the file's blocks in the same order."""
    from gguf import quants

    n, k = 9, 96
    raw = torch.from_numpy(quants.quantize(torch.randn(n, k).numpy(),
                                           GGMLQuantizationType(qtype)))
    laid_out = kernel_blocks(raw, qtype)
    wide = 24 if qtype == 3 else 34
    assert laid_out.shape == (n, k // 32 * wide)
    if qtype == 3:
        file_blocks = raw.reshape(-1, 20)
        expect = torch.cat([file_blocks[:, :4].contiguous().view(torch.float16).float()
                            .view(torch.uint8), file_blocks[:, 4:]], dim=1).reshape(n, -1)
    else:
        expect = raw
    assert torch.equal(laid_out, interleave_blocks(expect, wide))
    assert torch.equal(narrow_scales(laid_out, qtype), interleave_blocks(raw, 20 if qtype == 3
                                                                          else 34))


@pytest.mark.parametrize("qtype", [3, 8])  # Q4_1, Q8_0
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 33])  # > 8: passes of at most 8 rows
@pytest.mark.parametrize(("n", "k"), [(70, 96), (33, 640)])  # 640: chunks of 8, 8, 4 blocks
def test_gguf_linear_matches_the_dequantized_weights(qtype: int, rows: int, n: int,
                                                     k: int) -> None:
    from gguf import quants
    from gguf.constants import GGMLQuantizationType

    gen = torch.Generator().manual_seed(qtype * 100 + rows + k)
    weight = torch.randn(n, k, generator=gen).numpy()
    blocks = quants.quantize(weight, GGMLQuantizationType(qtype))
    dequantized = torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType(qtype)))
    x = torch.randn(rows, k, generator=gen)
    out = torch.empty(rows, n)
    torch.ops.freetoken.gguf_linear(x, kernel_blocks(torch.from_numpy(blocks), qtype),
                                    qtype, out)
    torch.testing.assert_close(out, x @ dequantized.T, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("qtype", [3, 8])  # Q4_1, Q8_0
def test_gguf_linear_uses_the_very_weights_gguf_py_dequantizes(qtype: int) -> None:
    """Rows of the identity pick out single weights: the products are those weights times 1
    plus zeros, so the output is the kernel's dequantized weight itself. It must equal
    gguf-py's float32 dequantization bit for bit, on both paths (a few rows in registers,
    many through panels), for random block bytes: float16 scales of every magnitude and
    sign (Q4_1's d * q + m is one fused multiply-add in the kernel)."""
    from gguf import quants

    n, k = 37, 96
    gen = torch.Generator().manual_seed(qtype)
    size = 20 if qtype == 3 else 34
    raw = torch.randint(0, 256, (n * k // 32, size), dtype=torch.uint8, generator=gen)
    scales = (torch.randn(n * k // 32, 2, generator=gen)
              * 10.0 ** torch.randint(-6, 4, (n * k // 32, 2), generator=gen)).half()
    raw[:, :4 if qtype == 3 else 2] = scales.view(torch.uint8)[:, :4 if qtype == 3 else 2]
    blocks = raw.view(n, -1).contiguous()
    want = torch.from_numpy(quants.dequantize(blocks.numpy(), GGMLQuantizationType(qtype)))
    assert torch.isfinite(want).all()
    eye = torch.eye(k)
    laid_out = kernel_blocks(blocks, qtype)
    for rows in (eye[:1], eye[:4], eye):
        out = torch.empty(rows.shape[0], n)
        torch.ops.freetoken.gguf_linear(rows.contiguous(), laid_out, qtype, out)
        assert torch.equal(out, want[:, :rows.shape[0]].T), rows.shape[0]


@pytest.mark.parametrize("op", ["gguf_linear", "gguf_linear_q8"])
@pytest.mark.parametrize("qtype", [3, 8])  # Q4_1, Q8_0
def test_gguf_linear_sums_each_row_the_same_way_whatever_the_row_count(op: str,
                                                                       qtype: int) -> None:
    """Batch invariance: a row's output is bit-identical alone and among 1 to 199 others,
    across the kernels' register paths (few rows), their panels or row groups (many) and
    the panels' slices of a prompt's rows (200 rows of this K are two) and their pieces of K
    (1,344 is two: the tiles carry their accumulators across), for a feature count that
    leaves partial panels and tiles and a K of 42 blocks (scale chunks of 32 and 10).
    Both the exact kernel and the 8-bit-activation one."""
    from gguf import quants

    gen = torch.Generator().manual_seed(qtype)
    n, k = 101, 1344
    raw = torch.from_numpy(quants.quantize(
        torch.randn(n, k, generator=gen).numpy(), GGMLQuantizationType(qtype)))
    # The exact kernel reads the kernels' blocks, the 8-bit one the file's (interleaved) in
    # its own layout.
    blocks = (kernel_blocks(raw, qtype) if op == "gguf_linear"
              else torch.ops.freetoken.gguf_q8_blocks(
                  interleave_blocks(raw, GGUF_BLOCK_TYPES[qtype]), qtype))
    x = torch.randn(200, k, generator=gen)
    kernel = getattr(torch.ops.freetoken, op)

    def linear(rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty(rows.shape[0], n)
        kernel(rows.contiguous(), blocks, qtype, out)
        return out

    alone = torch.cat([linear(x[i:i + 1]) for i in range(len(x))])
    for rows in (2, 3, 4, 5, 7, 8, 9, 10, 11, 16, 17, 33, 40, 70, 131, 200):
        assert torch.equal(linear(x[:rows]), alone[:rows]), rows
    assert linear(x[:0]).shape == (0, n)


def _q8_reference(x: torch.Tensor, blocks: np.ndarray, qtype: int, n: int) -> torch.Tensor:
    """llama.cpp's arithmetic in float64, from first principles: each block of 32
    activations rounded to int8 with scale max|x| / 127 (float32, as the kernel computes
    it), each weight block's integer dot product scaled by both scales; Q4_1 adds m times
    the scaled sum of the activations."""
    from gguf.constants import GGML_QUANT_SIZES

    k = x.shape[1]
    xb32 = x.view(x.shape[0], k // 32, 32)
    amax = xb32.abs().amax(dim=-1, keepdim=True)
    dx32 = amax / 127  # float32, as the kernel (and ggml) computes it
    qx = torch.where(amax > 0, torch.round(xb32 * (127 / amax)),
                     torch.zeros_like(xb32)).double()
    dx = dx32.double()
    xs = dx * qx.sum(-1, keepdim=True)
    raw = torch.from_numpy(np.ascontiguousarray(blocks)).view(n, k // 32, GGML_QUANT_SIZES[
        GGMLQuantizationType(qtype)][1])
    d = raw[..., :2].contiguous().view(torch.float16).double()  # [n, nb, 1]
    if qtype == 3:
        m = raw[..., 2:4].contiguous().view(torch.float16).double()
        nib = raw[..., 4:20].long()
        q = torch.cat([nib & 0x0F, nib >> 4], dim=-1).double()  # weights 0..15, 16..31
    else:
        q = raw[..., 2:34].contiguous().view(torch.int8).double()
    dots = torch.einsum("rbj,nbj->rnb", qx, q)  # exact integers
    out = (dots * (d[..., 0][None] * dx[..., 0][:, None])).sum(-1)
    if qtype == 3:
        out += (m[..., 0][None] * xs[..., 0][:, None]).sum(-1)
    return out


@pytest.mark.parametrize("qtype", [3, 8])  # Q4_1, Q8_0
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 13, 17])  # the row passes and remainders
@pytest.mark.parametrize(("n", "k"), [(70, 96), (37, 1344)])  # partial groups of 16 features
def test_gguf_linear_q8_computes_llama_cpp_arithmetic(qtype: int, rows: int, n: int,
                                                      k: int) -> None:
    from gguf import quants

    gen = torch.Generator().manual_seed(qtype * 100 + rows + k)
    weight = torch.randn(n, k, generator=gen).numpy()
    blocks = quants.quantize(weight, GGMLQuantizationType(qtype))
    x = torch.randn(rows, k, generator=gen)
    x[0, :32] = 0  # an all-zero block: scale 0, no division by zero
    out = torch.empty(rows, n)
    # the file's blocks interleaved, then in the kernel's own layout (gguf_q8_blocks)
    laid = torch.ops.freetoken.gguf_q8_blocks(
        interleave_blocks(torch.from_numpy(blocks), GGUF_BLOCK_TYPES[qtype]), qtype)
    torch.ops.freetoken.gguf_linear_q8(x, laid, qtype, out)
    want = _q8_reference(x, blocks, qtype, n)
    torch.testing.assert_close(out.double(), want, atol=2e-4, rtol=1e-5)
    # and it is the model's product up to the activations' rounding
    exact = x.double() @ torch.from_numpy(
        quants.dequantize(blocks, GGMLQuantizationType(qtype))).double().T
    assert (out.double() - exact).norm() / exact.norm() < 0.02



# --------------------------------------------------------------------------- sample_rows

def native_draw(logits: torch.Tensor, temperature: list[float], seeds: list[int],
                counters: list[int] | None = None) -> tuple[list[int], list[bool]]:
    rows = logits.shape[0]
    tokens = torch.empty(rows, dtype=torch.long)
    finite = torch.empty(rows, dtype=torch.bool)
    torch.ops.freetoken.sample_rows(logits.contiguous(), torch.tensor(temperature),
                                    torch.tensor(seeds),
                                    torch.tensor(counters or [0] * rows), tokens, finite)
    return tokens.tolist(), finite.tolist()


def seed_with_draw(target: float) -> tuple[int, float]:
    """A seed whose draw at counter 0 is the closest to ``target`` among the first 20,000."""
    seeds = torch.arange(20_000)
    u = counter_uniform(seeds, torch.zeros_like(seeds))
    best = int((u - target).abs().argmin())
    return best, float(u[best])


def torch_draw(logits: torch.Tensor, temperature: float, u: float) -> int:
    """The torch path's inverse CDF (freetoken_core.engine.sampler)."""
    cdf = (logits / temperature).softmax(dim=-1).cumsum(dim=-1)
    total = cdf[-1:]
    target = torch.minimum(torch.tensor([u], dtype=cdf.dtype) * total,
                           torch.nextafter(total, torch.zeros_like(total)))
    return int(torch.searchsorted(cdf, target, right=True).clamp(max=cdf.shape[0] - 1))


def test_sample_rows_draws_what_the_torch_path_draws() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 1000 + 3  # not a multiple of the vector width nor of the CDF's chunks
    logits = torch.randn(64, vocab, generator=gen) * 3
    temps = [0.3, 0.8, 1.0, 1.7] * 16
    seeds = list(range(1000, 1064))
    counters = list(range(64))
    us = counter_uniform(torch.tensor(seeds), torch.tensor(counters)).tolist()
    tokens, finite = native_draw(logits, temps, seeds, counters)
    assert all(finite)
    same = sum(tok == torch_draw(row, t, u) for tok, row, t, u in zip(tokens, logits, temps, us))
    assert same == 64


def test_sample_rows_greedy_rows_take_the_first_maximum_and_rows_are_independent() -> None:
    logits = torch.zeros(3, 50)
    logits[0, [7, 30]] = 5.0  # a tie: the first index, as torch.argmax
    logits[1, 49] = 2.0
    logits[2] = torch.linspace(-1, 1, 50)
    tokens, finite = native_draw(logits, [0.0, 0.0, 1.0], [1, 2, 3], [0, 0, 5])
    assert tokens[:2] == [7, 49] and all(finite)
    alone, _ = native_draw(logits[2:], [1.0], [3], [5])
    assert alone == tokens[2:]


def test_sample_rows_never_draws_a_masked_token() -> None:
    logits = torch.full((4, 300), float("-inf"))
    logits[:, 10:20] = 0.0  # only tokens 10..19 allowed, each with 1/10
    low, u_low = seed_with_draw(0.0)
    high, u_high = seed_with_draw(1.0)
    assert u_low < 1e-3 and u_high > 1 - 1e-3
    tokens, finite = native_draw(logits, [1.0, 1.0, 0.5, 2.0], [low, high, 5, 6])
    assert all(finite)
    assert tokens[0] == 10 and tokens[1] == 19 and all(10 <= t < 20 for t in tokens)


def test_sample_rows_flags_rows_without_a_finite_maximum() -> None:
    logits = torch.randn(5, 43)
    logits[0] = float("-inf")
    logits[1, 3] = float("nan")
    logits[2, 5] = float("inf")
    logits[3, 42] = float("nan")  # in the scalar tail, past the vector loop
    _, finite = native_draw(logits, [1.0, 1.0, 0.7, 0.0, 1.0], [3] * 5)
    assert finite == [False, False, False, False, True]


def test_llama_layers_team_reports_a_failing_kernel_and_runs_again() -> None:
    """``llama_layers`` keeps its threads in one team for the whole step (parallel.h): a
    kernel that fails inside it (here write_kv, given a slot past the cache) fails the call
    with that kernel's message on every thread count, instead of leaving the other members
    waiting at a barrier, and the next call runs normally and matches the per-block path."""
    llm = LLM(None, dtype="float32", kv_cache_tokens=256, progress=False)
    runner = llm.engine.core.runner
    model = runner.model
    assert model.all_layers_args is not None
    caches = runner.kv_caches
    n = 3
    ids = torch.tensor([1, 2, 3])
    positions = torch.arange(n)
    cos, sin = model.rotary.tables(positions)
    tables = torch.zeros(n, 1, dtype=torch.int32)
    lens = positions.to(torch.int32) + 1
    block_size = runner.block_size

    def call(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = model.embedding(ids)
        return torch.ops.freetoken.llama_layers(
            x, *model.all_layers_args, cos, sin, caches, slots, tables, lens, block_size,
            *model.all_layers_shape)

    threads = torch.get_num_threads()
    try:
        for t in sorted({1, 2, threads}):
            torch.set_num_threads(t)
            with pytest.raises(RuntimeError, match="slot out of range"):
                call(torch.tensor([0, 1, caches.shape[1]]))
            got, residual = call(torch.arange(n))
            x = model.embedding(ids)
            want, want_residual = None, None
            for layer, cache in zip(model.layers, caches):
                want, want_residual = torch.ops.freetoken.llama_layer(
                    x if want is None else want, want_residual, layer.input_norm,
                    layer.post_attn_norm, layer.eps, *layer.one_call, cos, sin, cache,
                    torch.arange(n), tables, lens, block_size, *model.all_layers_shape)
            assert torch.equal(got, want) and torch.equal(residual, want_residual)
    finally:
        torch.set_num_threads(threads)


needs_int24 = pytest.mark.skipif(
    not cpu_kernels_available() or not torch.ops.freetoken.int_linear_available(),
    reason="the int24 kernel needs AVX-512 VNNI (this CPU has the float32 kernel only)")


def int24_case(qtype: int, n: int, k: int, seed: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random weight's int24 blocks, its dequantized float32 weights and its kernel blocks
    (the float32 kernel's layout of the same blocks) (Q4_1, Q8_0:
    quantized from random floats; the others: random blocks with finite scales)."""
    from gguf import quants
    from gguf_models import random_blocks

    if qtype not in (3, 8):
        raw = random_blocks(np.random.default_rng(seed), qtype, n, k)
    else:
        gen = torch.Generator().manual_seed(seed)
        raw = quants.quantize(torch.randn(n, k, generator=gen).numpy() * 0.05,
                              GGMLQuantizationType(qtype))
    dequantized = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType(qtype)))
    kernel = kernel_blocks(torch.from_numpy(raw), qtype)
    return torch.ops.freetoken.gguf_int_blocks(kernel, qtype), dequantized, kernel


def run_int24(x: torch.Tensor, blocks: torch.Tensor, qtype: int, n: int, mode: int = 0
          ) -> torch.Tensor:
    out = torch.empty(x.shape[0], n)
    torch.ops.freetoken.gguf_linear_int(x.contiguous(), blocks, qtype, out, mode)
    return out


# Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4
INT24_TYPES = [2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23, 39]


@needs_int24
@pytest.mark.parametrize("qtype", INT24_TYPES)
def test_int24_paths_compute_the_same_floats_whatever_the_row_count(qtype: int) -> None:
    """The VNNI path, the AMX tiles (from a few rows, where the CPU has them) and the scalar
    reference give the same floats, and a row's output is the same alone and among 1 to 99
    others (integer sums are exact in any order; the float steps are per row)."""
    n, k = 80, 1280 if qtype in (10, 11, 12, 13, 14, 23) else 1344
    blocks, _, _ = int24_case(qtype, n, k, qtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(100, k, generator=gen) * torch.exp(torch.randn(100, k, generator=gen))
    alone = torch.cat([run_int24(x[i:i + 1], blocks, qtype, n) for i in range(len(x))])
    assert torch.equal(run_int24(x, blocks, qtype, n, mode=1), alone)
    assert torch.equal(run_int24(x, blocks, qtype, n, mode=2), alone)
    for rows in (2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 33, 100):
        assert torch.equal(run_int24(x[:rows], blocks, qtype, n), alone[:rows]), rows
    assert run_int24(x[:0], blocks, qtype, n).shape == (0, n)
    assert blocks.shape == (n, torch.ops.freetoken.gguf_int_row_bytes(qtype, k))


@needs_int24
@pytest.mark.parametrize("qtype", INT24_TYPES)
def test_int24_rounds_no_more_than_the_float32_kernel(qtype: int) -> None:
    """Against float64 sums of the same weights, the int24 kernel's error is of the float32
    kernel's size: each activation rounded to 24 bits of its block's largest magnitude, the
    dot products exact, a few float32 roundings per block."""
    n, k = 256, 1536
    blocks, dequantized, kernel = int24_case(qtype, n, k, 10 + qtype)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(24, k, generator=gen)
    exact = x.double() @ dequantized.double().T
    scale = x.double().abs() @ dequantized.double().abs().T
    fp32 = torch.empty(24, n)
    torch.ops.freetoken.gguf_linear(x, kernel, qtype, fp32)
    err_int = ((run_int24(x, blocks, qtype, n).double() - exact).abs() / scale).max().item()
    err_fp32 = ((fp32.double() - exact).abs() / scale).max().item()
    assert err_int < 3e-7 and err_int < 3 * err_fp32, (err_int, err_fp32)


@needs_int24
def test_int24_keeps_zeros_and_propagates_what_is_not_finite() -> None:
    n, k = 32, 64
    blocks, dequantized, _ = int24_case(3, n, k, 5)
    x = torch.zeros(4, k)
    x[1, 3] = float("nan")
    x[2, 40] = float("inf")
    x[3] = torch.randn(k, generator=torch.Generator().manual_seed(3)) * 1e-30  # tiny
    exact = (x[3:].double() @ dequantized.double().T)[0]
    scale = (x[3:].double().abs() @ dequantized.double().abs().T)[0]
    for mode in (0, 1, 2):
        out = run_int24(x, blocks, 3, n, mode)
        assert torch.equal(out[0], torch.zeros(n))
        assert out[1].isnan().all() and out[2].isnan().all()
        assert ((out[3].double() - exact).abs() / scale).max() < 3e-7


@needs_int24
@pytest.mark.parametrize("qtype", INT24_TYPES)
def test_int24_layout_embeds_rows_as_gguf_py_decodes_them(qtype: int) -> None:
    """``gguf_int_embedding`` (a tied embedding reading the output head's int24 blocks)
    gives each row as gguf-py dequantizes it, bit for bit, and as the kernel-layout
    embedding does; a token id outside the rows is refused."""
    n, k = 48, 512
    blocks, dequantized, kernel = int24_case(qtype, n, k, 20 + qtype)
    ids = torch.tensor([0, 47, 5, 16, 5, 31, 17])
    rows = torch.ops.freetoken.gguf_int_embedding(ids, blocks, qtype, k)
    assert torch.equal(rows, dequantized[ids])
    assert torch.equal(rows, torch.ops.freetoken.gguf_embedding_blocks(ids, kernel, qtype, k))
    with pytest.raises(RuntimeError, match="outside the embedding"):
        torch.ops.freetoken.gguf_int_embedding(torch.tensor([48]), blocks, qtype, k)


@needs_int24
def test_int24_mxfp4_at_every_scale() -> None:
    """MXFP4's E8M0 scales in the int24 layout (d as the float32 2^(e - 128)): blocks at
    scales 2^-28..2^12 compute as the float32 kernel's error allows, the same on every path
    and row count; and every one of the 256 exponents, the subnormal scales and those
    whose weights overflow to inf included, comes back from the layout as gguf-py decodes
    it (``gguf_int_embedding``, which rebuilds the file's byte e)."""
    from gguf import quants
    from gguf_models import MXFP4, mxfp4_exponents, random_blocks

    n, k = 64, 512
    rng = np.random.default_rng(6)
    raw = mxfp4_exponents(random_blocks(rng, MXFP4, n, k), rng.integers(100, 141, n * k // 32))
    w = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.MXFP4)).double()
    kernel = kernel_blocks(torch.from_numpy(raw), MXFP4)
    blocks = torch.ops.freetoken.gguf_int_blocks(kernel, MXFP4)
    x = torch.randn(24, k, generator=torch.Generator().manual_seed(6))
    exact, scale = x.double() @ w.T, x.double().abs() @ w.abs().T
    out = run_int24(x, blocks, MXFP4, n)
    assert ((out.double() - exact).abs() / scale).max() < 3e-7
    for mode in (1, 2):
        assert torch.equal(run_int24(x, blocks, MXFP4, n, mode), out)
    for rows in (1, 5, 9, 17):
        assert torch.equal(run_int24(x[:rows], blocks, MXFP4, n), out[:rows])
    every = mxfp4_exponents(raw, np.arange(256))  # 1,024 blocks: each exponent four times
    with np.errstate(over="ignore"):
        want = torch.from_numpy(quants.dequantize(every, GGMLQuantizationType.MXFP4))
    assert want.isinf().any() and (want.abs() < 2.0 ** -126).logical_and(want != 0).any()
    laid = torch.ops.freetoken.gguf_int_blocks(kernel_blocks(torch.from_numpy(every), MXFP4),
                                               MXFP4)
    got = torch.ops.freetoken.gguf_int_embedding(torch.arange(n), laid, MXFP4, k)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@needs_int24
@pytest.mark.parametrize("qtype", [3, 14])  # Q4_1, Q6_K
def test_int24_blocks_written_into_a_given_tensor(qtype: int) -> None:
    """``gguf_int_blocks_into`` (a load writes each linear's new layout into its place in the
    model's arena) writes what ``gguf_int_blocks`` returns, and refuses a tensor of another
    shape; ``int_blocks(..., out=)`` does the same for a linear of parts."""
    from freetoken_core.models.block_layout import KIND_PARTS, int_blocks, parts_blocks

    blocks, _, kernel = int24_case(qtype, 32, 512, 7)
    out = torch.full_like(blocks, 0xAB)
    torch.ops.freetoken.gguf_int_blocks_into(kernel, qtype, out)
    assert torch.equal(out, blocks)
    with pytest.raises(RuntimeError, match="out must be a contiguous uint8"):
        torch.ops.freetoken.gguf_int_blocks_into(kernel, qtype, out[:, 1:].contiguous())
    parts = parts_blocks([(qtype, kernel), (qtype, kernel)])
    whole = int_blocks(parts, KIND_PARTS)
    into = torch.full_like(whole, 0xAB)
    assert int_blocks(parts, KIND_PARTS, into) is into and torch.equal(into, whole)


@needs_int24
def test_int24_blocks_need_whole_groups_of_16_features() -> None:
    raw = torch.zeros(40, 24, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.freetoken.gguf_int_blocks(raw, 3)


@needs_int24
def test_int24_linear_of_parts_is_its_parts_side_by_side() -> None:
    """A linear of parts of different types (a Q4_K_M q/k/v: Q4_K q and k, Q6_K v) on the
    int24 kernel gives each part's own outputs, side by side; a header that does not fit its
    output is refused with a message, not read past."""
    from freetoken_core.models.block_layout import KIND_PARTS, int_blocks, int_shape, parts_blocks

    k = 512
    cases = [int24_case(qtype, n, k, seed) for qtype, n, seed in ((12, 64, 1), (12, 32, 2),
                                                                   (14, 32, 3))]
    types = [12, 12, 14]
    kernel_parts = parts_blocks([(t, kernel) for t, (_, _, kernel) in zip(types, cases)])
    blocks = int_blocks(kernel_parts, KIND_PARTS)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(4))
    whole = run_int24(x, blocks, KIND_PARTS, 128)
    singles = [run_int24(x, b, t, b.shape[0]) for t, (b, _, _) in zip(types, cases)]
    assert torch.equal(whole, torch.cat(singles, dim=1))
    assert tuple(blocks.shape) == int_shape(KIND_PARTS, kernel_parts, k)
    assert torch.equal(run_int24(x, blocks, KIND_PARTS, 128, mode=1), whole)
    with pytest.raises(RuntimeError, match="features"):
        run_int24(x, blocks, KIND_PARTS, 96)
    with pytest.raises(RuntimeError, match="not a type of the int24 kernel"):
        run_int24(x, cases[0][0], 1, 64)  # F16
