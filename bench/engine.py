"""End-to-end generation speed: FreeToken against Hugging Face transformers ``generate``.

Same model (the embedded default, SmolLM2-135M-Instruct, dequantized to float32), same
chat prompts, same number of greedy output tokens, measured in one run. Each system runs
in its own subprocess so that peak RSS is its own.

    python bench/engine.py [--max-tokens 64] [--dtype auto]

Prints output tokens/s at 1 and 16 concurrent sequences for both, their ratio, FreeToken's
peak RSS, and the peak RSS of serving in bf16 with a 32,768-token KV cache.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

TOPICS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "Explain gravity to a child.", "List three fruits and their colours.",
    "Give me a tip for staying focused.", "What is 12 times 7?",
    "Summarise Romeo and Juliet.", "Describe a cat in one paragraph.",
    "Why is the sky blue?", "Name three programming languages.",
    "How do plants make food?", "Write a limerick about a robot.",
    "What is a prime number?", "Suggest a name for a bakery.",
    "How far is the Moon?", "Tell me a fun fact about octopuses.",
]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def prompt_ids(tokenizer) -> list[list[int]]:
    from freetoken_core.tokenizer import apply_chat_template

    return [tokenizer.encode(apply_chat_template(tokenizer, [{"role": "user", "content": t}]),
                             add_special_tokens=False) for t in TOPICS]


def run_freetoken(concurrency: int, max_tokens: int, dtype: str, kv_tokens: int) -> dict:
    from freetoken_core import LLM, SamplingParams

    llm = LLM(None, dtype=dtype, kv_cache_tokens=kv_tokens, progress=False)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = prompt_ids(llm.tokenizer)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    # Different prompts from the timed ones would leave the prefix cache cold; disable
    # its effect by timing prompts that were never run before.
    start = time.perf_counter()
    if concurrency == 1:
        outs = [llm.generate([p], params)[0] for p in prompts[2:6]]
    else:
        outs = llm.generate(prompts[:concurrency], params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tok_s": tokens / elapsed, "peak_rss_mb": peak_rss_mb()}


def run_transformers(concurrency: int, max_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from freetoken_core.models.resolve import resolve_model
    from freetoken_core.tokenizer import load_tokenizer

    model_dir = resolve_model(None, progress=False)
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = prompt_ids(tokenizer)
    kwargs = {"max_new_tokens": max_tokens, "min_new_tokens": max_tokens, "do_sample": False,
              "pad_token_id": tokenizer.pad_token_id}
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False)
        start = time.perf_counter()
        if concurrency == 1:
            for p in prompts[2:6]:
                model.generate(torch.tensor([p]), **kwargs)
            tokens = 4 * max_tokens
        else:
            batch = prompts[:concurrency]
            width = max(map(len, batch))
            ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            model.generate(ids, attention_mask=mask, **kwargs)
            tokens = len(batch) * max_tokens
        elapsed = time.perf_counter() - start
    return {"tok_s": tokens / elapsed, "peak_rss_mb": peak_rss_mb()}


def worker(args: argparse.Namespace) -> None:
    if args.worker == "transformers":
        result = run_transformers(args.concurrency, args.max_tokens)
    else:
        result = run_freetoken(args.concurrency, args.max_tokens, args.dtype, args.kv_tokens)
    print(json.dumps(result))


def spawn(system: str, concurrency: int, args: argparse.Namespace, dtype: str | None = None,
          kv_tokens: int | None = None) -> dict:
    cmd = [sys.executable, __file__, "--worker", system, "--concurrency", str(concurrency),
           "--max-tokens", str(args.max_tokens), "--dtype", dtype or args.dtype,
           "--kv-tokens", str(kv_tokens or args.kv_tokens)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-tokens", type=int, default=8192)
    parser.add_argument("--worker", choices=["freetoken", "transformers"])
    parser.add_argument("--concurrency", type=int, default=1)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    rows = {}
    for system in ("transformers", "freetoken"):
        rows[system] = {c: spawn(system, c, args) for c in (1, 16)}
    bf16 = spawn("freetoken", 16, args, dtype="bfloat16", kv_tokens=32768)
    print(f"default model, {args.max_tokens} greedy output tokens per sequence, "
          f"FreeToken dtype={args.dtype}")
    print(f"{'':<28}{'1 sequence':>14}{'16 sequences':>16}")
    for system, label in (("transformers", "transformers generate fp32"),
                          ("freetoken", "FreeToken")):
        r = rows[system]
        print(f"{label:<28}{r[1]['tok_s']:>10.1f} t/s{r[16]['tok_s']:>12.1f} t/s")
    ratio = [rows["freetoken"][c]["tok_s"] / rows["transformers"][c]["tok_s"] for c in (1, 16)]
    print(f"{'ratio FreeToken / HF':<28}{ratio[0]:>12.2f}x{ratio[1]:>14.2f}x")
    print(f"FreeToken peak RSS: {rows['freetoken'][16]['peak_rss_mb']:.0f} MB "
          f"({args.kv_tokens}-token KV cache)")
    print(f"FreeToken bf16, 32768-token KV cache, 16 sequences: {bf16['tok_s']:.1f} t/s, "
          f"peak RSS {bf16['peak_rss_mb']:.0f} MB")


if __name__ == "__main__":
    main()
