"""The i-quants' grids (``csrc/gguf_iq_grids.h``) and decoders (``csrc/gguf_iq_types.h``):
the header's packed grids are gguf-py's, and every entry of every grid, read by enough
random super-blocks, decodes to gguf-py's weights bit for bit on the three builds of
tests/test_gguf_types.py (AVX-512, AVX2, scalar). test_gguf_types.py checks the same
decoders on random rows of every width as it checks the other types; this adds the grids'
coverage and the scales at their extremes."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGMLQuantizationType as QT
from test_gguf_types import (  # noqa: F401 (ops: the fixture of the three builds)
    CSRC,
    UNITS,
    assert_bits_equal,
    iq1_m_with_scales,
    ops,
    random_rows,
)

from freetoken_core.kernels import cpu_kernels_available

pytestmark = pytest.mark.skipif(not cpu_kernels_available(),
                                reason="native CPU kernels unavailable")

IQ_TYPES = [QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ3_XXS, QT.IQ3_S, QT.IQ1_S, QT.IQ1_M]

# The header's hex string of each grid, by gguf-py's class that holds it.
GRIDS = {"kIQ2XXSHex": quants.IQ2_XXS, "kIQ2XSHex": quants.IQ2_XS, "kIQ2SHex": quants.IQ2_S,
         "kIQ3XXSHex": quants.IQ3_XXS, "kIQ3SHex": quants.IQ3_S, "kIQ1SHex": quants.IQ1_S}


def test_the_grids_are_gguf_pys() -> None:
    header = (CSRC / "gguf_iq_grids.h").read_text()
    for name, cls in GRIDS.items():
        match = re.search(rf"{name}\[\] =\s*((?:\"[0-9a-f]*\"\s*)+);", header)
        assert match, name
        assert "".join(re.findall(r"\"([0-9a-f]*)\"", match.group(1))).encode() == \
            cls.grid_hex, name
    assert quants.IQ1_M.grid_hex == quants.IQ1_S.grid_hex  # IQ1_M reads IQ1_S's grid


@pytest.mark.parametrize("qtype", IQ_TYPES, ids=lambda t: t.name)
def test_every_grid_entry_decodes_as_gguf_py(ops, qtype: QT) -> None:  # noqa: F811
    """4,000 random super-blocks (128,000 groups of 8 or 4 weights): each grid entry (at most
    2,048) is read ~60 times on average, so that a wrong entry anywhere fails."""
    rng = np.random.default_rng(300 + int(qtype))
    raw = random_rows(rng, qtype, 500, 8)
    want = quants.dequantize(raw, qtype)
    rows = torch.from_numpy(raw)
    for vector in (True, False):
        assert_bits_equal(ops.gguf_dequantize(rows, int(qtype), vector), want)


@pytest.mark.parametrize("qtype", IQ_TYPES, ids=lambda t: t.name)
def test_scales_at_the_float16_extremes(ops, qtype: QT) -> None:  # noqa: F811
    """d = +-0 (signed zero weights), the smallest subnormal, and +-65504 with the largest
    sub-block scales (the largest weights, far inside float32)."""
    rng = np.random.default_rng(400 + int(qtype))
    raw = random_rows(rng, qtype, 40, 4)
    nbytes = UNITS[qtype][1]
    blocks = raw.reshape(-1, nbytes)
    extremes = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x7BFF, 0xFBFF], dtype=np.uint16)
    d = np.resize(extremes, blocks.shape[0])
    if qtype == QT.IQ1_M:
        blocks = iq1_m_with_scales(blocks, d)
    else:
        blocks[:, :2] = d.view(np.uint8).reshape(-1, 2)
    raw = np.ascontiguousarray(blocks.reshape(raw.shape))
    want = quants.dequantize(raw, qtype)
    assert np.isfinite(want).all() and (np.signbit(want) & (want == 0)).any()
    rows = torch.from_numpy(raw)
    for vector in (True, False):
        assert_bits_equal(ops.gguf_dequantize(rows, int(qtype), vector), want)
