"""Decode-step time of the default model with and without the GGUF-block linears.

For each batch size, that many sequences decode in one engine; the two paths (float32 oneDNN
GEMMs, or the Q4_1/Q8_0 blocks through the native kernel) alternate every 10 steps, four
times, in the same process, so that the machine's drift hits both alike. This is where
``GGUF_MAX_ROWS`` in freetoken_core/models/layers.py comes from.

    python bench/decode_step.py [--sizes 1,8,16,24,32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from chat_prompts import chat_prompt_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,8,16,24,32")
    args = parser.parse_args()
    from freetoken_core import LLM, SamplingParams
    from freetoken_core.models import layers

    print(f"{'sequences':>9}{'float32 GEMM':>16}{'GGUF blocks':>15}")
    for size in map(int, args.sizes.split(",")):
        llm = LLM(None, kv_cache_tokens=16384, max_num_seqs=size, progress=False)
        engine = llm.engine
        for i, prompt in enumerate(chat_prompt_ids(llm.tokenizer)[:size]):
            engine.add_request(f"r{i}", prompt,
                               SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        for _ in range(5):  # prefill, then a few decode steps
            engine.step()
        times: dict[int, list[float]] = {0: [], size: []}
        for _ in range(4):
            for limit, samples in times.items():
                layers.GGUF_MAX_ROWS = limit
                start = time.perf_counter()
                for _ in range(10):
                    engine.step()
                samples.append((time.perf_counter() - start) / 10 * 1000)
        print(f"{size:>9}{statistics.median(times[0]):>13.1f} ms"
              f"{statistics.median(times[size]):>12.1f} ms", flush=True)


if __name__ == "__main__":
    main()
