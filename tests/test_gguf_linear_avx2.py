"""The AVX2 build of the linear kernels (float32 and 8-bit activations), on a machine whose
default build is AVX-512.

The native kernels are built for the CPU at hand (``-march=native``), so on an AVX-512
machine the 8-lane AVX2 paths of gguf_linear.cpp (and of gguf_types.h's decoders) never run
in the other tests; CPUs without AVX-512 (the AMD EPYC reference) run only those. Here
gguf_linear.cpp and gguf_dequant.cpp are built for ``-march=haswell`` (AVX2 + FMA) in a
child process without the main build, and every type is checked as
test_gguf_linear_types.py checks the main build: against float64, the same bits at every row
count, and the embedding's rows exact. The build is cached under the kernel cache."""

from __future__ import annotations

import pytest
from native_builds import BUILDS, cpu_has, run_build_child

CHILD = r'''
import sys

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

sys.path.insert(0, sys.argv[1])
from native_builds import load_build  # noqa: E402

load_build("avx2-linear")
assert torch.ops.freetoken.gguf_vector_lanes() == 8
from gguf_models import random_blocks  # noqa: E402

from freetoken_core.models.gguf_weights import GGUF_TYPES  # noqa: E402
from freetoken_core.models.block_layout import NATIVE_UNITS, kernel_blocks

failed = []
for qtype in sorted(GGUF_TYPES):
    unit = NATIVE_UNITS[qtype][0]
    k, n = (2 * max(unit, 64) if unit < 256 else 3 * 256), 37
    rows = random_blocks(np.random.default_rng(qtype), qtype, n, k, scale=0.1)
    w64 = torch.from_numpy(np.asarray(dequantize(rows.reshape(-1), GGMLQuantizationType(qtype)),
                                      dtype=np.float64).reshape(n, k))
    blocks = kernel_blocks(torch.from_numpy(rows.copy()), qtype)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(qtype))
    full = torch.empty(40, n)
    torch.ops.freetoken.gguf_linear(x, blocks, qtype, full)
    bound = 4e-6 * (x.double().abs() @ w64.abs().T) + 1e-30
    ok = bool(torch.all((full.double() - x.double() @ w64.T).abs() <= bound))
    for r in (1, 2, 3, 4, 5, 8, 16):
        part = torch.empty(r, n)
        torch.ops.freetoken.gguf_linear(x[:r].contiguous(), blocks, qtype, part)
        ok = ok and torch.equal(part, full[:r])
    emb = torch.ops.freetoken.gguf_embedding_blocks(torch.arange(n), blocks, qtype, k)
    ok = ok and torch.equal(emb.double(), w64)
    if not ok:
        failed.append(GGMLQuantizationType(qtype).name)

# The 8-bit-activation kernel's AVX2 path (the lanes layout through vpmaddubsw): against the
# float64 product of the activations as the kernel rounds them (as test_q8_linear_types
# checks the main build), and the same bits for a row alone as among others.
from freetoken_core.models.block_layout import q8_blocks  # noqa: E402

for qtype in (2, 3, 6, 8, 12, 13, 14):
    run = 256 if qtype in (12, 13, 14) else 32
    k, n = 768, 37
    rows = random_blocks(np.random.default_rng(qtype), qtype, n, k, scale=0.1)
    w64 = torch.from_numpy(np.asarray(dequantize(rows.reshape(-1), GGMLQuantizationType(qtype)),
                                      dtype=np.float64).reshape(n, k))
    blocks = q8_blocks(kernel_blocks(torch.from_numpy(rows.copy()), qtype), qtype)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(qtype))
    x[0, :256] = 0
    out = torch.empty(40, n)
    torch.ops.freetoken.gguf_linear_q8(x, blocks, qtype, out)
    xb = x.numpy().reshape(40, -1, run)
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    xq = torch.from_numpy((np.rint(xb * inverse).astype(np.float64)
                           * (amax / np.float32(127)).astype(np.float32).astype(np.float64)
                           ).reshape(40, k))
    ref = xq @ w64.T
    bound = 1e-5 * (xq.abs() @ w64.abs().T) + 2e-6 * ref.abs().max()
    ok = bool(torch.all((out.double() - ref).abs() <= bound))
    for r in (1, 2, 3, 5, 16, 17):
        part = torch.empty(r, n)
        torch.ops.freetoken.gguf_linear_q8(x[:r].contiguous(), blocks, qtype, part)
        ok = ok and torch.equal(part, out[:r])
    if not ok:
        failed.append(GGMLQuantizationType(qtype).name + " q8")
print("failed:", ",".join(failed) or "none")
'''


@pytest.mark.skipif(not cpu_has(*BUILDS["avx2-linear"].cpu_flags),
                    reason="the CPU has no AVX2 + FMA")
def test_avx2_build_of_the_linear_kernels_on_every_type() -> None:
    lines = run_build_child(CHILD)
    assert lines[-1] == "failed: none", "\n".join(lines)
