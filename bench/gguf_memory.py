"""Serving memory of a GGUF model: ``freetoken serve`` against llama.cpp's ``llama-server``.

    python bench/gguf_memory.py [--dir DIR] [--keep] [--shapes 1b,3b] [--kv-tokens 4096]
                                [--only freetoken|llamacpp] [--llama-server PATH]
                                [--kv-cache-dtype auto|float16|bfloat16] [--max-tokens 8]
                                [--serve-args '...'] [--json OUT]

Writes random-weight llama GGUF files in a Q4_K_M-like mix (Q4_K, with Q6_K for the tied
``token_embd`` and every layer's ``attn_v`` and ``ffn_down``; tests/gguf_models.py, the
default model's 49,152-token vocabulary) of two shapes:

* ``1b``: Llama 3.2 1B's: 16 layers, hidden 2048, ff 8192, 32 heads / 8 KV heads of 64;
* ``3b``: Llama 3.2 3B's: 28 layers, hidden 3072, ff 8192, 24 heads / 8 KV heads of 128;
* ``moe``: a ``qwen3moe`` file of Qwen3-30B-A3B's kind at a twelfth of its size: 16 layers,
  hidden 1024, 16 heads / 4 KV heads of 64, 64 experts of 512 (8 a token; their down
  projections Q6_K), 1.6 B weights;
* ``30b-a3b``: Qwen3-30B-A3B's own shape (48 layers, hidden 2048, 32 heads / 4 KV heads of
  128, 128 experts of 768, 8 a token), 30 B weights, ~18 GB (not in the default list);
* ``gpt-oss``: a ``gpt-oss`` file of gpt-oss-20b's kind, 8 layers of hidden 1440, 32 heads /
  4 KV heads of 64, 32 experts of 1440 (4 a token), MXFP4 experts and Q8_0 elsewhere (as
  its GGUF files), sliding windows of 128 keys on every other layer, ~0.9 GB;
* ``gpt-oss-20b``: gpt-oss-20b's own shape (24 layers, hidden 2880, 64 / 8 heads of 64, 32
  experts of 2880), 21 B weights with the default vocabulary, ~11 GB;

into ``--dir`` (default: a temporary directory), deleted afterwards unless ``--keep`` (a
file already there under the same name is reused). For each file, one server at a time:
``freetoken serve --model FILE --kv-cache-tokens N`` and ``llama-server -m FILE -c N -np 1``
(N = ``--kv-tokens``, both on 127.0.0.1), waits for ``/health`` (the load-to-healthy
seconds), sends one greedy ``/v1/completions`` of ``--max-tokens`` tokens, then reads
``/proc`` for the server's whole process tree (FreeToken's engine runs in a child of
``freetoken serve``): the sum of VmRSS (and of its anonymous and file-backed parts) after
the request, the sum of VmHWM (each process's own peak: at most that at once), and the tree's
RSS sampled every 0.1 s from the start (the peak seen at once). Then it stops the server.

FreeToken runs with ``FREETOKEN_CACHE`` in a temporary directory whose ``kernels`` links to
the usual cache's native-kernel builds, so the converted config and tokenizer of the random
files do not stay behind; the kernels are built (where their sources changed) before the
first server starts and each file's config and tokenizer converted before its server
starts, so no load time includes either (both are once per machine and file). llama-server: ``--llama-server``, else ``$LLAMA_SERVER``, else
``~/.cache/freetoken/llama.cpp/build/bin/llama-server`` (``bash bench/build_llama_server.sh``),
else the PATH's; without one its rows say so and FreeToken's are still measured.

Reading the figures: FreeToken lays the file's blocks into its own (anonymous) memory and
drops the mapping; its KV cache is float32, ``layers x N x 2 x kv heads x head dim x 4``
bytes (x 2 with ``--kv-cache-dtype float16`` or ``bfloat16``, passed to ``freetoken serve``:
llama-server's size), written once at start (``--kv-cache-prefault``, the default), so
resident in full. llama-server maps the file and computes from the
mapping (its weights are file-backed RSS, shared with the page cache), with an f16 KV cache
(half FreeToken's bytes) allocated at start and a compute buffer. docs/operations.md
("GGUF memory") has the formula and the figures of the reference machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from serving import free_port
from vs_servers import BenchError, freetoken_command, stop, tail

SHAPES = {
    "1b": {"layers": 16, "hidden": 2048, "ff": 8192, "heads": 32, "kv_heads": 8},
    "3b": {"layers": 28, "hidden": 3072, "ff": 8192, "heads": 24, "kv_heads": 8},
    # Qwen3-30B-A3B's kind at a twelfth of its weights: 64 experts of 512, 8 a token
    "moe": {"layers": 16, "hidden": 1024, "ff": 3072, "heads": 16, "kv_heads": 4,
            "arch": "qwen3moe", "experts": 64, "experts_used": 8, "expert_ff": 512},
    # Qwen3-30B-A3B's own shape (its vocabulary the default model's 49,152 tokens)
    "30b-a3b": {"layers": 48, "hidden": 2048, "ff": 6144, "heads": 32, "kv_heads": 4,
                "head_dim": 128, "arch": "qwen3moe", "experts": 128, "experts_used": 8,
                "expert_ff": 768},
    # gpt-oss-20b's kind at a third of its layers and half its width, and its own shape:
    # MXFP4 experts, the rest Q8_0, as its GGUF files (a 2880-wide row is not whole
    # K-quant super-blocks)
    "gpt-oss": {"layers": 8, "hidden": 1440, "ff": 1440, "heads": 32, "kv_heads": 4,
                "head_dim": 64, "arch": "gpt-oss", "experts": 32, "experts_used": 4,
                "expert_ff": 1440, "mix": "mxfp4"},
    "gpt-oss-20b": {"layers": 24, "hidden": 2880, "ff": 2880, "heads": 64, "kv_heads": 8,
                    "head_dim": 64, "arch": "gpt-oss", "experts": 32, "experts_used": 4,
                    "expert_ff": 2880, "mix": "mxfp4"},
}
Q8_0, Q4_K, Q6_K, MXFP4 = 8, 12, 14, 39
MIX = {"token_embd.weight": Q6_K, "attn_v.weight": Q6_K, "ffn_down.weight": Q6_K,
       "ffn_down_exps.weight": Q6_K}
# gpt-oss's: every expert MXFP4, the rest Q8_0; its rope YaRN's, its window 128 keys
MXFP4_MIX = {f"ffn_{w}_exps.weight": MXFP4 for w in ("gate", "up", "down")}
GPT_OSS_METADATA = {"rope.scaling.type": "yarn", "rope.scaling.factor": 32.0,
                    "rope.scaling.original_context_length": 4096}
PROMPT = "Hello, my name is"
START_TIMEOUT = 600.0
SIDES = ("freetoken", "llamacpp")
LABELS = {"freetoken": "FreeToken", "llamacpp": "llama-server"}


@dataclass
class Row:
    shape: str
    side: str
    file_bytes: int
    kv_bytes: int
    """The KV cache's size for ``--kv-tokens`` (FreeToken float32, llama.cpp f16)."""
    healthy_s: float | None = None
    rss: int | None = None
    anon: int | None = None
    file_rss: int | None = None
    hwm: int | None = None
    sampled_peak: int | None = None
    processes: int | None = None
    per_process: list[dict] | None = None
    """Each process's name, VmRSS, RssAnon, RssFile, VmHWM after the completion."""
    error: str | None = None


def gguf_file(directory: Path, shape: str) -> Path:
    """The ``shape`` model's file in ``directory``, written unless it is there."""
    s = SHAPES[shape]
    arch = s.get("arch", "llama")
    path = directory / f"{arch}-{shape}-{s.get('mix', 'q4_k_m')}-random.gguf"
    if path.exists():
        print(f"{shape}: reusing {path}", flush=True)
        return path
    from gguf_models import write_gguf

    start = time.perf_counter()
    tmp = path.with_suffix(".partial")
    moe = {key: s[key] for key in ("experts", "experts_used", "expert_ff") if key in s}
    kinds: dict = {"weight_type": Q4_K, "types": MIX, "tied": True}
    if s.get("mix") == "mxfp4":
        kinds = {"weight_type": Q8_0, "types": MXFP4_MIX, "tied": False,
                 "rope_theta": 150000.0, "sliding_window": 128,
                 "metadata": GPT_OSS_METADATA}
    write_gguf(tmp, arch, hidden=s["hidden"], layers=s["layers"], heads=s["heads"],
               kv_heads=s["kv_heads"], head_dim=head_dim(shape), ff=s["ff"], context=8192,
               **kinds, **moe)
    tmp.rename(path)
    print(f"{shape}: wrote {path} ({path.stat().st_size / 1e6:,.0f} MB) in "
          f"{time.perf_counter() - start:.1f} s", flush=True)
    return path


def head_dim(shape: str) -> int:
    s = SHAPES[shape]
    return s.get("head_dim", s["hidden"] // s["heads"])


def kv_bytes(shape: str, tokens: int, element: int) -> int:
    s = SHAPES[shape]
    return s["layers"] * tokens * 2 * s["kv_heads"] * head_dim(shape) * element


def _status(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    return out


def process_tree(root: int) -> list[int]:
    """``root`` and every process descended from it, from /proc/*/stat."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        parents[int(entry)] = int(fields[1])
    tree, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, ppid in parents.items() if ppid in frontier]
        tree += frontier
    return tree


KEYS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")


def _name(pid: int) -> str:
    """A short name: the command line's script or module and first words."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return str(pid)
    line = " ".join(argv)
    for marker, name in (("spawn_main", "engine (spawned)"),
                         ("resource_tracker", "resource tracker"),
                         ("freetoken_core.cli", "freetoken serve (HTTP)")):
        if marker in line:
            return name
    return Path(argv[0]).name


def tree_memory(root: int, detail: bool = False) -> dict:
    """Summed VmRSS, RssAnon, RssFile, VmHWM of ``root``'s process tree (and its size;
    ``detail``: each process's under ``per_process``)."""
    total: dict = dict.fromkeys(KEYS, 0) | {"processes": 0, "per_process": []}
    for pid in process_tree(root):
        try:
            status = _status(pid)
        except OSError:  # gone meanwhile
            continue
        if "VmRSS" not in status:  # a zombie
            continue
        for key in KEYS:
            total[key] += status.get(key, 0)
        total["processes"] += 1
        if detail:
            total["per_process"].append({"pid": pid, "name": _name(pid), **{
                k: status.get(k, 0) for k in KEYS}})
    return total


class Sampler(threading.Thread):
    """The tree's summed VmRSS every ``interval`` seconds; ``peak`` the largest seen."""

    def __init__(self, root: int, interval: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.root, self.interval, self.peak = root, interval, 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                self.peak = max(self.peak, tree_memory(self.root)["VmRSS"])
            except OSError:
                pass
            self.done.wait(self.interval)


def llama_server_binary(path: str | None) -> str | None:
    explicit = path or os.environ.get("LLAMA_SERVER")
    if explicit:
        candidates = [explicit]
    else:
        build = Path(os.environ.get("LLAMA_SERVER_DIR",
                                    Path.home() / ".cache" / "freetoken" / "llama.cpp"))
        candidates = [str(build / "build" / "bin" / "llama-server"),
                      shutil.which("llama-server") or ""]
    for candidate in candidates:
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def measure(row: Row, cmd: list[str], port: int, env: dict[str, str], log_path: Path,
            max_tokens: int) -> None:
    """Start ``cmd``, wait for /health, one completion, read the tree's memory, stop."""
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=env)
        sampler = Sampler(proc.pid)
        sampler.start()
        try:
            deadline = time.monotonic() + START_TIMEOUT
            while True:
                if proc.poll() is not None:
                    raise BenchError(f"exited ({proc.returncode}) while starting; log: "
                                     f"{log_path}\n{tail(log_path)}")
                if time.monotonic() > deadline:
                    raise BenchError(f"not healthy within {START_TIMEOUT:.0f} s; log: "
                                     f"{log_path}\n{tail(log_path)}")
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            row.healthy_s = time.perf_counter() - start
            with httpx.Client(base_url=url, timeout=300) as client:
                model = client.get("/v1/models").json()["data"][0]["id"]
                reply = client.post("/v1/completions", json={
                    "model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                    "temperature": 0.0})
                if reply.status_code != 200:
                    raise BenchError(f"completion: HTTP {reply.status_code}: {reply.text[:300]}")
                text = reply.json()["choices"][0]["text"]
            mem = tree_memory(proc.pid, detail=True)
            row.rss, row.anon, row.file_rss = mem["VmRSS"], mem["RssAnon"], mem["RssFile"]
            row.hwm, row.processes = mem["VmHWM"], mem["processes"]
            row.per_process = mem["per_process"]
            print(f"  {LABELS[row.side]}: healthy in {row.healthy_s:.1f} s, {text!r}",
                  flush=True)
        finally:
            sampler.done.set()
            sampler.join()
            row.sampled_peak = sampler.peak
            stop(proc)


def freetoken_env(cache: Path) -> dict[str, str]:
    from freetoken_core.config import cache_dir

    kernels = cache_dir() / "kernels"
    cache.mkdir(parents=True, exist_ok=True)
    link = cache / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(kernels.resolve(), target_is_directory=True)
    env = {**os.environ, "FREETOKEN_CACHE": str(cache)}
    # Built (where the sources changed) before any server starts, not in its load time.
    build = "from freetoken_core.kernels import cpu_kernels_available as a; a()"
    subprocess.run([sys.executable, "-c", build], env=env, check=True)
    return env


def convert(path: Path, env: dict[str, str]) -> None:
    """The file's config and tokenizer into the cache (once, ~2 s), outside the load time:
    a served model's second start finds them there."""
    code = ("import sys; from freetoken_core.models.resolve import resolve_model; "
            "resolve_model(sys.argv[1], progress=False)")
    subprocess.run([sys.executable, "-c", code, str(path)], env=env, check=True)


def mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f}"


def print_table(rows: list[Row], kv_tokens: int) -> None:
    print(f"\nMiB (2^20 bytes); KV cache for {kv_tokens} tokens; RSS after one completion, "
          "summed over the server's processes")
    head = (f"{'model':6} {'server':12} {'file':>6} {'KV':>5} {'healthy s':>9} {'RSS':>6} "
            f"{'anon':>6} {'file-b':>6} {'peak':>6} {'ΣHWM':>6}  procs")
    print(head)
    print("-" * len(head))
    for r in rows:
        if r.error:
            print(f"{r.shape:6} {LABELS[r.side]:12} {mb(r.file_bytes):>6} {mb(r.kv_bytes):>5} "
                  f" {r.error.splitlines()[0]}")
            continue
        print(f"{r.shape:6} {LABELS[r.side]:12} {mb(r.file_bytes):>6} {mb(r.kv_bytes):>5} "
              f"{r.healthy_s:9.1f} {mb(r.rss):>6} {mb(r.anon):>6} {mb(r.file_rss):>6} "
              f"{mb(r.sampled_peak):>6} {mb(r.hwm):>6}  {r.processes}")
    print("\nper process (MiB: RSS = anon + file-backed, own peak VmHWM):")
    for r in rows:
        for p in r.per_process or []:
            print(f"  {r.shape:4} {LABELS[r.side]:12} {p['name']:24} RSS {mb(p['VmRSS']):>6} "
                  f"= {mb(p['RssAnon']):>6} + {mb(p['RssFile']):>5}, HWM {mb(p['VmHWM']):>6}")
    print("peak: the tree's RSS sampled every 0.1 s from the start; ΣHWM: the sum of each "
          "process's own VmHWM (an upper bound of the peak at once); anon / file-b: the RSS "
          "after the completion, anonymous / file-backed (llama-server's weights are its "
          "mapping of the file)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None,
                        help="where the GGUF files go (default: a temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the GGUF files")
    parser.add_argument("--shapes", default="1b,3b", help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--kv-tokens", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--only", choices=SIDES, default=None)
    parser.add_argument("--llama-server", default=None, metavar="PATH")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="llama-server's -t (default: the CPU count)")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "float16", "bfloat16"],
                        default="auto", help="FreeToken's KV cache (auto: float32)")
    parser.add_argument("--serve-args", default="", help="more `freetoken serve` flags")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT")
    args = parser.parse_args()
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}")
    sides = [args.only] if args.only else list(SIDES)
    llama = llama_server_binary(args.llama_server) if "llamacpp" in sides else None
    if "llamacpp" in sides and llama is None:
        print("llama-server not found (--llama-server, $LLAMA_SERVER, "
              "~/.cache/freetoken/llama.cpp/build/bin/llama-server, PATH): its rows are "
              "skipped; build it with `bash bench/build_llama_server.sh`", flush=True)

    work = Path(tempfile.mkdtemp(prefix="gguf-memory-"))
    directory = args.dir or work / "models"
    directory.mkdir(parents=True, exist_ok=True)
    existing = set(directory.iterdir())
    print(f"logs and cache: {work}; models: {directory}", flush=True)
    env = freetoken_env(work / "cache")
    rows: list[Row] = []
    try:
        for shape in shapes:
            path = gguf_file(directory, shape)
            size = path.stat().st_size
            for side in sides:
                element = 4 if side == "freetoken" and args.kv_cache_dtype == "auto" else 2
                row = Row(shape, side, size, kv_bytes(shape, args.kv_tokens, element))
                rows.append(row)
                if side == "llamacpp" and llama is None:
                    row.error = "skipped: no llama-server binary"
                    continue
                port = free_port()
                if side == "freetoken":
                    convert(path, env)
                    cmd = freetoken_command(str(path), port, [
                        "--kv-cache-tokens", str(args.kv_tokens),
                        "--kv-cache-dtype", args.kv_cache_dtype, *args.serve_args.split()])
                else:
                    cmd = [llama, "-m", str(path), "--host", "127.0.0.1", "--port", str(port),
                           "-c", str(args.kv_tokens), "-np", "1", "-t", str(args.threads)]
                try:
                    measure(row, cmd, port, env, work / f"{shape}-{side}.log", args.max_tokens)
                except (BenchError, httpx.HTTPError, KeyError, ValueError) as exc:
                    row.error = f"failed: {exc}"
                    print(f"  {LABELS[side]}: {row.error}", flush=True)
    finally:
        if not args.keep:
            for path in set(directory.iterdir()) - existing:
                path.unlink()
            if args.dir is None:
                shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(work / "cache", ignore_errors=True)
    print_table(rows, args.kv_tokens)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 1 if any(r.error and not r.error.startswith("skipped") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
