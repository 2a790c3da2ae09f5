"""What the Triton plugins' tests share: the device their kernels run on, a check on every
launch, and a check that a kernel imports lazily and compiles for CUDA.

On a CUDA machine the kernel tests hand CUDA tensors to the compiled kernels; elsewhere CPU
tensors to Triton's interpreter, which ``conftest.py`` selects (``TRITON_INTERPRET=1``)
before triton is first imported. Either way every launch passes ``enable_fp_fusion=False``:
compiled Triton otherwise contracts ``a - b * c`` into one FMA (rounded once), while torch
rounds the product and the difference apart, so the Triton paths would differ from the torch
paths by a rounding. Without contraction each kernel op rounds as torch's does (IEEE
round-to-nearest, no flush of subnormals), and the tests compare the paths with
``torch.equal`` on both machines.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch

KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
"""Where the kernel tests place their tensors (through the ``kernel_device`` fixture)."""


def check_every_launch(monkeypatch: pytest.MonkeyPatch, device: torch.device) -> None:
    """Until the test ends, every Triton launch (``kernel[grid](...)``) asserts that it
    passes ``enable_fp_fusion=False`` and that its tensors all live on ``device``: on CUDA a
    CPU tensor left behind fails here by name, not as a fault inside the kernel; on the CPU
    this is how a test sees the launch option the interpreter ignores."""
    from triton.runtime.jit import KernelInterface

    launch = KernelInterface.__getitem__

    def checked(kernel: Any, grid: Any) -> Any:
        run = launch(kernel, grid)
        name = getattr(kernel, "__name__", repr(kernel))

        def checked_run(*args: Any, **kwargs: Any) -> Any:
            assert kwargs.get("enable_fp_fusion") is False, (
                f"{name} is launched without enable_fp_fusion=False: compiled, it would "
                f"round a - b * c once (FMA), unlike the torch path")
            named = list(enumerate(args)) + list(kwargs.items())
            misplaced = [f"{key}: {arg.device}" for key, arg in named
                         if isinstance(arg, torch.Tensor) and arg.device.type != device.type]
            assert not misplaced, f"{name} launched on {device} with tensors {misplaced}"
            return run(*args, **kwargs)

        return checked_run

    monkeypatch.setattr(KernelInterface, "__getitem__", checked)


def assert_kernel_is_lazy_and_compiles(module: str, signature: dict[str, str],
                                       constexprs: dict[str, int],
                                       kernel: str = "_kernel()") -> None:
    """In a fresh process without TRITON_INTERPRET: importing ``module`` imports no triton,
    and its ``kernel`` (an expression on the module) compiles to cubin for sm_90 (Triton's
    bundled ptxas, no GPU) with ``enable_fp_fusion=False``, as the launches pass it, into
    PTX without a single FMA."""
    code = f"""
import sys
import {module} as plugin
print("triton" in sys.modules)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
source = ASTSource(plugin.{kernel}, {signature!r}, constexprs={constexprs!r})
compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={{"enable_fp_fusion": False}})
print(sorted(compiled.asm))
print([line.strip() for line in compiled.asm["ptx"].splitlines() if "fma." in line])
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=False)
    if "No module named 'triton'" in out.stderr:
        pytest.skip("triton is not installed")
    assert out.returncode == 0, out.stderr[-3000:]
    lazy, stages, fmas = out.stdout.splitlines()[:3]
    assert lazy == "False" and "'cubin'" in stages
    assert fmas == "[]", f"FMAs in the PTX: {fmas}"
