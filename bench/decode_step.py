"""Decode-step time of the default model: linears from the GGUF blocks against float32 GEMMs.

For each batch size, that many sequences decode in each of two engines built in this
process: one whose linears compute from the file's Q4_1/Q8_0 blocks through the native
kernel (the default), one whose linears are float32 oneDNN GEMMs of the same weights
(``linear.USE_GGUF_BLOCKS = False`` while it is built). Each sequence generates
``--tokens`` tokens (default 128, as bench/vs_llamacpp.py's requests do) in 8 windows; the
engines alternate window by window, so that the machine's drift hits both alike, and each
window times its steps after 3 untimed ones (the other engine's turn has just filled the
caches with its own weights). A figure is the median of the windows' mean steps: the step
at the middle of the answers' contexts.

The figures are the engine core's decode steps (``EngineCore.step_times``, what a server
reports in ``/metrics`` as ``freetoken_engine_decode_step_seconds``): a server's engine
process runs them while its HTTP process detokenizes. ``+ detok`` is the GGUF engine's
whole ``LLMEngine.step``, which detokenizes in the same thread. The GGUF column is the
engine step the served inter-token latency is held to; the sequences have
bench/vs_llamacpp.py's prompts and sample as its requests do (temperature 0.8,
``--temperature``), each with its own seed. A step grows with its sequences' contexts
(every step reads all their keys and values: at 16 sequences of chat prompts ~25 ms at ~50
tokens of context, ~41 ms at ~320 on the Intel Xeon) and with what their prompts share (a
shared prefix is one set of cache blocks that all of them read), so the served ITL compares
with these figures for the same prompts and token count only.

    python bench/decode_step.py [--sizes 1,8,16,24,32,64] [--tokens 128] [--temperature 0.8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from vs_llamacpp import prompt

WARM_STEPS = 3
WINDOWS = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,8,16,24,32")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    window = args.tokens // WINDOWS
    if window <= WARM_STEPS:
        parser.error(f"--tokens must be at least {WINDOWS * (WARM_STEPS + 1)}")
    from freetoken_core import LLM, SamplingParams
    from freetoken_core.models import linear

    print(f"{'sequences':>9}{'float32 GEMM':>16}{'GGUF blocks':>15}{'+ detok':>15}"
          f"{'tok/s':>9}")
    for size in map(int, args.sizes.split(",")):
        engines = {}
        for use_blocks in (False, True):
            linear.USE_GGUF_BLOCKS = use_blocks
            try:
                llm = LLM(None, kv_cache_tokens=16384, max_num_seqs=size, progress=False)
            finally:
                linear.USE_GGUF_BLOCKS = True
            for i in range(size):
                # bench/vs_llamacpp.py's prompts (~15 tokens): the same contexts.
                llm.engine.add_request(f"r{i}", llm.tokenizer.encode(prompt(i)),
                                       SamplingParams(temperature=args.temperature, seed=i,
                                                      max_tokens=args.tokens + window,
                                                      ignore_eos=True))
            while any(s.num_computed_tokens < s.num_prompt_tokens
                      for s in llm.engine.core.scheduler.running) or \
                    llm.engine.core.scheduler.waiting:
                llm.engine.step()  # prefill
            engines[use_blocks] = llm.engine
        times: dict[bool, list[float]] = {False: [], True: []}
        whole: list[float] = []  # LLMEngine.step of the GGUF engine, detokenization included
        for _ in range(WINDOWS):
            for use_blocks, samples in times.items():
                engine = engines[use_blocks]
                for _ in range(WARM_STEPS):
                    engine.step()
                core = engine.core.step_times
                seconds, count = core.decode_seconds, core.decode_count
                start = time.perf_counter()
                for _ in range(window - WARM_STEPS):
                    engine.step()
                elapsed = time.perf_counter() - start
                samples.append((core.decode_seconds - seconds) /
                               (core.decode_count - count) * 1000)
                if use_blocks:
                    whole.append(elapsed / (window - WARM_STEPS) * 1000)
        gemm, gguf = statistics.median(times[False]), statistics.median(times[True])
        print(f"{size:>9}{gemm:>13.1f} ms{gguf:>12.1f} ms{statistics.median(whole):>12.1f} ms"
              f"{size / gguf * 1000:>9.1f}", flush=True)
        del engines

if __name__ == "__main__":
    main()
