"""Native CPU kernels (C++ in ``csrc/``), built on first use and loaded as ``torch.ops.freetoken``.

Attention over the paged KV cache, the fused element-wise layers of a block, linears
computed from a GGUF file's Q4_1/Q8_0 blocks, a whole block in one call, and the sampler's
draw. They are compiled once per machine,
torch version, CPU and source into ``$FREETOKEN_CACHE/kernels/`` (about 15 s) with the
system C++ compiler and ninja, for the CPU at hand (``-march=native``), and run on ATen's
own thread pool. Everything they do has a torch path too: where they cannot be built (no
compiler) FreeToken logs it once and runs the torch path; ``FREETOKEN_NATIVE_KERNELS=0``
switches them off.

``FREETOKEN_KERNEL_MARCH`` (default ``native``) builds them for another GCC ``-march``
target instead, one the CPU runs (e.g. ``x86-64-v3`` or ``znver3``: AVX2 and FMA, no
AVX-512): the AVX2 kernels and what the engine picks with them (float32 where VNNI would
give int24, the AVX2 q8 kernels) then run on an AVX-512 machine, to test or time them
there. Each target gets its own build directory.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import sys
from pathlib import Path

import torch

log = logging.getLogger("freetoken.kernels")

_SOURCES = ("paged_attention.cpp", "layers.cpp", "gguf_linear.cpp", "int_linear.cpp",
            "q8_linear.cpp", "llama_layer.cpp", "sampler.cpp", "gguf_dequant.cpp")
_ENV = "FREETOKEN_NATIVE_KERNELS"
_MARCH_ENV = "FREETOKEN_KERNEL_MARCH"
_NAME = "freetoken_cpu"


def kernel_march() -> str:
    """The ``-march`` the kernels are built for: ``$FREETOKEN_KERNEL_MARCH``, else ``native``.
    Raises ``ValueError`` for a value that is not a plain target name."""
    march = os.environ.get(_MARCH_ENV, "").strip() or "native"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]*", march):
        raise ValueError(f"{_MARCH_ENV}={march!r} is not a -march target name "
                         "(e.g. native, x86-64-v3, znver3)")
    return march


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build_dir(sources: list[Path]) -> Path:
    from freetoken_core.config import cache_dir

    digest = hashlib.sha256()
    for src in [*sources, *sources[0].parent.glob("*.h")]:
        digest.update(src.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(platform.machine().encode())
    digest.update(_cpu_flags().encode())
    march = kernel_march()
    if march != "native":  # (native builds keep the directories they had)
        digest.update(f"-march={march}".encode())
    return cache_dir() / "kernels" / digest.hexdigest()[:16]


def _ensure_ninja_on_path() -> None:
    if shutil.which("ninja"):
        return
    import ninja  # the PyPI package ships the binary; its directory is not on PATH in a venv

    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@functools.cache
def cpu_kernels_available() -> bool:
    """Build (first time) and load the CPU kernels; ``False`` where they cannot be had."""
    if os.environ.get(_ENV, "1").lower() in ("0", "false", "no", "off"):
        return False
    if hasattr(torch.ops.freetoken, "llama_layer"):
        return True
    sources = [Path(__file__).parent / "csrc" / name for name in _SOURCES]
    try:
        build = _build_dir(sources)
        library = build / f"{_NAME}.so"
        if library.exists():
            # Built before for these sources, this torch and this CPU: load, no ninja run.
            torch.ops.load_library(str(library))
            return True
        from torch.utils import cpp_extension

        _ensure_ninja_on_path()
        build.mkdir(parents=True, exist_ok=True)
        print(f"freetoken: building the native CPU kernels into {build} (once, ~15 s)",
              file=sys.stderr, flush=True)
        cpp_extension.load(
            name=_NAME, sources=[str(s) for s in sources],
            build_directory=str(build),
            # -fopenmp: ATen's parallel_for is inline OpenMP; without the flag it runs on
            # one thread. libgomp.so.1 resolves to the copy torch has already loaded.
            # -ffp-contract=off: round where the torch formulas round (no implicit FMA).
            extra_cflags=["-O3", f"-march={kernel_march()}", "-fopenmp",
                          "-ffp-contract=off"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False, verbose=False)
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the torch path
        log.warning("native CPU kernels unavailable, using the torch path (%s: %s); set "
                    "%s=0 to skip the build", type(exc).__name__, str(exc).splitlines()[0]
                    if str(exc) else "", _ENV)
        return False
    return True
