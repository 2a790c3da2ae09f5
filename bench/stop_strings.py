"""Per-token cost of stop-string matching: the old per-stop ``str.find`` loop against the
Aho–Corasick ``StopMatcher`` that ``ChoiceText`` uses now, in the same run.

    .venv/bin/python bench/stop_strings.py [--tokens 2000] [--repeats 3]

Each case feeds the same generated text, cut into 1–6-character tokens, to both matchers.
The stops share prefixes with the text (they are drawn from its alphabet) but end in a
character the text never has, so none ever matches and every token pays the full cost:
the worst case for both. ``build`` is the automaton's one-time construction per request
(shared by the request's choices). Times are the best of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

from freetoken_core.engine.output_processor import StopMatcher

ALPHABET = "etaoin shrdlu"


def brute_force(stops: list[str], tokens: list[str]) -> None:
    """What ``ChoiceText`` did before: every stop searched in the new text plus the hold."""
    hold = max(len(s) for s in stops) - 1
    text = ""
    for delta in tokens:
        search_from = max(0, len(text) - hold)
        text += delta
        for stop in stops:
            if text.find(stop, search_from) >= 0:
                raise AssertionError("the bench's stops must never match")


def automaton(matcher: StopMatcher, tokens: list[str]) -> None:
    state = 0
    for delta in tokens:
        state, end, _ = matcher.feed(state, delta)
        if end >= 0:
            raise AssertionError("the bench's stops must never match")


def best_of(repeats: int, run: Callable[..., None], *args: object) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run(*args)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2000, help="tokens per case")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stops", type=int, nargs="+", default=[1, 100, 10_000])
    args = parser.parse_args()
    rng = random.Random(0)
    tokens = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 6)))
              for _ in range(args.tokens)]
    print(f"{args.tokens} tokens, {sum(map(len, tokens))} characters; µs per token")
    print(f"{'stops':>7} {'old find':>10} {'automaton':>10} {'old/new':>8} {'build ms':>9}")
    for num_stops in args.stops:
        stops = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(2, 15))) + "#"
                 for _ in range(num_stops)]
        start = time.perf_counter()
        matcher = StopMatcher(stops)
        build = time.perf_counter() - start
        old = best_of(args.repeats, brute_force, stops, tokens) / len(tokens)
        new = best_of(args.repeats, automaton, matcher, tokens) / len(tokens)
        print(f"{num_stops:>7} {old * 1e6:>10.2f} {new * 1e6:>10.2f} {old / new:>7.1f}x "
              f"{build * 1e3:>9.1f}")


if __name__ == "__main__":
    main()
