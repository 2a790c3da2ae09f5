"""End-to-end generation speed: FreeToken against Hugging Face transformers ``generate``.

Same model (the embedded default, SmolLM2-135M-Instruct, dequantized to float32), same
chat prompts, greedy decoding, measured in one run; each system in its own subprocess so
that peak RSS is its own. Two workloads:

* ``fixed``: every sequence generates exactly ``--max-tokens`` tokens (EOS suppressed:
  ``min_tokens`` here, ``min_new_tokens`` in transformers).
  At 16 (32) sequences, one batch of 16 (32) in both systems: this isolates the per-step
  cost.
* ``chat``: the 64 requests of ``bench/chat_prompts.py``; each answer ends where the model
  ends its turn (EOS), at most ``--chat-max-tokens`` tokens. At N concurrent sequences,
  transformers runs them as static batches of N in arrival order (a batch lasts as long
  as its longest answer), FreeToken keeps N in flight (continuous batching). This is how
  vLLM's ``benchmark_throughput`` compares against transformers. At 1 sequence, the first
  4 requests one after the other.

Output tokens/s counts only generated tokens (up to and including EOS), the same count
for both systems: the script checks that both produced the same tokens for every request.

    python bench/engine.py [--max-tokens 64] [--chat-max-tokens 256] [--dtype auto]
                           [--sizes 1,16,32]

Prints tokens/s for both systems, their ratio, FreeToken's peak RSS, and the peak RSS of
serving in bf16 with a 32,768-token KV cache.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from chat_prompts import chat_prompt_ids

SOLO_REQUESTS = 4


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def workload(prompts: list[list[int]], name: str, concurrency: int, args: argparse.Namespace
             ) -> tuple[list[list[int]], int, bool]:
    """The timed prompts, the token cap per request, and whether EOS ends a request."""
    if name == "fixed":
        # Prompts 2.. are timed; 0 and 1 warm up (so the prefix cache holds none of them).
        timed = prompts[2:2 + SOLO_REQUESTS] if concurrency == 1 else prompts[2:2 + concurrency]
        return timed, args.max_tokens, False
    timed = prompts[:SOLO_REQUESTS] if concurrency == 1 else prompts
    return timed, args.chat_max_tokens, True


def run_freetoken(args: argparse.Namespace) -> dict:
    from freetoken_core import LLM, SamplingParams

    llm = LLM(None, dtype=args.dtype, kv_cache_tokens=args.kv_tokens,
              max_num_seqs=args.concurrency, progress=False)
    all_prompts = chat_prompt_ids(llm.tokenizer)
    prompts, max_tokens, stop_at_eos = workload(all_prompts, args.workload, args.concurrency,
                                                args)
    # The fixed workload suppresses EOS until max_tokens (the min_tokens plugin), as
    # transformers' min_new_tokens does; plain ignore_eos would let EOS be drawn and go on.
    min_tokens = {} if stop_at_eos else {"min_tokens": max_tokens}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **min_tokens)
    # Warm-up on prompts that are not timed in the fixed workload; the chat workload's
    # prompts all share the chat template's system preamble anyway.
    llm.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=4))
    start = time.perf_counter()
    if args.concurrency == 1:
        outs = [llm.generate([p], params)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return {"elapsed": elapsed, "tokens": tokens, "peak_rss_mb": peak_rss_mb()}


def run_transformers(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from freetoken_core.models.resolve import default_gguf_path, resolve_model
    from freetoken_core.tokenizer import load_tokenizer

    model_dir = resolve_model(None, progress=False)
    tokenizer = load_tokenizer(model_dir)
    gguf = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    pad = tokenizer.pad_token_id
    prompts, max_tokens, stop_at_eos = workload(chat_prompt_ids(tokenizer), args.workload,
                                                args.concurrency, args)
    kwargs = {"max_new_tokens": max_tokens, "do_sample": False, "pad_token_id": pad}
    if not stop_at_eos:
        kwargs["min_new_tokens"] = max_tokens
    tokens: list[list[int]] = []
    with torch.inference_mode():
        model.generate(torch.tensor([[5, 6, 7, 8, 9]]), max_new_tokens=4, do_sample=False,
                       pad_token_id=pad)
        start = time.perf_counter()
        for first in range(0, len(prompts), args.concurrency):
            batch = prompts[first:first + args.concurrency]
            width = max(map(len, batch))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            out = model.generate(ids, attention_mask=mask, **kwargs)[:, width:].tolist()
            for row in out:
                if stop_at_eos:
                    # A finished row is padded until the batch's longest answer ends.
                    end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
                    row = row[:end]
                tokens.append(row)
        elapsed = time.perf_counter() - start
    return {"elapsed": elapsed, "tokens": tokens, "peak_rss_mb": peak_rss_mb()}


def spawn(system: str, name: str, concurrency: int, args: argparse.Namespace,
          dtype: str | None = None, kv_tokens: int | None = None) -> dict:
    cmd = [sys.executable, __file__, "--worker", system, "--workload", name,
           "--concurrency", str(concurrency), "--max-tokens", str(args.max_tokens),
           "--chat-max-tokens", str(args.chat_max_tokens), "--dtype", dtype or args.dtype,
           "--kv-tokens", str(kv_tokens or args.kv_tokens)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="tokens per sequence in the fixed workload")
    parser.add_argument("--chat-max-tokens", type=int, default=256,
                        help="cap per answer in the chat workload")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-tokens", type=int, default=16384)
    parser.add_argument("--workloads", default="fixed,chat")
    parser.add_argument("--sizes", default="1,16,32",
                        help="concurrent sequences, each run of each workload")
    parser.add_argument("--worker", choices=["freetoken", "transformers"])
    parser.add_argument("--workload", choices=["fixed", "chat"], default="fixed")
    parser.add_argument("--concurrency", type=int, default=1)
    args = parser.parse_args()
    if args.worker:
        run = run_transformers if args.worker == "transformers" else run_freetoken
        print(json.dumps(run(args)))
        return
    print(f"default model, greedy, FreeToken dtype={args.dtype}, transformers float32")
    print(f"{'workload':<34}{'seqs':>5}{'transformers':>15}{'FreeToken':>13}{'ratio':>8}"
          f"{'same tokens':>13}")
    peak = 0.0
    for name in args.workloads.split(","):
        label = (f"fixed: {args.max_tokens} tokens each" if name == "fixed" else
                 f"chat: 64 requests, EOS, <= {args.chat_max_tokens}")
        for concurrency in map(int, args.sizes.split(",")):
            hf = spawn("transformers", name, concurrency, args)
            ft = spawn("freetoken", name, concurrency, args)
            peak = max(peak, ft["peak_rss_mb"])
            hf_tps = sum(map(len, hf["tokens"])) / hf["elapsed"]
            ft_tps = sum(map(len, ft["tokens"])) / ft["elapsed"]
            same = sum(a == b for a, b in zip(hf["tokens"], ft["tokens"]))
            print(f"{label:<34}{concurrency:>5}{hf_tps:>11.1f} t/s{ft_tps:>9.1f} t/s"
                  f"{ft_tps / hf_tps:>7.2f}x{same:>8}/{len(ft['tokens'])}", flush=True)
    print(f"FreeToken peak RSS: {peak:.0f} MB ({args.kv_tokens}-token KV cache)")
    bf16 = spawn("freetoken", "fixed", 16, args, dtype="bfloat16", kv_tokens=32768)
    print(f"FreeToken bf16, 32768-token KV cache, 16 sequences: "
          f"{sum(map(len, bf16['tokens'])) / bf16['elapsed']:.1f} t/s, "
          f"peak RSS {bf16['peak_rss_mb']:.0f} MB")


if __name__ == "__main__":
    main()
