"""The native GGUF block decoders (``csrc/gguf_types.h``, ops in ``csrc/gguf_dequant.cpp``)
against gguf-py's ``gguf.quants.dequantize``, bit for bit, for every supported type.

Three builds are checked: the library ``cpu_kernels_available()`` builds (``-march=native``:
AVX-512 on this project's machines), and two copies of ``gguf_dequant.cpp`` alone built here
under their own op namespaces, one for AVX2 + FMA without AVX-512 (``-march=haswell``) and
one without AVX2 (``-march=x86-64``, where ``vector=True`` runs the scalar decoders). Each is
built once per source and torch version into ``$FREETOKEN_CACHE/kernels/``.
"""

from __future__ import annotations

import hashlib
import platform
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as QT

from freetoken_core.kernels import cpu_kernels_available

pytestmark = pytest.mark.skipif(not cpu_kernels_available(),
                                reason="native CPU kernels unavailable")

CSRC = Path(__file__).resolve().parent.parent / "freetoken_core" / "kernels" / "csrc"

# Unit (weights, bytes) per type as the kernels count them (F32/F16/BF16: 32 values), and
# where each unit keeps its float16 scales (MXFP4: none, its E8M0 exponent byte at 0 takes
# every value; IQ1_M: none whole, its d is the top nibbles of its four u16 scales at 48).
UNITS = {
    QT.F32: (32, 128, ()), QT.F16: (32, 64, ()), QT.BF16: (32, 64, ()),
    QT.Q4_0: (32, 18, (0,)), QT.Q4_1: (32, 20, (0, 2)), QT.Q5_0: (32, 22, (0,)),
    QT.Q5_1: (32, 24, (0, 2)), QT.Q8_0: (32, 34, (0,)), QT.Q2_K: (256, 84, (80, 82)),
    QT.Q3_K: (256, 110, (108,)), QT.Q4_K: (256, 144, (0, 2)), QT.Q5_K: (256, 176, (0, 2)),
    QT.Q6_K: (256, 210, (208,)), QT.IQ4_NL: (32, 18, (0,)), QT.IQ4_XS: (256, 136, (0,)),
    QT.MXFP4: (32, 17, ()),
    QT.IQ2_XXS: (256, 66, (0,)), QT.IQ2_XS: (256, 74, (0,)), QT.IQ2_S: (256, 82, (0,)),
    QT.IQ3_XXS: (256, 98, (0,)), QT.IQ3_S: (256, 110, (0,)), QT.IQ1_S: (256, 50, (0,)),
    QT.IQ1_M: (256, 56, ()),
}
TYPES = list(UNITS)
VARIANTS = ("native", "avx2", "generic")
_FLAGS = {
    "avx2": ["-march=haswell", "-mfma", "-DFREETOKEN_OPS_NAMESPACE=freetoken_gguf_avx2"],
    "generic": ["-march=x86-64", "-DFREETOKEN_OPS_NAMESPACE=freetoken_gguf_generic"],
}


def _build(variant: str):
    """The ops of a copy of gguf_dequant.cpp built alone with the variant's flags."""
    from torch.utils import cpp_extension

    from freetoken_core.config import cache_dir
    from freetoken_core.kernels import _ensure_ninja_on_path

    namespace = f"freetoken_gguf_{variant}"
    ops = getattr(torch.ops, namespace)
    if hasattr(ops, "gguf_dequantize"):
        return ops
    flags = ["-O3", *_FLAGS[variant], "-fopenmp", "-ffp-contract=off", "-fvisibility=hidden"]
    digest = hashlib.sha256()
    for src in [CSRC / "gguf_dequant.cpp", *sorted(CSRC.glob("*.h"))]:
        digest.update(src.read_bytes())
    digest.update(" ".join(flags).encode() + torch.__version__.encode())
    build = cache_dir() / "kernels" / f"test-gguf-types-{variant}-{digest.hexdigest()[:16]}"
    library = build / f"{namespace}.so"
    if library.exists():
        torch.ops.load_library(str(library))
    else:
        _ensure_ninja_on_path()
        build.mkdir(parents=True, exist_ok=True)
        print(f"building {namespace} into {build}", file=sys.stderr, flush=True)
        cpp_extension.load(name=namespace, sources=[str(CSRC / "gguf_dequant.cpp")],
                           extra_include_paths=[str(CSRC)], build_directory=str(build),
                           extra_cflags=flags, extra_ldflags=["-fopenmp"],
                           is_python_module=False, verbose=False)
    return ops


@pytest.fixture(scope="module", params=VARIANTS)
def ops(request: pytest.FixtureRequest):
    if request.param == "native":
        return torch.ops.freetoken
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 builds only")
    lib = _build(request.param)
    assert lib.gguf_vector_lanes() == (8 if request.param == "avx2" else 0)
    return lib


def finite_halves(rng: np.random.Generator, n: int) -> np.ndarray:
    """n finite float16 bit patterns: half small normals (the usual scales), half uniform over
    every finite pattern (subnormals, +-0, up to 65504)."""
    small = (rng.standard_normal(n) * 0.01).astype(np.float16).view(np.uint16)
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    bits = np.where((bits & 0x7C00) == 0x7C00, bits & 0x83FF, bits)  # inf/nan -> exponent 0
    return np.where(rng.random(n) < 0.5, small, bits).astype(np.uint16)


def random_rows(rng: np.random.Generator, qtype: QT, n: int, units: int) -> np.ndarray:
    """n rows of `units` random units with finite scales, uint8 [n, units * bytes]."""
    _, nbytes, scales = UNITS[qtype]
    raw = rng.integers(0, 256, (n, units, nbytes), dtype=np.uint8)
    if qtype == QT.F16:
        raw = finite_halves(rng, n * units * 32).view(np.uint8).reshape(raw.shape)
    elif qtype == QT.BF16:
        bits = rng.integers(0, 1 << 16, (n, units, 32), dtype=np.uint16)
        bits = np.where((bits & 0x7F80) == 0x7F80, bits & 0x807F, bits)  # finite only
        raw = bits.view(np.uint8).reshape(raw.shape)
    elif qtype == QT.F32:
        bits = rng.integers(0, 1 << 32, (n, units, 32), dtype=np.uint32)
        bits = np.where((bits & 0x7F800000) == 0x7F800000, bits & 0x807FFFFF, bits)
        raw = bits.view(np.uint8).reshape(raw.shape)
    for offset in scales:
        raw[:, :, offset:offset + 2] = (
            finite_halves(rng, n * units).view(np.uint8).reshape(n, units, 2))
    if qtype == QT.MXFP4:
        # Any exponent byte, and a quarter of them the extremes: the subnormal scales 2^-128
        # and 2^-127 (e = 0, 1), and 2^126 and 2^127 (e = 254, 255), whose products with the
        # larger levels overflow to inf.
        extreme = rng.choice(np.array([0, 1, 254, 255], dtype=np.uint8), (n, units))
        raw[:, :, 0] = np.where(rng.random((n, units)) < 0.25, extreme, raw[:, :, 0])
    if qtype == QT.IQ1_M:
        raw = iq1_m_with_scales(raw.reshape(n * units, nbytes), finite_halves(rng, n * units))
    return np.ascontiguousarray(raw.reshape(n, units * nbytes))


def iq1_m_with_scales(blocks: np.ndarray, d: np.ndarray) -> np.ndarray:
    """IQ1_M blocks (uint8 ``[blocks, 56]``) with their float16 d set to the bit patterns
    ``d``: nibble k of d in the top 4 bits of the block's u16 scale k (at 48 + 2k), the 3-bit
    sub-block scales below them kept."""
    blocks = blocks.copy()
    scales = blocks[:, 48:56].copy().view(np.uint16) & 0x0FFF
    for k in range(4):
        scales[:, k] |= ((d.astype(np.uint16) >> (4 * k)) & 15) << 12
    blocks[:, 48:56] = scales.view(np.uint8)
    return blocks


def dequantized(raw: np.ndarray, qtype: QT) -> np.ndarray:
    """gguf-py's values of ``raw`` (MXFP4's largest scales overflow to inf, as numpy says)."""
    with np.errstate(over="ignore"):
        return quants.dequantize(raw, qtype)


def assert_bits_equal(got: torch.Tensor, want: np.ndarray) -> None:
    got_np = got.numpy()
    assert got_np.shape == want.shape and got_np.dtype == np.float32
    same = got_np.view(np.uint32) == np.ascontiguousarray(want, np.float32).view(np.uint32)
    if not same.all():
        where = np.argwhere(~same)[:5]
        pytest.fail(f"{(~same).sum()} of {same.size} weights differ, e.g. at {where.tolist()}: "
                    f"{got_np[tuple(where.T)]} vs {want[tuple(where.T)]}")


def test_unit_sizes_match_gguf_py() -> None:
    for qtype, (weights, nbytes, _) in UNITS.items():
        block, size = GGML_QUANT_SIZES[qtype]
        assert nbytes * block == size * weights, qtype.name


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_is_gguf_py_bit_for_bit(ops, qtype: QT) -> None:
    rng = np.random.default_rng(int(qtype))
    for units in (1, 3, 7):
        raw = random_rows(rng, qtype, 37, units)
        want = dequantized(raw, qtype)
        rows = torch.from_numpy(raw)
        for vector in (True, False):
            assert_bits_equal(ops.gguf_dequantize(rows, int(qtype), vector), want)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_embedding_selects_dequantized_rows(ops, qtype: QT) -> None:
    rng = np.random.default_rng(100 + int(qtype))
    raw = random_rows(rng, qtype, 50, 3)
    want = dequantized(raw, qtype)
    rows = torch.from_numpy(raw)
    ids = rng.integers(0, 50, 200)
    ids[:3] = (0, 49, 0)
    assert_bits_equal(ops.gguf_embedding(torch.from_numpy(ids), rows, int(qtype)), want[ids])
    # A row view with a row stride past its bytes (a slice of wider rows).
    wide = torch.from_numpy(np.concatenate([raw, raw[:, :UNITS[qtype][1]]], axis=1))
    narrow = wide[:, :raw.shape[1]]
    assert_bits_equal(ops.gguf_embedding(torch.from_numpy(ids[:7]), narrow, int(qtype)),
                      want[ids[:7]])
    assert ops.gguf_embedding(torch.zeros(0, dtype=torch.long), rows, int(qtype)).shape == (
        0, want.shape[1])
    for bad in (50, -1, 1 << 40):
        with pytest.raises(RuntimeError, match="out of range"):
            ops.gguf_embedding(torch.tensor([1, bad, 2]), rows, int(qtype))


@pytest.mark.skipif(sys.platform != "linux", reason="mprotect through ctypes: Linux")
def test_decoders_read_nothing_past_the_rows(ops) -> None:
    """The last unit of a tensor may end a mapped file: rows that end where an unreadable page
    begins decode without a fault (a read past them would kill the test process)."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    area = mmap.mmap(-1, 2 * page)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    base = ctypes.addressof(ctypes.c_char.from_buffer(area))
    assert libc.mprotect(base + page, page, 0) == 0, ctypes.get_errno()  # PROT_NONE
    try:
        rng = np.random.default_rng(7)
        for qtype in TYPES:
            raw = random_rows(rng, qtype, 1, 3)
            area[page - raw.size:page] = raw.tobytes()
            rows = torch.frombuffer(area, dtype=torch.uint8, count=raw.size,
                                    offset=page - raw.size).view(1, -1)
            want = dequantized(raw, qtype)
            for vector in (True, False):
                assert_bits_equal(ops.gguf_dequantize(rows, int(qtype), vector), want)
            assert_bits_equal(ops.gguf_embedding(torch.tensor([0, 0]), rows, int(qtype)),
                              want[[0, 0]])
            del rows
    finally:
        libc.mprotect(base + page, page, 3)  # PROT_READ | PROT_WRITE, then unmap


def test_bad_inputs_raise(ops) -> None:
    rows = torch.zeros(2, 36, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=r"GGUF type 34 \(TQ1_0\) has no decoder"):
        ops.gguf_dequantize(rows, 34, True)
    with pytest.raises(RuntimeError, match="not whole Q4_0 units of 18 bytes"):
        ops.gguf_dequantize(torch.zeros(2, 20, dtype=torch.uint8), int(QT.Q4_0), True)
    with pytest.raises(RuntimeError, match="not whole MXFP4 units of 17 bytes"):
        ops.gguf_dequantize(torch.zeros(2, 18, dtype=torch.uint8), int(QT.MXFP4), True)
    with pytest.raises(RuntimeError, match="uint8"):
        ops.gguf_dequantize(rows.float(), int(QT.Q8_0), True)
    with pytest.raises(RuntimeError, match="int64"):
        ops.gguf_embedding(torch.tensor([0], dtype=torch.int32), rows[:, :34], int(QT.Q8_0))


# The types gguf-py can quantize as well as dequantize.
QUANTIZABLE = [QT.F32, QT.F16, QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0,
               QT.MXFP4]


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_round_trip_through_gguf_py_quantize(ops, qtype: QT) -> None:
    rng = np.random.default_rng(200 + int(qtype))
    x = (rng.standard_normal((24, 7 * 32)) * rng.uniform(0.001, 2, (24, 1))).astype(np.float32)
    x[0, :32] = 0  # an all-zero block: d = 0 (MXFP4: e = 0, the smallest scale)
    raw = quants.quantize(x, qtype).view(np.uint8).reshape(24, -1)
    want = dequantized(raw, qtype)
    # (MXFP4's gguf-py quantizer: the largest level, 12 d, is 1.5 times the power of two
    # at or below a block's largest magnitude, which may be up to twice that power: an
    # error of up to a quarter of it)
    worst = 4 if qtype == QT.MXFP4 else 6
    np.testing.assert_allclose(want, x, rtol=0, atol=float(np.abs(x).max()) / worst)
    rows = torch.from_numpy(np.ascontiguousarray(raw))
    for vector in (True, False):
        assert_bits_equal(ops.gguf_dequantize(rows, int(qtype), vector), want)
