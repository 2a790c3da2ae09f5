"""Native CPU kernels (C++ in ``csrc/``), built on first use and loaded as ``torch.ops.freetoken``.

Attention over the paged KV cache, the fused element-wise layers of a block, linears
computed from a GGUF file's Q4_1/Q8_0 blocks, a whole block in one call, and the sampler's
draw. They are compiled once per machine,
torch version, CPU and source into ``$FREETOKEN_CACHE/kernels/`` (~80 s on two cores) with the
system C++ compiler and ninja, for the CPU at hand (``-march=native``), and run on ATen's
own thread pool. Everything they do has a torch path too: where they cannot be built (no
compiler) FreeToken logs it once and runs the torch path; ``FREETOKEN_NATIVE_KERNELS=0``
switches them off.

``FREETOKEN_KERNEL_MARCH`` (default ``native``) builds them for another GCC ``-march``
target instead, one the CPU runs (e.g. ``x86-64-v3`` or ``znver3``: AVX2 and FMA, no
AVX-512): the AVX2 kernels and what the engine picks with them (float32 where VNNI would
give int24, the AVX2 q8 kernels) then run on an AVX-512 machine, to test or time them
there; ``x86-64`` builds the portable scalar paths, which CPUs without AVX2 run (aarch64's
too; tests/test_portable_build.py). Each target gets its own build directory.

Where the build and the CPU have AMX (the int24 kernel's tiles, from 8 rows), a child process
first runs a few tile products against the VNNI path, once per build (the verdict is kept in
the build directory): some VMs list AMX but trap its instructions, which would kill the
engine at its first prefill. Where the child dies or its floats differ, the tiles stay off
and VNNI computes every row count (the same floats, slower from 8 rows);
``FREETOKEN_AMX=0`` turns them off without a probe.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import torch

log = logging.getLogger("freetoken.kernels")

_SOURCES = ("paged_attention.cpp", "layers.cpp", "gguf_linear.cpp", "int_linear.cpp",
            "q8_linear.cpp", "llama_layer.cpp", "sampler.cpp", "gguf_dequant.cpp", "moe.cpp",
            "gguf_heads.cpp")
_ENV = "FREETOKEN_NATIVE_KERNELS"
_MARCH_ENV = "FREETOKEN_KERNEL_MARCH"
_NAME = "freetoken_cpu"
_AMX_ENV = "FREETOKEN_AMX"
_AMX_VERDICT = "amx-probe.txt"
_AMX_PROBE_TIMEOUT_S = 120
# The probe: int24 linears of 16 rows on the tiles (mode 0) and on VNNI (mode 2), for Q8_0
# (signed weights: TDPBSSD, TDPBUSD) and Q4_1 (unsigned: TDPBSUD, TDPBUUD), random weights
# with finite scales in the kernel layout (Q8_0: a float16 scale and 32 int8; Q4_1: float32
# scale and min, 16 bytes of nibbles).
_AMX_PROBE = r"""
import sys
import torch
torch.ops.load_library(sys.argv[1])
ops = torch.ops.freetoken
gen = torch.Generator().manual_seed(0)
n, k, rows, blocks = 32, 256, 16, 256 // 32
def full(value, dtype):
    return torch.full((n, blocks, 1), value, dtype=dtype).view(torch.uint8)
def random(width):
    return torch.randint(0, 256, (n, blocks, width), generator=gen, dtype=torch.uint8)
q8_0 = torch.cat([full(0.01, torch.float16), random(32)], -1)
q4_1 = torch.cat([full(0.01, torch.float32), full(-0.05, torch.float32), random(16)], -1)
x = torch.randn(rows, k, generator=gen)
for qtype, kernel in ((8, q8_0), (3, q4_1)):
    laid = ops.gguf_int_blocks(kernel.reshape(n, -1).contiguous(), qtype)
    tiles, vnni = torch.empty(rows, n), torch.empty(rows, n)
    ops.gguf_linear_int(x, laid, qtype, tiles, 0)
    ops.gguf_linear_int(x, laid, qtype, vnni, 2)
    if not torch.equal(tiles, vnni):
        print(f"the tiles' floats differ from VNNI's (ggml type {qtype})")
        sys.exit(3)
print("ok")
"""


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
        print(f"freetoken: building the native CPU kernels into {build} (once, ~1-2 min)",
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
    _check_amx(build, library)
    return True


def _check_amx(build: Path, library: Path) -> None:
    """Keep the AMX tiles only where they run and agree with VNNI (the module's docstring):
    the verdict of ``probe_amx``, kept in ``build`` (a probe a build), or ``FREETOKEN_AMX=0``."""
    ops = torch.ops.freetoken
    if not list(ops.gguf_int_amx_types()):
        return  # no tiles in this build or on this CPU
    if os.environ.get(_AMX_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        ops.gguf_int_amx_allow(False)
        return
    path = build / _AMX_VERDICT
    try:
        verdict = path.read_text().strip()
    except OSError:
        verdict = probe_amx(library)
        try:
            path.write_text(verdict + "\n")
        except OSError:  # a read-only cache: probe again next time
            pass
    if verdict != "ok":
        ops.gguf_int_amx_allow(False)
        log.warning("AMX tiles off: %s; the int24 kernel computes every row count on AVX-512 "
                    "VNNI (the same floats). Delete %s to probe again, or set %s=0 to skip "
                    "the probe.", verdict, path, _AMX_ENV)


def probe_amx(library: Path) -> str:
    """``"ok"`` where a child process that loads ``library`` computes int24 linears on the
    AMX tiles with VNNI's floats; else what went wrong (the signal that killed it, or its
    last words)."""
    try:
        done = subprocess.run([sys.executable, "-c", _AMX_PROBE, str(library)],
                              capture_output=True, text=True, timeout=_AMX_PROBE_TIMEOUT_S,
                              check=False)
    except subprocess.TimeoutExpired:
        return f"a probe process running them did not finish in {_AMX_PROBE_TIMEOUT_S} s"
    lines = (done.stdout + done.stderr).strip().splitlines()
    if done.returncode == 0 and lines and lines[-1] == "ok":
        return "ok"
    if done.returncode < 0:
        try:
            name = signal.Signals(-done.returncode).name
        except ValueError:
            name = str(-done.returncode)
        return f"a probe process running them died of {name}"
    return (f"a probe process running them failed (exit {done.returncode}: "
            f"{lines[-1] if lines else 'no output'})")
