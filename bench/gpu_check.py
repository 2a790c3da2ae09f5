"""GPU readiness: the checks of ``bench/gpu_check.sh`` and their one table.

On a CUDA machine (expected: a few minutes; each check has a time limit, 520 s all together,
so the run stays under 8 minutes):

1. every Triton kernel test on CUDA tensors: ``pytest -m gpu`` over the test modules that
   use ``kernel_device`` or compile a kernel for CUDA;
2. the engine against transformers, greedy, float32 on CUDA (``pytest -m gpu
   tests/test_model_exactness.py``);
3. decode tok/s at 1, 16 and 64 sequences, bfloat16, for the default model and for a
   1B-shaped random-weight Llama (``bench/gpu_decode.py``, each in its own process);
4. tensor parallelism's group of one rank over NCCL: its collectives, and a model built as
   a rank's part equal to the plain one (``bench/gpu_nccl.py``).

Without CUDA each of those says ``skipped: no CUDA device``, and what proves this script
works runs on the CPU instead: a few kernel tests under ``TRITON_INTERPRET=1``, the CUDA
exactness tests collected (and skipped), and the decode code on a tiny random model.

    python bench/gpu_check.py [--quick]

``--quick`` leaves out the CPU kernel tests (the test suite runs them all anyway). Exits 1
when a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NO_CUDA = "no CUDA device"
CPU_KERNEL_TESTS = ["tests/test_plugin_min_p.py", "-k", "triton_matches_torch"]
"""The CPU run's sample of the kernel tests: the min-p kernel under the interpreter."""


@dataclass
class Result:
    name: str
    device: str
    status: str  # passed, failed or skipped
    seconds: float | None
    figures: str


def kernel_test_files() -> list[str]:
    """The test modules with a Triton kernel test: they take ``kernel_device`` or compile a
    kernel for CUDA (``kernel_checks.assert_kernel_is_lazy_and_compiles``)."""
    files = []
    for path in sorted((ROOT / "tests").glob("**/test_*.py")):
        text = path.read_text()
        if "kernel_device" in text or "assert_kernel_is_lazy_and_compiles" in text:
            files.append(str(path.relative_to(ROOT)))
    return files


def run(name: str, args: list[str], timeout: float, env: dict[str, str]
        ) -> tuple[str, float, str]:
    """Run ``python *args`` (this interpreter) under ``timeout``: its status, seconds and
    combined output."""
    print(f"[{name}] python {' '.join(args)}", flush=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, timeout=timeout,
                              capture_output=True, text=True, check=False)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or b""  # bytes even with text=True
        print((out.decode(errors="replace") if isinstance(out, bytes) else out)[-6000:])
        return "failed", time.perf_counter() - start, f"timed out after {timeout:.0f} s"
    seconds = time.perf_counter() - start
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        print(out[-6000:], flush=True)
        return "failed", seconds, out
    return "passed", seconds, out


def pytest_check(name: str, device: str, args: list[str], timeout: float,
                 env: dict[str, str]) -> Result:
    """A pytest run as a check: passed when pytest passes with at least one test passed,
    skipped when every test skipped, else failed; its figures are pytest's counts."""
    cmd = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", *args]
    status, seconds, out = run(name, cmd, timeout, env)
    lines = [ln.strip("= ") for ln in out.splitlines()
             if re.search(r"\d+ (passed|failed|skipped|errors?|deselected)", ln)]
    counts = re.sub(r" in [\d.]+s.*", "", lines[-1]) if lines else out.strip()[-200:]
    if status == "passed" and "passed" not in counts:
        status = "skipped" if "skipped" in counts else "failed"
    return Result(name, device, status, seconds, counts)


def decode_check(name: str, device: str, args: list[str], timeout: float,
                 env: dict[str, str]) -> Result:
    cmd = ["bench/gpu_decode.py", "--device", device, *args]
    status, seconds, out = run(name, cmd, timeout, env)
    if status != "passed":
        return Result(name, device, status, seconds, out.strip().splitlines()[-1][-200:]
                      if out.strip() else "no output")
    report = json.loads(out.strip().splitlines()[-1])
    rates = ", ".join(f"{k}: {v:.0f}" for k, v in report["tok_s"].items())
    figures = f"{report['label']}, {report['dtype']}; tok/s {rates}; load {report['load_s']} s"
    return Result(name, device, status, seconds, figures)


def nccl_check(name: str, device: str, timeout: float, env: dict[str, str]) -> Result:
    status, seconds, out = run(name, ["bench/gpu_nccl.py", "--device", device], timeout, env)
    last = out.strip().splitlines()[-1] if out.strip() else ""
    if not last.startswith("{"):
        return Result(name, device, "failed" if status == "passed" else status, seconds,
                      last[-200:] or "no output")
    report = json.loads(last)
    figures = (f"{report['backend']}; collectives {'ok' if report['collectives_ok'] else 'WRONG'}"
               f", logits diff {report['logits_max_diff']}; all_reduce "
               f"{report['all_reduce_us']} us, gather {report['gather_us']} us, broadcast "
               f"{report['broadcast_us']} us")
    return Result(name, device, status, seconds, figures)


def skipped(name: str) -> Result:
    print(f"[{name}] skipped: {NO_CUDA}", flush=True)
    return Result(name, "cuda", "skipped", None, NO_CUDA)


def cuda_checks(env: dict[str, str]) -> list[Result]:
    # Compiled kernels on CUDA tensors: the interpreter must stay off.
    env = {k: v for k, v in env.items() if k != "TRITON_INTERPRET"}
    return [
        pytest_check("kernel tests", "cuda", kernel_test_files(), 170, env),
        pytest_check("exactness vs transformers (fp32)", "cuda",
                     ["tests/test_model_exactness.py"], 90, env),
        # The default model's first use converts its GGUF file into the cache (~15 s).
        decode_check("decode, default model", "cuda", ["--model", "default"], 90, env),
        decode_check("decode, 1B-shaped Llama", "cuda", ["--model", "1b"], 110, env),
        nccl_check("tensor-parallel group, TP=1", "cuda", 60, env),
    ]


def cpu_checks(env: dict[str, str], quick: bool) -> list[Result]:
    results = [skipped("kernel tests")]
    if not quick:
        results.append(pytest_check("kernel tests, a sample (TRITON_INTERPRET=1)", "cpu",
                                    CPU_KERNEL_TESTS, 120, env | {"TRITON_INTERPRET": "1"}))
    exactness = pytest_check("exactness vs transformers (fp32)", "cuda",
                             ["tests/test_model_exactness.py"], 120, env)
    if exactness.status == "skipped":
        print(f"[{exactness.name}] skipped: {NO_CUDA} ({exactness.figures})", flush=True)
        exactness.figures = f"{NO_CUDA} ({exactness.figures})"
    results += [exactness, skipped("decode, default model"), skipped("decode, 1B-shaped Llama"),
                decode_check("decode code path, tiny model", "cpu",
                             ["--model", "tiny", "--dtype", "float32", "--prompt-len", "8",
                              "--warmup", "2", "--steps", "4"], 120, env),
                skipped("tensor-parallel group, TP=1"),
                nccl_check("tensor-parallel group code path", "cpu", 60, env)]
    return results


def print_table(results: list[Result]) -> None:
    rows = [("check", "device", "result", "time", "figures")]
    rows += [(r.name, r.device, r.status, "-" if r.seconds is None else f"{r.seconds:.0f} s",
              r.figures) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    print()
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[4])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="leave out the CPU run's kernel tests")
    args = parser.parse_args()
    import torch

    cuda = torch.cuda.is_available()
    where = torch.cuda.get_device_name(0) if cuda else NO_CUDA
    print(f"GPU check: Python {sys.version.split()[0]}, torch {torch.__version__}, {where}",
          flush=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    start = time.perf_counter()
    results = cuda_checks(env) if cuda else cpu_checks(env, args.quick)
    print_table(results)
    failed = [r.name for r in results if r.status == "failed"]
    print(f"\n{len(results) - len(failed)} of {len(results)} checks passed or skipped, "
          f"{len(failed)} failed, in {time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
