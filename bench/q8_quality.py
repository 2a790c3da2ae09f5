"""Quality of ``--activations q8`` (8-bit activations, llama.cpp's arithmetic; or, with
``--mode int24``, the exact integer kernel of AVX-512 VNNI CPUs) against the float32 path, on
the same model, in one process.

* perplexity of a fixed English text (the Gettysburg Address, embedded below; no download),
  from ``prompt_logprobs``, under each path, and the mean |difference| of the per-token
  logprobs;
* greedy agreement: the chat prompts of bench/chat_prompts.py answered at temperature 0,
  ``--max-tokens`` tokens each: how many answers are identical, and the mean length of the
  common prefix;
* the speed of one decoding sequence under each (engine steps; the two engines alternate,
  10 steps each, 8 times).

    python bench/q8_quality.py [--model PATH] [--max-tokens 64] [--mode q8|int24]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from chat_prompts import chat_prompt_ids

TEXT = (
    "Four score and seven years ago our fathers brought forth on this continent, a new "
    "nation, conceived in Liberty, and dedicated to the proposition that all men are "
    "created equal. Now we are engaged in a great civil war, testing whether that nation, "
    "or any nation so conceived and so dedicated, can long endure. We are met on a great "
    "battle-field of that war. We have come to dedicate a portion of that field, as a final "
    "resting place for those who here gave their lives that that nation might live. It is "
    "altogether fitting and proper that we should do this. But, in a larger sense, we can "
    "not dedicate -- we can not consecrate -- we can not hallow -- this ground. The brave "
    "men, living and dead, who struggled here, have consecrated it, far above our poor power "
    "to add or detract. The world will little note, nor long remember what we say here, but "
    "it can never forget what they did here. It is for us the living, rather, to be "
    "dedicated here to the unfinished work which they who fought here have thus far so "
    "nobly advanced. It is rather for us to be here dedicated to the great task remaining "
    "before us -- that from these honored dead we take increased devotion to that cause for "
    "which they gave the last full measure of devotion -- that we here highly resolve that "
    "these dead shall not have died in vain -- that this nation, under God, shall have a "
    "new birth of freedom -- and that government of the people, by the people, for the "
    "people, shall not perish from the earth.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--mode", default="q8", choices=["q8", "int24"],
                        help="the arithmetic measured against float32 (default: q8)")
    args = parser.parse_args()
    mode_b = args.mode
    from freetoken_core import LLM, SamplingParams

    results, engines = {}, {}
    for mode in ("float32", mode_b):
        llm = LLM(args.model, activations=mode, max_num_seqs=16, progress=False)
        ids = llm.tokenizer.encode(TEXT, add_special_tokens=False)
        out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        logprobs = [entry[token].logprob
                    for entry, token in zip(out.prompt_logprobs[1:], ids[1:])]
        prompts = chat_prompt_ids(llm.tokenizer)
        greedy = [o.outputs[0].token_ids for o in llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens))]
        engine = llm.engine
        engine.add_request("speed", prompts[0], SamplingParams(
            temperature=0.8, seed=0, max_tokens=200, ignore_eos=True))
        for _ in range(10):
            engine.step()
        results[mode] = (logprobs, greedy)
        engines[mode] = engine
    # The two engines alternate, 10 steps each, 8 times: the machine's drift hits both alike.
    times: dict[str, list[float]] = {mode: [] for mode in engines}
    for _ in range(8):
        for mode, engine in engines.items():
            start = time.perf_counter()
            for _ in range(10):
                engine.step()
            times[mode].append((time.perf_counter() - start) / 10 * 1000)
    exact_ms, q8_ms = statistics.median(times["float32"]), statistics.median(times[mode_b])
    paired = statistics.median(a / b for a, b in zip(times["float32"], times[mode_b]))

    exact_lp, exact_greedy = results["float32"]
    q8_lp, q8_greedy = results[mode_b]

    def ppl(lps: list[float]) -> float:
        return math.exp(-sum(lps) / len(lps))

    diff = statistics.fmean(abs(a - b) for a, b in zip(exact_lp, q8_lp))
    same = sum(a == b for a, b in zip(exact_greedy, q8_greedy))

    def prefix(a: list[int], b: list[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    prefixes = [prefix(a, b) for a, b in zip(exact_greedy, q8_greedy)]
    print(f"perplexity of the fixed text ({len(exact_lp)} tokens): float32 {ppl(exact_lp):.3f}, "
          f"{mode_b} {ppl(q8_lp):.3f} ({ppl(q8_lp) / ppl(exact_lp) - 1:+.2%}); mean |logprob "
          f"difference| {diff:.4f}")
    print(f"greedy answers ({len(exact_greedy)} chat prompts, {args.max_tokens} tokens): "
          f"{same} identical; mean common prefix {statistics.fmean(prefixes):.1f} tokens "
          f"(median {statistics.median(prefixes):.0f})")
    print(f"one decoding sequence: float32 {exact_ms:.1f} ms/step, {mode_b} {q8_ms:.1f} ms/step "
          f"({paired:.2f}x, the median of 8 paired alternations)")


if __name__ == "__main__":
    main()
