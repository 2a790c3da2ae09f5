"""Builds of the native kernels other than the CPU's default one, made and checked in a child
process (without the main build): what test_gguf_linear_avx2.py (an AVX2 build on an AVX-512
CPU) and test_int_linear_amx.py (the AMX path on emulated tiles) share. Each build is cached
under the kernel cache, keyed by the kernel sources."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from freetoken_core.config import cache_dir

CSRC = Path(__file__).resolve().parents[1] / "freetoken_core" / "kernels" / "csrc"


def cpu_has(*flags: str) -> bool:
    """Whether /proc/cpuinfo lists every one of ``flags`` (False where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return all(f" {flag} " in text for flag in flags)


def run_build_child(child: str, name: str) -> list[str]:
    """Run ``child`` (Python source) as ``python -c child BUILD_DIR CSRC TESTS_DIR`` and return
    its stdout's lines; skips the test where there is no compiler toolchain, fails it where
    the child fails."""
    digest = hashlib.sha256()
    for path in sorted(CSRC.glob("*")):
        digest.update(path.read_bytes())
    build = cache_dir() / "kernels" / f"test-{name}-{digest.hexdigest()[:12]}"
    env = {**os.environ, "FREETOKEN_NATIVE_KERNELS": "0"}
    done = subprocess.run([sys.executable, "-c", child, str(build), str(CSRC),
                           str(Path(__file__).parent)], env=env, capture_output=True,
                          text=True, timeout=900, check=False)
    if "ninja" in done.stderr and "not found" in done.stderr:  # pragma: no cover
        pytest.skip("no compiler toolchain")
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()
