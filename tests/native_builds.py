"""Builds of the native kernels other than the CPU's default one: an AVX2 build of the linears
on an AVX-512 CPU (test_gguf_linear_avx2.py), the AMX path on emulated tiles
(test_int_linear_amx.py) and the whole library for the baseline x86-64
(test_portable_build.py). Each is cached under the kernel cache, keyed by the kernel sources,
and checked in a child process without the main build.

A fresh machine (CI) compiles them once, ~6 minutes of CPU on the 2-core reference; the test
suite leaves one of its two cores idle about half the time. So ``conftest.py`` starts the
builds the collected tests will need, at the lowest priority, in one background process
(``python tests/native_builds.py NAME...``) when collection ends; a test that reaches its
build first waits on torch's build lock and then loads what was built, or builds it itself
where the background has not begun it. ``FREETOKEN_TEST_BACKGROUND_BUILDS=0`` turns that off.
"""

from __future__ import annotations

import hashlib
import os
import platform
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "freetoken_core" / "kernels" / "csrc"
_BACKGROUND_ENV = "FREETOKEN_TEST_BACKGROUND_BUILDS"


def cpu_has(*flags: str) -> bool:
    """Whether /proc/cpuinfo lists every one of ``flags`` (False where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return all(f" {flag} " in text for flag in flags)


@dataclass(frozen=True)
class Build:
    """One extra build: its extension name, sources (under csrc/), compiler flags, the test
    file that checks it and the CPU flags that test needs."""

    module: str
    sources: tuple[str, ...]
    cflags: tuple[str, ...]
    test_file: str
    cpu_flags: tuple[str, ...]


BUILDS = {
    # gguf_linear.cpp and gguf_dequant.cpp (the decoders) and q8_linear.cpp for AVX2 + FMA
    "avx2-linear": Build("ft_avx2_linear",
                         ("gguf_linear.cpp", "gguf_dequant.cpp", "q8_linear.cpp"),
                         ("-O3", "-march=haswell", "-mfma", "-fopenmp", "-ffp-contract=off"),
                         "tests/test_gguf_linear_avx2.py", ("avx2", "fma")),
    # int_linear.cpp for the CPU at hand, each AMX tile instruction computed in software
    "amx-emulated": Build("ft_int_linear_amx_emulated", ("int_linear.cpp",),
                          ("-O2", "-march=native", "-fopenmp", "-ffp-contract=off",
                           "-DFREETOKEN_AMX_EMULATE"),
                          "tests/test_int_linear_amx.py", ("avx512_vnni", "avx512bw")),
}
# The whole kernel library for this -march (FREETOKEN_KERNEL_MARCH; kernels/__init__.py)
PORTABLE_MARCH = "x86-64"
PORTABLE_TEST = "tests/test_portable_build.py"


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


def wanted(test_files: set[str]) -> list[str]:
    """The builds that the collected ``test_files`` (paths relative to the repository) will
    make and that run on this machine; "portable" for the x86-64 library."""
    names = [name for name, spec in BUILDS.items()
             if spec.test_file in test_files and cpu_has(*spec.cpu_flags)]
    if PORTABLE_TEST in test_files and platform.machine() in ("x86_64", "AMD64"):
        names.append("portable")
    return names


def start_background(names: list[str], log: Path) -> subprocess.Popen | None:
    """The builds ``names``, one after another, in a background process at the lowest CPU
    priority (its own process group); None where turned off or there is nothing to build."""
    if not names or os.environ.get(_BACKGROUND_ENV, "1").lower() in ("0", "false", "no", "off"):
        return None
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        return subprocess.Popen([sys.executable, __file__, *names], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def stop_background(proc: subprocess.Popen | None) -> None:
    """End a background build still running at the end of the session: SIGINT to its group
    (torch's build lock is released on the way out), then SIGKILL after 30 s."""
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


_PORTABLE = """
from freetoken_core.kernels import cpu_kernels_available
assert cpu_kernels_available()
"""
_LOAD = """
import sys
sys.path.insert(0, sys.argv[1])
from native_builds import load_build
load_build(sys.argv[2])
"""

if __name__ == "__main__":
    # The background builds (start_background): each in a child, so that one failing (the
    # test that needs it reports the failure when it builds again) leaves the others; the
    # lowest priority, which the children inherit.
    os.nice(19)
    for name in sys.argv[1:]:
        if name == "portable":
            env = {**os.environ, "FREETOKEN_KERNEL_MARCH": PORTABLE_MARCH}
            command = [sys.executable, "-c", _PORTABLE]
        else:
            env = {**os.environ, "FREETOKEN_NATIVE_KERNELS": "0"}
            command = [sys.executable, "-c", _LOAD, str(Path(__file__).parent), name]
        done = subprocess.run(command, cwd=ROOT, env=env, check=False)
        print(f"{name}: exit {done.returncode}", flush=True)
