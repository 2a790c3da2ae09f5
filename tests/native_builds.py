"""Builds of kernel sources other than the CPU's default library, made and checked in a child
process without the main build: an AVX2 build of the linears on an AVX-512 CPU
(test_gguf_linear_avx2.py) and the AMX path on emulated tiles (test_int_linear_amx.py). Each
is cached under the kernel cache, keyed by the kernel sources."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "freetoken_core" / "kernels" / "csrc"


def cpu_has(*flags: str) -> bool:
    """Whether /proc/cpuinfo lists every one of ``flags`` (False where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return all(f" {flag} " in text for flag in flags)


@dataclass(frozen=True)
class Build:
    """One extra build: its extension name, sources (under csrc/), compiler flags and the
    CPU flags that its test needs."""

    module: str
    sources: tuple[str, ...]
    cflags: tuple[str, ...]
    cpu_flags: tuple[str, ...]


BUILDS = {
    # gguf_linear.cpp and gguf_dequant.cpp (the decoders) and q8_linear.cpp for AVX2 + FMA
    "avx2-linear": Build("ft_avx2_linear",
                         ("gguf_linear.cpp", "gguf_dequant.cpp", "q8_linear.cpp"),
                         ("-O3", "-march=haswell", "-mfma", "-fopenmp", "-ffp-contract=off"),
                         ("avx2", "fma")),
    # int_linear.cpp for the CPU at hand, each AMX tile instruction computed in software
    "amx-emulated": Build("ft_int_linear_amx_emulated", ("int_linear.cpp",),
                          ("-O2", "-march=native", "-fopenmp", "-ffp-contract=off",
                           "-DFREETOKEN_AMX_EMULATE"),
                          ("avx512_vnni", "avx512bw")),
}


def build_dir(name: str) -> Path:
    from freetoken_core.config import cache_dir

    digest = hashlib.sha256()
    for path in sorted(CSRC.glob("*")):
        digest.update(path.read_bytes())
    return cache_dir() / "kernels" / f"test-{name}-{digest.hexdigest()[:12]}"


def load_build(name: str) -> Path:
    """Build (first time; else wait for a build under way, or load) and load ``BUILDS[name]``
    into this process; returns its build directory."""
    from torch.utils import cpp_extension

    spec, build = BUILDS[name], build_dir(name)
    build.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(name=spec.module, build_directory=str(build),
                       sources=[str(CSRC / source) for source in spec.sources],
                       extra_cflags=list(spec.cflags), extra_ldflags=["-fopenmp"],
                       is_python_module=False, verbose=False)
    return build


def run_build_child(child: str) -> list[str]:
    """Run ``child`` (Python source) as ``python -c child TESTS_DIR`` and return its
    stdout's lines (the child calls ``load_build``). Skips the test where there is no
    compiler toolchain, fails it where the child fails."""
    import pytest

    env = {**os.environ, "FREETOKEN_NATIVE_KERNELS": "0"}
    done = subprocess.run([sys.executable, "-c", child, str(Path(__file__).parent)], env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    if "ninja" in done.stderr and "not found" in done.stderr:  # pragma: no cover
        pytest.skip("no compiler toolchain")
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()
