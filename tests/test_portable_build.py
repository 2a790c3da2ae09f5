"""The native kernels built for the baseline x86-64 (no AVX2, no FMA): the portable scalar
paths, which every CPU without AVX2 runs (aarch64's among them: Apple silicon, Graviton).

The main build is for the CPU at hand, so on the x86 machines the tests run on, the scalar
linears never run in the other tests. Here a child pytest process runs with
``FREETOKEN_KERNEL_MARCH=x86-64`` (the whole kernel library built for that target, cached
under the kernel cache like any build) over the tests that hold the GGUF paths to their
references: each architecture's greedy tokens against transformers' (test_gguf_archs.py),
every type's float32 kernel against float64 and its decoders bit for bit
(test_gguf_linear_types.py), and the 8-bit-activation kernels and a model on them
(test_q8_linear_types.py). A decode step runs every block in one team of threads
(``llama_layers``), whose kernels must share their work through parallel.h: the scalar
linears once called ``at::parallel_for`` there, which runs the whole linear on every member,
one still writing outputs that another had gone on to rewrite in place (the default model
answered "The capital of France is" with nothing, then garbage). ~2 minutes on the 2-core
reference, most of it the build."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

from freetoken_core.kernels import cpu_kernels_available

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
# The build's vector lanes (0: the scalar decoders), which also builds it.
LANES = """
import torch
from freetoken_core.kernels import cpu_kernels_available
assert cpu_kernels_available()
print(torch.ops.freetoken.gguf_vector_lanes())
"""
TESTS = ["tests/test_gguf_archs.py", "tests/test_gguf_linear_types.py",
         "tests/test_q8_linear_types.py"]


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                    reason="elsewhere the main build is the portable one")
def test_the_portable_build_serves_gguf_models_exactly() -> None:
    if not cpu_kernels_available():
        pytest.skip("no native kernels here (no compiler toolchain)")
    env = {**os.environ, "FREETOKEN_KERNEL_MARCH": "x86-64"}
    lanes = subprocess.run([sys.executable, "-c", LANES], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=900, check=False)
    assert lanes.returncode == 0, lanes.stderr[-3000:]
    assert lanes.stdout.split() == ["0"], "the x86-64 build has vector decoders"
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                           *TESTS], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-6000:]
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed and int(passed.group(1)) >= 40, done.stdout[-2000:]
