"""Tokenizing speed of a GGUF file's tokenizer: FreeToken's (built from the file to tokenize
as llama.cpp does) against transformers' GGUF conversion of the same file, on ~1 MB of
mixed text (the GPL-3 licence, indented code, numbered lists, digit runs, CJK, emoji).

    .venv/bin/python bench/gguf_tokenize.py [--model FILE.gguf] [--bytes 1000000] [--runs 5]

Both are Hugging Face fast tokenizers (the Rust ``tokenizers`` library); each is timed
through transformers' ``encode`` (what FreeToken's server calls) and through its Rust
core alone, best of ``--runs`` interleaved rounds, one text encoded at a time, in wall
and in CPU time (MB/s from the CPU time of ``encode``). The ids' counts are
printed too: they differ where the conversion does not tokenize as llama.cpp does.
Default model: the embedded SmolLM2 file.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from freetoken_core.models.resolve import default_gguf_path, resolve_model
from freetoken_core.tokenizer import load_tokenizer

_GPL3 = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "GPL-3"
_EXTRA = (
    "def fibonacci(n: int) -> int:\n    a, b = 0, 1\n    for _ in range(n):\n"
    "        a, b = b, a + b\n    \n        \n    return a\n\n"
    "1. First item\n2. Second item\n   - nested\n10. Tenth\n  0. zero\n"
    "Digits 0 12 345 6789 3.14159265358979 1,000,000 2024-06-30 0xDEADBEEF\n"
    "東京は日本の首都です。我们正在测试分词器。한국어 문장입니다.\n"
    "Emoji: 😀🎉 👍🏽 🇯🇵 👨‍👩‍👧 🚀 — café, naïve, Ünïcödé\n"
)


def mixed_text(num_bytes: int) -> str:
    """GPL-3 and the mixed paragraph above, alternated, cut to ``num_bytes`` of UTF-8."""
    unit = _GPL3.read_text(encoding="utf-8") + _EXTRA * 40
    text = unit * (num_bytes // len(unit.encode()) + 1)
    return text.encode()[:num_bytes].decode("utf-8", "ignore")


def best_of(runs: int, funcs: dict[str, Callable[[], Any]]
            ) -> dict[str, tuple[float, float, Any]]:
    """``{name: (fastest wall seconds, fewest CPU seconds, result)}`` over ``runs`` rounds
    that call every function of ``funcs`` once each, interleaved so that a busy machine
    slows them alike; the CPU time (this process's) does not count the time spent waiting
    for a core that another process holds."""
    best = {name: (float("inf"), float("inf"), None) for name in funcs}
    for _ in range(runs):
        for name, func in funcs.items():
            wall, cpu = time.perf_counter(), time.process_time()
            result = func()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            best[name] = (min(best[name][0], wall), min(best[name][1], cpu), result)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="a GGUF file")
    parser.add_argument("--bytes", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    path = (args.model or default_gguf_path()).resolve()
    from transformers import AutoTokenizer

    start = time.perf_counter()
    ours = load_tokenizer(resolve_model(path, progress=False))
    print(f"FreeToken's tokenizer of {path.name}: loaded in "
          f"{time.perf_counter() - start:.2f} s (converted once, then cached)")
    start = time.perf_counter()
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    print(f"transformers' GGUF conversion: {time.perf_counter() - start:.2f} s")
    text = mixed_text(args.bytes)
    print(f"text: {len(text.encode()):,} bytes, {len(text):,} characters")
    tokenizers = {"FreeToken (llama.cpp's)": ours, "transformers' conversion": theirs}
    funcs: dict[str, Callable[[], Any]] = {}
    for name, tok in tokenizers.items():
        funcs[name] = lambda tok=tok: tok.encode(text, add_special_tokens=False)
        funcs[name + " core"] = lambda tok=tok: tok.backend_tokenizer.encode(
            text, add_special_tokens=False)
    best = best_of(args.runs, funcs)
    print(f"{'tokenizer':<26} {'encode wall':>11} {'CPU':>8} {'core wall':>10} {'CPU':>8} "
          f"{'MB/s':>6} {'ids':>8}")
    for name in tokenizers:
        (wall, cpu, ids), (core_wall, core_cpu, _) = best[name], best[name + " core"]
        print(f"{name:<26} {wall * 1e3:>9.0f}ms {cpu * 1e3:>6.0f}ms {core_wall * 1e3:>8.0f}ms "
              f"{core_cpu * 1e3:>6.0f}ms {len(text.encode()) / cpu / 1e6:>6.2f} {len(ids):>8,}")

if __name__ == "__main__":
    main()
