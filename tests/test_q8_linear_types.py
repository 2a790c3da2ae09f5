"""The 8-bit-activation kernel (``gguf_linear_q8``, ``--activations q8``) on every block type
it computes with: Q4_0, Q4_1, Q5_0, Q8_0 against activations quantized by 32 (llama.cpp's
Q8_0 / Q8_1), Q4_K and Q6_K against activations quantized by 256 (llama.cpp's Q8_K).

For each type: random blocks (tests/gguf_models.py) in the kernels' interleaved layout; the
kernel's output against a float64 product of the activations as the kernel rounds them
(computed here from first principles) and gguf-py's dequantized weights; the same bits for a
row alone as among others; a linear of parts of different types."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from gguf_models import random_blocks

from freetoken_core.kernels import cpu_kernels_available
from freetoken_core.models.block_layout import (
    KIND_PARTS,
    kernel_blocks,
    narrow_scales,
    parts_blocks,
    q8_blocks,
    q8_shape,
)

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="no native kernels")

Q8_TYPES = [2, 3, 6, 8, 12, 14] + (  # Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K; Q5_K with AVX2
    [13] if cpu_kernels_available() and torch.ops.freetoken.q8_linear_supports(13) else [])


def _name(qtype: int) -> str:
    return GGMLQuantizationType(qtype).name


def _case(qtype: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks [n, bytes] as the kernel reads them, float64 weights [n, k]) of random blocks
    of ``qtype``."""
    rng = np.random.default_rng(seed)
    rows = random_blocks(rng, qtype, n, k, scale=0.1)
    weights = dequantize(rows.reshape(-1), GGMLQuantizationType(qtype))
    # as a model lays them out for the float32 kernel, then for this one
    return (q8_blocks(kernel_blocks(torch.from_numpy(rows.copy()), qtype), qtype),
            torch.from_numpy(np.asarray(weights, dtype=np.float64).reshape(n, k)))


def _quantized_activations(x: torch.Tensor, qtype: int) -> torch.Tensor:
    """x as the kernel rounds it, in float64: each run of 32 (256 for the K-quants) scaled by
    max|x| / 127 and rounded to the nearest integer (ties to even), in float32 arithmetic."""
    run = 256 if qtype in (12, 13, 14) else 32
    xb = x.numpy().reshape(x.shape[0], -1, run)
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inverse)
    dx = (amax / np.float32(127)).astype(np.float32)
    return torch.from_numpy((q.astype(np.float64) * dx.astype(np.float64)).reshape(x.shape))


def _q8(x: torch.Tensor, blocks: torch.Tensor, qtype: int, n: int) -> torch.Tensor:
    out = torch.empty(x.shape[0], n)
    torch.ops.freetoken.gguf_linear_q8(x.contiguous(), blocks, qtype, out)
    return out


@pytest.mark.parametrize("qtype", Q8_TYPES, ids=_name)
def test_q8_kernel_is_the_product_of_the_rounded_activations(qtype: int) -> None:
    k, n = 768, 37  # three super-blocks or 24 blocks a row; a partial group and chunk
    blocks, w64 = _case(qtype, n, k, qtype)
    gen = torch.Generator().manual_seed(qtype)
    x = torch.randn(40, k, generator=gen)
    x[0, :256] = 0  # an all-zero run: scale 0, no division by zero
    out = _q8(x, blocks, qtype, n)
    xq = _quantized_activations(x, qtype)
    ref = xq @ w64.T
    # float32 sums of exact integer products (one rounding of each block's scale product
    # and of each accumulation); Q4_K's two terms (scales, mins) may each exceed the sum
    bound = 1e-5 * (xq.abs() @ w64.abs().T) + 2e-6 * ref.abs().max()
    assert torch.all((out.double() - ref).abs() <= bound), _name(qtype)
    # and the model's product up to the activations' rounding
    exact = x.double() @ w64.T
    assert (out.double() - exact).norm() / exact.norm() < 0.02
    # a row's output is the same bits alone as among others (the one-row path and the
    # decoded-once path of the K-quants, the 4-row groups and remainders of the others)
    for rows in (1, 2, 3, 5, 16, 17):
        assert torch.equal(_q8(x[:rows], blocks, qtype, n), out[:rows]), rows
    alone = torch.cat([_q8(x[i:i + 1], blocks, qtype, n) for i in range(len(x))])
    assert torch.equal(alone, out)
    assert _q8(x[:0], blocks, qtype, n).shape == (0, n)


def test_q8_linear_of_parts_is_its_parts_side_by_side() -> None:
    """A Q4_K_M file's fused q/k/v: Q4_K q and k, a Q6_K v; and a Q5_0 / Q8_0 one (the
    SmolLM2 Q4_K_M file's 576-wide rows)."""
    for k, parts in ((512, [(12, 64), (12, 32), (14, 32)]), (576, [(6, 40), (8, 24)])):
        laid_out = [(qtype, _case(qtype, n, k, 100 + i)[0]) for i, (qtype, n) in enumerate(parts)]
        blocks = parts_blocks(laid_out)
        total = sum(n for _, n in parts)
        for rows in (1, 3, 16):
            x = torch.randn(rows, k)
            whole = _q8(x, blocks, KIND_PARTS, total)
            singles = torch.cat([_q8(x, b, qtype, b.shape[0]) for qtype, b in laid_out], dim=1)
            assert torch.equal(whole, singles), (k, rows)


@pytest.mark.parametrize("n", [48, 37], ids=["whole groups", "a group of 5 last"])
@pytest.mark.parametrize("qtype", Q8_TYPES, ids=_name)
def test_q8_layout_embeds_rows_as_gguf_py_decodes_them(qtype: int, n: int) -> None:
    """``gguf_q8_embedding`` (a tied embedding reading the output head's blocks once they are
    laid out for this kernel) gives each row as gguf-py dequantizes it, bit for bit, in a
    last group of features narrower than the others too; a token id outside the rows, or
    blocks of another width, are refused."""
    k = 512
    blocks, weights = _case(qtype, n, k, 30 + qtype)
    ids = torch.tensor([0, n - 1, 5, 16, 5, 31, 17, n - 2, 32])
    rows = torch.ops.freetoken.gguf_q8_embedding(ids, blocks, qtype, k)
    assert torch.equal(rows, weights[ids].float())
    with pytest.raises(RuntimeError, match="outside the embedding"):
        torch.ops.freetoken.gguf_q8_embedding(torch.tensor([n]), blocks, qtype, k)
    with pytest.raises(RuntimeError, match="blocks must be gguf_q8_blocks"):
        torch.ops.freetoken.gguf_q8_embedding(ids, blocks, qtype, 2 * k)


@pytest.mark.parametrize("qtype", Q8_TYPES, ids=_name)
def test_q8_blocks_written_into_a_given_tensor(qtype: int) -> None:
    """``gguf_q8_blocks_into`` (a load writes each linear's new layout into its place in the
    model's arena) writes every byte that ``gguf_q8_blocks`` returns, in the shape
    ``gguf_q8_row_bytes`` gives, and refuses a tensor of another shape; ``q8_blocks(...,
    out=)`` does the same for a linear of parts."""
    rows = random_blocks(np.random.default_rng(9), qtype, 37, 512, scale=0.1)
    kernel = narrow_scales(kernel_blocks(torch.from_numpy(rows.copy()), qtype), qtype)
    laid = torch.ops.freetoken.gguf_q8_blocks(kernel, qtype)
    assert laid.shape == (37, torch.ops.freetoken.gguf_q8_row_bytes(qtype, 512))
    out = torch.full_like(laid, 0xAB)
    torch.ops.freetoken.gguf_q8_blocks_into(kernel, qtype, out)
    assert torch.equal(out, laid)
    with pytest.raises(RuntimeError, match="out must be a contiguous uint8"):
        torch.ops.freetoken.gguf_q8_blocks_into(kernel, qtype, out[:36])
    other = 2 if qtype != 2 else 8
    parts = parts_blocks([(qtype, kernel_blocks(torch.from_numpy(rows.copy()), qtype)),
                          (other, kernel_blocks(torch.from_numpy(random_blocks(
                              np.random.default_rng(10), other, 16, 512)), other))])
    whole = q8_blocks(parts, KIND_PARTS)
    assert q8_shape(KIND_PARTS, parts, 512) == tuple(whole.shape)
    into = torch.full_like(whole, 0xAB)
    assert q8_blocks(parts, KIND_PARTS, out=into) is into
    assert torch.equal(into, whole)


def test_q8_kernel_names_what_it_cannot_compute() -> None:
    blocks, _ = _case(12, 4, 256, 0)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        _q8(torch.randn(1, 128), blocks[:, :74].contiguous(), 12, 4)
    q3k = kernel_blocks(torch.from_numpy(random_blocks(np.random.default_rng(0), 11, 4, 256)), 11)
    with pytest.raises(RuntimeError, match="no 8-bit kernel for ggml type 11"):
        _q8(torch.randn(1, 256), q3k, 11, 4)
    with pytest.raises(RuntimeError, match="no 8-bit kernel for ggml type 11"):
        q8_blocks(q3k, 11)
    assert torch.ops.freetoken.q8_linear_supports(14)
    assert not torch.ops.freetoken.q8_linear_supports(11)
    # IQ4_NL, IQ4_XS, MXFP4 and the IQ1/IQ2/IQ3 i-quants have no 8-bit kernel either: their
    # linears keep float32
    assert not any(torch.ops.freetoken.q8_linear_supports(t)
                   for t in (20, 23, 39, 16, 17, 18, 19, 21, 22, 29))


def test_i_quant_linears_keep_the_float32_kernel_under_q8(tmp_path) -> None:
    """A Q4_K file whose gate/up and down are IQ2_S + IQ1_S and IQ3_XXS (as the low-bit
    mixes put i-quants beside K-quants): ``activations="q8"`` switches q/k/v, o and the head,
    and leaves the i-quant linears on the float32 kernel, without an error."""
    from gguf_models import IQ1_S, IQ2_S, IQ3_XXS, Q4_K, Q6_K, write_gguf

    from freetoken_core import LLM, SamplingParams
    from freetoken_core.models.block_layout import ACTIVATIONS_Q8

    path = write_gguf(tmp_path / "iq-mix.gguf", "llama", hidden=256, layers=2, heads=4,
                      kv_heads=2, ff=512, weight_type=Q4_K,
                      types={"token_embd.weight": Q6_K, "ffn_gate.weight": IQ2_S,
                             "ffn_up.weight": IQ1_S, "ffn_down.weight": IQ3_XXS})
    with LLM(str(path), activations="q8", kv_cache_tokens=2048, progress=False) as llm:
        model = llm.engine.core.runner.model
        switched = [[bool(lin.blocks[0] & ACTIVATIONS_Q8) for lin in layer.linears]
                    for layer in model.layers] + [[bool(model.lm_head.blocks[0]
                                                        & ACTIVATIONS_Q8)]]
        out = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=4))
    assert switched == [[True, True, False, False]] * 2 + [[True]]  # qkv, o, gate_up, down
    assert len(out[0].outputs[0].token_ids) == 4


def test_a_q4_k_m_model_switches_the_linears_that_have_an_8_bit_kernel(tmp_path) -> None:
    """A Q4_K_M-like file (Q4_K; Q6_K v, down and tied embedding) with a Q3_K up projection:
    ``activations="q8"`` moves every linear but the gate/up (Q4_K + Q3_K parts) to 8-bit
    activations, and the model's prompt logprobs stay close to the exact path's without
    equalling them."""
    from gguf_models import Q3_K, Q4_K, Q6_K, write_gguf

    from freetoken_core import LLM, SamplingParams
    from freetoken_core.models.block_layout import ACTIVATIONS_Q8

    path = write_gguf(tmp_path / "mix.gguf", "llama", hidden=256, layers=2, heads=4,
                      kv_heads=2, ff=512, weight_type=Q4_K,
                      types={"attn_v.weight": Q6_K, "ffn_down.weight": Q6_K,
                             "token_embd.weight": Q6_K, "ffn_up.weight": Q3_K})
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0)
    prompt = "The quick brown fox jumps over the lazy dog, twice: " * 4
    results, embeddings = {}, {}
    for mode in ("float32", "q8"):
        with LLM(str(path), activations=mode, kv_cache_tokens=2048, progress=False) as llm:
            model = llm.engine.core.runner.model
            switched = [[bool(lin.blocks[0] & ACTIVATIONS_Q8) for lin in layer.linears]
                        for layer in model.layers] + [[bool(model.lm_head.blocks[0]
                                                            & ACTIVATIONS_Q8)]]
            # the tied embedding reads the head's blocks, in their new layout too
            assert model.embedding.blocks is model.lm_head.blocks
            embeddings[mode] = model.embedding(torch.arange(model.embedding.num_embeddings))
            out = llm.generate(prompt, params)[0]
            results[mode] = (switched, [next(iter(p.values())).logprob
                                        for p in out.prompt_logprobs[1:]])
    assert torch.equal(embeddings["float32"], embeddings["q8"])
    assert results["float32"][0] == [[False] * 4] * 2 + [[False]]
    assert results["q8"][0] == [[True, True, False, True]] * 2 + [[True]]  # qkv, o, gate_up, down
    exact, q8 = (torch.tensor(results[m][1]) for m in ("float32", "q8"))
    assert not torch.equal(exact, q8)
    assert (exact - q8).abs().mean() < 0.05 * exact.abs().mean()
