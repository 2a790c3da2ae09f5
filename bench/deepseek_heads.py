"""DeepSeek GGUF files' per-head latent linears (``attn_k_b`` / ``attn_v_b``): a layer's heads
in one native call (``gguf_linear_heads``, models/linear.HeadLinears) against one Python
linear call a head, alternating in one process.

Writes a random-weight V3-like ``deepseek2`` file (``--heads`` heads, latent 512, 64 + 32
query dimensions, values of 64, Q8_0, 4 layers; tests/gguf_deepseek2_files.py, as llama.cpp's
converter names it) into ``--dir`` once, loads it, and prints microseconds per call of one
layer's k_b and v_b at each row count.

    python bench/deepseek_heads.py [--heads 64] [--rows 1,16] [--dir DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--dir", type=Path, default=Path.home() / ".cache/freetoken/bench")
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    from gguf_deepseek2_files import deepseek_model, write_deepseek2_gguf

    from freetoken_core import LLM

    args.dir.mkdir(parents=True, exist_ok=True)
    path = args.dir / f"deepseek2-v3-like-{args.heads}-heads.gguf"
    if not path.exists():
        hf = deepseek_model(49152, seed=3, hidden_size=1024, num_attention_heads=args.heads,
                            num_key_value_heads=args.heads, q_lora_rank=384,
                            kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=32,
                            v_head_dim=64, num_hidden_layers=4, first_k_dense_replace=1,
                            intermediate_size=1024, moe_intermediate_size=256,
                            n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                            topk_group=2)
        partial = path.with_suffix(".partial")
        write_deepseek2_gguf(partial, hf)
        partial.rename(path)
    llm = LLM(str(path), kv_cache_tokens=1024, dtype="float32", progress=False, plugins="none")
    attn = llm.engine.core.runner.model.layers[0].attn
    assert attn.k_b is not None, "the file's kv_b is not split per head"
    print(f"{args.heads} heads, {torch.get_num_threads()} threads, us per call (median of 3 "
          "alternations)")
    for rows in (int(r) for r in args.rows.split(",")):
        for name, heads in (("k_b", attn.k_b), ("v_b", attn.v_b)):
            lin = heads.linears[0]
            x = torch.randn(rows, len(heads), lin.in_features)
            times: dict[bool, list[float]] = {True: [], False: []}
            for one_call in (True, False) * 3:
                heads.one_call = one_call
                for _ in range(10):
                    heads(x)
                start = time.perf_counter()
                for _ in range(args.repeat):
                    heads(x)
                times[one_call].append((time.perf_counter() - start) / args.repeat * 1e6)
            heads.one_call = True
            print(f"rows {rows:3} {name} ({len(heads)} x {lin.out_features}x{lin.in_features}):"
                  f" one call {statistics.median(times[True]):8.1f}, a call a head "
                  f"{statistics.median(times[False]):8.1f}")


if __name__ == "__main__":
    main()
