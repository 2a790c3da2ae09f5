"""The native float32 linear kernel on every GGUF block type it computes with.

For each type: random blocks (tests/gguf_models.py), laid out as the model lays them out
(``kernel_blocks``); the kernel's output against a float64 product of gguf-py's dequantized
weights (only the order of the float32 sums may differ), at row counts of the direct path
and of the panels, and each row's output the same bits alone as among other rows (batch
invariance, which seeded sampling relies on)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from gguf_models import random_blocks

from freetoken_core.kernels import cpu_kernels_available
from freetoken_core.models.block_layout import NATIVE_UNITS, kernel_blocks
from freetoken_core.models.gguf_weights import GGUF_TYPES

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="no native kernels")

TYPES = sorted(GGUF_TYPES)


def _case(qtype: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(file rows [n, bytes], float64 weights [n, k]) of random blocks of ``qtype``."""
    rng = np.random.default_rng(seed)
    rows = random_blocks(rng, qtype, n, k, scale=0.1)
    weights = dequantize(rows.reshape(-1), GGMLQuantizationType(qtype))
    return torch.from_numpy(rows.copy()), torch.from_numpy(
        np.asarray(weights, dtype=np.float64).reshape(n, k))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: GGMLQuantizationType(t).name)
def test_gguf_linear_matches_float64_of_the_dequantized_weights(qtype: int) -> None:
    unit = NATIVE_UNITS[qtype][0]
    k = 2 * max(unit, 64) if unit < 256 else 3 * 256  # several units (and sub-blocks) a row
    n = 37  # a partial group of features and a partial panel
    rows, w64 = _case(qtype, n, k, qtype)
    blocks = kernel_blocks(rows, qtype)
    gen = torch.Generator().manual_seed(qtype)
    x = torch.randn(40, k, generator=gen)
    full = torch.empty(40, n)
    torch.ops.freetoken.gguf_linear(x, blocks, qtype, full)
    ref = x.double() @ w64.T
    bound = 4e-6 * (x.double().abs() @ w64.abs().T) + 1e-30
    assert torch.all((full.double() - ref).abs() <= bound)
    # the same floats, row by row, at every row count (direct path 1-10, panels above)
    for rows_now in (1, 2, 3, 5, 8, 11, 16):
        part = torch.empty(rows_now, n)
        torch.ops.freetoken.gguf_linear(x[:rows_now].contiguous(), blocks, qtype, part)
        assert torch.equal(part, full[:rows_now]), rows_now


def test_mxfp4_blocks_at_scales_2_to_the_minus_28_to_2_to_the_12() -> None:
    """MXFP4 blocks whose power-of-two scales span 2^40 (E8M0 bytes 100..140, each block
    its own): the float32 kernel against float64 of gguf-py's weights, and the same floats
    at every row count."""
    from gguf_models import MXFP4, mxfp4_exponents

    k, n = 256, 37
    rng = np.random.default_rng(5)
    rows = mxfp4_exponents(random_blocks(rng, MXFP4, n, k), rng.integers(100, 141, n * k // 32))
    w64 = torch.from_numpy(np.asarray(dequantize(rows.reshape(-1), GGMLQuantizationType.MXFP4),
                                      dtype=np.float64).reshape(n, k))
    assert w64.abs().max() > 2.0 ** 10 and w64[w64 != 0].abs().min() < 2.0 ** -26
    blocks = kernel_blocks(torch.from_numpy(rows), MXFP4)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(5))
    full = torch.empty(16, n)
    torch.ops.freetoken.gguf_linear(x, blocks, MXFP4, full)
    bound = 4e-6 * (x.double().abs() @ w64.abs().T)
    assert torch.all((full.double() - x.double() @ w64.T).abs() <= bound)
    for rows_now in (1, 3, 11):
        part = torch.empty(rows_now, n)
        torch.ops.freetoken.gguf_linear(x[:rows_now].contiguous(), blocks, MXFP4, part)
        assert torch.equal(part, full[:rows_now]), rows_now


def test_gguf_linear_names_a_row_width_that_is_not_whole_units() -> None:
    rows, _ = _case(12, 4, 256, 0)
    x = torch.randn(1, 128)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        torch.ops.freetoken.gguf_linear(x, kernel_blocks(rows, 12), 12, torch.empty(1, 4))


def test_a_linear_of_parts_of_different_types_is_their_outputs_side_by_side() -> None:
    """A fused q/k/v of Q4_K q and k and a Q6_K v (a Q4_K_M file's): one linear of parts
    gives each part's own floats, in order, at every row count."""
    from freetoken_core.models.block_layout import KIND_PARTS, parts_blocks, parts_features

    k = 512
    parts = [(12, 64), (12, 32), (14, 32)]
    laid_out, singles = [], []
    for i, (qtype, n) in enumerate(parts):
        rows, _ = _case(qtype, n, k, 100 + i)
        laid_out.append((qtype, kernel_blocks(rows, qtype)))
    blocks = parts_blocks(laid_out)
    assert parts_features(blocks) == 128
    for rows_now in (1, 3, 16):
        x = torch.randn(rows_now, k)
        out = torch.empty(rows_now, 128)
        torch.ops.freetoken.gguf_linear(x, blocks, KIND_PARTS, out)
        singles = []
        for qtype, b in laid_out:
            y = torch.empty(rows_now, b.shape[0])
            torch.ops.freetoken.gguf_linear(x, b, qtype, y)
            singles.append(y)
        assert torch.equal(out, torch.cat(singles, dim=1))
