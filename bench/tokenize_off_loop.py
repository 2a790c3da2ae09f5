"""How long one long prompt's tokenization stalls the event loop: inline (as the routes did
before) against ``TokenizerPool`` (the worker threads the routes use now).

    .venv/bin/python bench/tokenize_off_loop.py [--model DIR] [--chars 200000]

A ticker task stands in for the streams the loop serves: it sleeps 1 ms at a time and
records the longest gap between two of its wake-ups while the prompt is encoded. With the
encode inline the gap is the whole encode; in a worker thread (Hugging Face fast tokenizers
release the GIL) it stays near the ticker's own period. Default model: the embedded one.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from freetoken_core.models.resolve import resolve_model
from freetoken_core.server.limits import TokenizerPool
from freetoken_core.tokenizer import load_tokenizer


async def longest_gap(work: Callable[[], Awaitable[Any]]) -> tuple[float, float]:
    """``(seconds the work took, longest gap between the ticker's wake-ups)``."""
    done = asyncio.Event()
    gaps = [0.0]

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    start = time.perf_counter()
    await work()
    took = time.perf_counter() - start
    done.set()
    await task
    return took, max(gaps)


async def run(tokenizer: Any, text: str) -> None:
    pool = TokenizerPool(4)

    def encode() -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    async def inline() -> None:
        encode()

    async def threaded() -> None:
        await pool.run(encode)

    await threaded()  # warm the pool and the tokenizer's caches
    print(f"{len(text)} characters, {len(encode())} tokens")
    print(f"{'where':>14} {'encode ms':>10} {'longest loop gap ms':>20}")
    for name, work in (("inline", inline), ("worker thread", threaded)):
        took, gap = await longest_gap(work)
        print(f"{name:>14} {took * 1e3:>10.1f} {gap * 1e3:>20.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: embedded)")
    parser.add_argument("--chars", type=int, default=200_000)
    args = parser.parse_args()
    tokenizer = load_tokenizer(Path(resolve_model(args.model, progress=False)))
    sentence = "The quick brown fox jumps over the lazy dog; 日本語も少し. "
    text = (sentence * (args.chars // len(sentence) + 1))[:args.chars]
    asyncio.run(run(tokenizer, text))


if __name__ == "__main__":
    main()
