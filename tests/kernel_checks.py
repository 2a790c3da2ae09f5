"""A check the Triton plugins' tests share: lazy import, and compilation for CUDA."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def assert_kernel_is_lazy_and_compiles(module: str, signature: dict[str, str],
                                       constexprs: dict[str, int]) -> None:
    """In a fresh process without TRITON_INTERPRET: importing ``module`` imports no triton,
    and its ``_kernel()`` compiles to cubin for sm_90 (Triton's bundled ptxas, no GPU)."""
    code = f"""
import sys
import {module} as plugin
print("triton" in sys.modules)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
source = ASTSource(plugin._kernel(), {signature!r}, constexprs={constexprs!r})
print(sorted(triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=False)
    if "No module named 'triton'" in out.stderr:
        pytest.skip("triton is not installed")
    assert out.returncode == 0, out.stderr[-3000:]
    lazy, stages = out.stdout.splitlines()[:2]
    assert lazy == "False" and "'cubin'" in stages
