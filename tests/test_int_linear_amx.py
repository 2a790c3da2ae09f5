"""The int24 kernel's AMX path, on CPUs that have no AMX: its code built with the tile
instructions computed in software (``csrc/amx_emulation.h``, ``-DFREETOKEN_AMX_EMULATE``).

The AMX tiles run the int24 kernel's linears from a few rows on the Intel Xeon (Sapphire
Rapids and later); elsewhere the main build has no AMX code, so the tests of
test_native_kernels.py never reach it. Here int_linear.cpp is built for the CPU at hand (it
needs AVX-512 VNNI, as the AMX path's vector half does) with each tile instruction emulated as
Intel's SDM defines it, in a child process without the main build, and for every type the
tiles take, the AMX path (mode 0 from ``kAmxRows`` rows) gives the scalar reference's floats
(mode 1) at row counts around the tile's 16, for a linear of one type and for a linear of
parts. A tile shape the hardware would refuse fails the emulation with a message. The build is
cached under the kernel cache; a few seconds of emulated tiles."""

from __future__ import annotations

import pytest
from native_builds import BUILDS, cpu_has, run_build_child

CHILD = r'''
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, sys.argv[1])
from native_builds import load_build  # noqa: E402

build = load_build("amx-emulated")
from gguf_models import random_blocks  # noqa: E402

from freetoken_core.models.block_layout import KIND_PARTS, kernel_blocks, parts_blocks  # noqa: E402

amx = list(torch.ops.freetoken.gguf_int_amx_types())
print("amx types:", ",".join(map(str, amx)))


def int_blocks(qtype, n, k, seed):
    raw = random_blocks(np.random.default_rng(seed), qtype, n, k)
    return torch.ops.freetoken.gguf_int_blocks(kernel_blocks(torch.from_numpy(raw), qtype),
                                               qtype)


def run(x, blocks, qtype, n, mode):
    out = torch.empty(x.shape[0], n)
    torch.ops.freetoken.gguf_linear_int(x.contiguous(), blocks, qtype, out, mode)
    return out


failed = []
gen = torch.Generator().manual_seed(0)
for qtype in amx:
    n, k = 48, 512
    blocks = int_blocks(qtype, n, k, qtype)
    x = torch.randn(40, k, generator=gen) * torch.exp(torch.randn(40, k, generator=gen))
    x[3, :64] = 0
    reference = run(x, blocks, qtype, n, 1)
    for rows in (8, 9, 15, 16, 17, 33, 40):
        if not torch.equal(run(x[:rows], blocks, qtype, n, 0), reference[:rows]):
            failed.append(f"{qtype}@{rows}")
# A linear of parts (a Q4_K_M q/k/v: two parts of one type, one of another where both
# have tiles; else the first two tile types).
kinds = [t for t in (12, 14) if t in amx] or amx[:2]
if len(kinds) == 2:
    k = 512
    spec = [(kinds[0], 32, 1), (kinds[0], 16, 2), (kinds[1], 16, 3)]
    raws = [(t, kernel_blocks(torch.from_numpy(random_blocks(np.random.default_rng(s), t, n, k)),
                              t)) for t, n, s in spec]
    from freetoken_core.models.block_layout import int_blocks as layout  # noqa: E402
    blocks = layout(parts_blocks(raws), KIND_PARTS)
    x = torch.randn(20, k, generator=gen)
    if not torch.equal(run(x, blocks, KIND_PARTS, 64, 0), run(x, blocks, KIND_PARTS, 64, 1)):
        failed.append("parts")
# Turned off (kernels/__init__.py: FREETOKEN_AMX=0, or the probe's verdict), mode 0 computes
# on VNNI: no tile types, the same floats.
import os  # noqa: E402
import tempfile  # noqa: E402

from freetoken_core import kernels  # noqa: E402

library = build / "ft_int_linear_amx_emulated.so"
blocks, qtype = int_blocks(8, 48, 512, 8), 8
x = torch.randn(16, 512, generator=gen)
reference = run(x, blocks, qtype, 48, 1)
torch.ops.freetoken.gguf_int_amx_allow(False)
print("off:", list(torch.ops.freetoken.gguf_int_amx_types()),
      torch.equal(run(x, blocks, qtype, 48, 0), reference))
torch.ops.freetoken.gguf_int_amx_allow(True)
print("probe:", kernels.probe_amx(library))
print("probe of no library:", kernels.probe_amx(build / "missing.so"))
with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    kernels._check_amx(tmp, library)
    print("verdict kept:", (tmp / "amx-probe.txt").read_text().strip(),
          bool(list(torch.ops.freetoken.gguf_int_amx_types())))
    (tmp / "amx-probe.txt").write_text("a probe process running them died of SIGILL\n")
    kernels._check_amx(tmp, library)
    print("verdict trap:", list(torch.ops.freetoken.gguf_int_amx_types()))
    torch.ops.freetoken.gguf_int_amx_allow(True)
    (tmp / "amx-probe.txt").unlink()
    os.environ["FREETOKEN_AMX"] = "0"
    kernels._check_amx(tmp, library)
    print("env off:", list(torch.ops.freetoken.gguf_int_amx_types()),
          (tmp / "amx-probe.txt").exists())
print("failed:", ",".join(failed) or "none")
'''


@pytest.mark.skipif(not cpu_has(*BUILDS["amx-emulated"].cpu_flags),
                    reason="the AMX path's vector half needs AVX-512 VNNI")
def test_the_amx_path_on_emulated_tiles_gives_the_scalar_floats() -> None:
    """Every tile type against the scalar reference; then the switch that turns the tiles
    off, and kernels/__init__.py's probe of them in a child process and its verdict."""
    lines = run_build_child(CHILD)
    amx = lines[0].removeprefix("amx types:").strip()
    assert amx, "the emulated build has no AMX path"
    assert lines[-1] == "failed: none", "\n".join(lines)
    said = dict(line.split(": ", 1) for line in lines[1:-1])
    # gguf_int_amx_allow(False): no tile types, and mode 0 gives the scalar floats on VNNI
    assert said["off"] == "[] True", said
    # kernels.probe_amx: a child loads the library, runs tiles against VNNI: agreed here; a
    # child that cannot load it says so
    assert said["probe"] == "ok", said
    assert said["probe of no library"].startswith("a probe process running them failed"), said
    # kernels._check_amx keeps the verdict in the build directory and turns the tiles off on
    # a verdict other than ok, or on FREETOKEN_AMX=0 (without probing)
    assert said["verdict kept"] == "ok True", said
    assert said["verdict trap"] == "[]", said
    assert said["env off"] == "[] False", said
