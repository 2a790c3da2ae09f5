"""The two servers of ``bench/vs_llamacpp.py``: their commands, finding ``llama-server``, and
starting, stopping and sizing up a server process."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

PROMPT_ROOM = 128
"""Context tokens per llama.cpp slot beyond ``max_tokens``: the prompt's room."""
MIN_CONTEXT = 16384
BUILD_HINT = ("llama-server not found. Build it (CPU, a few minutes to half an hour):\n"
              "    bash bench/build_llama_server.sh\n"
              "then pass the path it prints last with --llama-server PATH or $LLAMA_SERVER.")


class BenchError(RuntimeError):
    """A server that does not start, a request that fails, a client count over its time:
    the side stops there, the other still runs, and the script exits 1."""


def find_llama_server(path: str | None) -> str:
    """``path``, else ``$LLAMA_SERVER``, else the build script's output, else the PATH's;
    prints the build hint and exits 2 when there is none."""
    explicit = path or os.environ.get("LLAMA_SERVER")
    if explicit:
        candidates = [explicit]
    else:
        build_dir = os.environ.get("LLAMA_SERVER_DIR",
                                   str(Path.home() / ".cache" / "freetoken" / "llama.cpp"))
        candidates = [str(Path(build_dir) / "build" / "bin" / "llama-server"),
                      shutil.which("llama-server") or ""]
    for candidate in candidates:
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    print(f"{explicit or 'llama-server'}: no such executable. {BUILD_HINT}", file=sys.stderr)
    raise SystemExit(2)


def llama_command(binary: str, gguf: str, port: int, num_slots: int, max_tokens: int,
                  threads: int, extra: list[str]) -> list[str]:
    context = max(MIN_CONTEXT, num_slots * (max_tokens + PROMPT_ROOM))
    return [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
            "-np", str(num_slots), "-c", str(context), "-t", str(threads), *extra]


def freetoken_command(gguf: str, port: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "freetoken_core.cli", "serve", "--host", "127.0.0.1",
            "--port", str(port), "--model", gguf, *extra]


@contextmanager
def running(name: str, cmd: list[str], port: int, log_path: Path,
            start_timeout: float) -> Iterator[str]:
    """Start ``cmd``, wait until ``/health`` answers 200, yield its URL; always stop it."""
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + start_timeout
            while True:
                if proc.poll() is not None:
                    raise BenchError(f"{name} exited ({proc.returncode}) while starting; "
                                     f"log: {log_path}\n{tail(log_path)}")
                if time.monotonic() > deadline:
                    raise BenchError(f"{name} was not healthy within {start_timeout:.0f} s; "
                                     f"log: {log_path}\n{tail(log_path)}")
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            yield url
        finally:
            stop(proc)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def tail(path: Path, num_lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])


def busy_cpus(seconds: float = 1.0) -> float | None:
    """How many CPUs other processes keep busy, from /proc/stat over ``seconds`` (``None``
    off Linux). Both servers spread over every CPU, and llama.cpp's threads spin-wait for
    each other, so a busy machine slows it far more than it slows FreeToken."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields[:8]), idle

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    if total1 == total0:
        return None
    return round((1 - (idle1 - idle0) / (total1 - total0)) * (os.cpu_count() or 1), 2)


def version_of(binary: str) -> str:
    """The first line of ``binary --version`` (llama-server prints it on stderr)."""
    try:
        done = subprocess.run([binary, "--version"], capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    lines = (done.stdout + done.stderr).strip().splitlines()
    return lines[0] if lines else "unknown"
