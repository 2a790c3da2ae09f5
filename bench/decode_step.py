"""Decode-step time of the default model: linears from the GGUF blocks against float32 GEMMs.

For each batch size, that many sequences decode in each of two engines built in this
process: one whose linears compute from the file's Q4_1/Q8_0 blocks through the native
kernel (the default), one whose linears are float32 oneDNN GEMMs of the same weights
(``layers.USE_GGUF_BLOCKS = False`` while it is built). They alternate every 10 timed steps
(after 3 untimed ones), four times, so that the machine's drift hits both alike. The GGUF column is the engine step the
served inter-token latency is held to; the sequences sample as bench/vs_llamacpp.py's
requests do (temperature 0.8, ``--temperature``), each with its own seed.

    python bench/decode_step.py [--sizes 1,8,16,24,32,64] [--temperature 0.8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from chat_prompts import chat_prompt_ids

WARM_STEPS = 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,8,16,24,32")
    parser.add_argument("--temperature", type=float, default=0.8)
    args = parser.parse_args()
    from freetoken_core import LLM, SamplingParams
    from freetoken_core.models import layers

    print(f"{'sequences':>9}{'float32 GEMM':>16}{'GGUF blocks':>15}{'tok/s':>9}")
    for size in map(int, args.sizes.split(",")):
        engines = {}
        for use_blocks in (False, True):
            layers.USE_GGUF_BLOCKS = use_blocks
            try:
                llm = LLM(None, kv_cache_tokens=16384, max_num_seqs=size, progress=False)
            finally:
                layers.USE_GGUF_BLOCKS = True
            prompts = chat_prompt_ids(llm.tokenizer)
            for i in range(size):
                llm.engine.add_request(f"r{i}", prompts[i % len(prompts)],
                                       SamplingParams(temperature=args.temperature, seed=i,
                                                      max_tokens=200, ignore_eos=True))
            while any(s.num_computed_tokens < s.num_prompt_tokens
                      for s in llm.engine.core.scheduler.running) or \
                    llm.engine.core.scheduler.waiting:
                llm.engine.step()  # prefill
            for _ in range(3):
                llm.engine.step()
            engines[use_blocks] = llm.engine
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(4):
            for use_blocks, samples in times.items():
                # Untimed steps first: the other engine's run has just filled the caches
                # with its own weights (on a CPU whose L3 holds the ~110 MB of GGUF blocks,
                # the first steps after a switch are ~20 % slower than the served steady
                # state).
                for _ in range(WARM_STEPS):
                    engines[use_blocks].step()
                start = time.perf_counter()
                for _ in range(10):
                    engines[use_blocks].step()
                samples.append((time.perf_counter() - start) / 10 * 1000)
        gemm, gguf = statistics.median(times[False]), statistics.median(times[True])
        print(f"{size:>9}{gemm:>13.1f} ms{gguf:>12.1f} ms{size / gguf * 1000:>9.1f}",
              flush=True)
        del engines

if __name__ == "__main__":
    main()
