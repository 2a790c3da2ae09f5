"""The native linear kernels on every GGUF block type, one process, alternating.

For each type, the linears of one block of a model shape (``--shape``: ``1b``, a
Llama-3.2-1B-shaped block, q/k/v fused 3072 x 2048, o 2048 x 2048, gate/up 16384 x 2048,
down 2048 x 8192; ``smollm``, the default model's 576-wide block, only the types whose
blocks fit its rows) run through ``torch.ops.freetoken.gguf_linear`` on random blocks,
at each row count. Prints milliseconds per call of the block's four linears, the blocks'
GB/s (bytes of weights read per second) and the time against Q8_0's, the type llama.cpp's
CPU backend also computes fastest per byte.

``--activations q8`` times the 8-bit-activation kernel instead (``gguf_linear_q8``, the types
it has: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K), ``int24`` the exact integer kernel (the default
where the CPU has AVX-512 VNNI: ``gguf_linear_int``, its types, in its layout), ``both`` each
type with the float32 and q8 kernels (rows ``Q4_K q8`` beside ``Q4_K``), ``all`` with the
three (``Q4_K int24`` too), in the same alternation.

    python bench/gguf_types.py [--shape 1b] [--rows 1,4,16,64] [--repeat 10]
        [--types Q4_0,Q4_K,...] [--activations float32|q8|int24|both|all]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

SHAPES = {
    "1b": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)],
    "smollm": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--types", default=None, help="comma-separated type names")
    parser.add_argument("--activations", choices=["float32", "q8", "int24", "both", "all"],
                        default="float32")
    args = parser.parse_args()
    from gguf import GGMLQuantizationType
    from gguf_models import random_blocks

    from freetoken_core.kernels import cpu_kernels_available
    from freetoken_core.models.block_layout import (
        INT24_TYPES,
        NATIVE_UNITS,
        Q8_ACTIVATION_TYPES,
        int_blocks,
        int_linear_available,
        kernel_blocks,
        q8_blocks,
    )
    from freetoken_core.models.gguf_weights import GGUF_TYPES

    assert cpu_kernels_available(), "the native kernels could not be built"
    shape = SHAPES[args.shape]
    names = {GGMLQuantizationType(t).name: t for t in GGUF_TYPES}
    chosen = args.types.split(",") if args.types else sorted(names, key=names.get)
    rng = np.random.default_rng(0)
    weights = {}
    for name in chosen:
        qtype = names[name]
        if any(k % NATIVE_UNITS[qtype][0] for _, k in shape):
            continue
        blocks = [kernel_blocks(torch.from_numpy(random_blocks(rng, qtype, n, k)), qtype)
                  for n, k in shape]
        several = args.activations in ("both", "all")
        if args.activations in ("float32", "both", "all"):
            weights[name] = (qtype, blocks, torch.ops.freetoken.gguf_linear)
        if args.activations in ("q8", "both", "all") and qtype in Q8_ACTIVATION_TYPES:
            weights[f"{name} q8" if several else name] = (
                qtype, [q8_blocks(b, qtype) for b in blocks],
                torch.ops.freetoken.gguf_linear_q8)
        if (args.activations in ("int24", "all") and qtype in INT24_TYPES
                and int_linear_available()):
            weights[f"{name} int24" if several else name] = (
                qtype, [int_blocks(b, qtype) for b in blocks],
                torch.ops.freetoken.gguf_linear_int)
    rows_list = [int(r) for r in args.rows.split(",")]
    xs = {r: [torch.randn(r, k) for _, k in shape] for r in rows_list}
    outs = {r: [torch.empty(r, n) for n, _ in shape] for r in rows_list}
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.repeat):
        for name, (qtype, blocks, kernel) in weights.items():
            for r in rows_list:
                start = time.perf_counter()
                for x, b, out in zip(xs[r], blocks, outs[r]):
                    kernel(x, b, qtype, out)
                times.setdefault((name, r), []).append(time.perf_counter() - start)
    print(f"shape {args.shape}, {torch.get_num_threads()} threads, ms per block's four "
          "linears (median), GB/s of blocks, time / Q8_0's")
    print(f"{'type':10}" + "".join(f"{f'{r} rows':>26}" for r in rows_list))
    for name, (_, blocks, _) in weights.items():
        nbytes = sum(b.numel() for b in blocks)
        cells = []
        for r in rows_list:
            ms = statistics.median(times[(name, r)]) * 1e3
            base = statistics.median(times.get(("Q8_0", r), [float("nan")])) * 1e3
            cells.append(f"{ms:9.2f} {nbytes / ms / 1e6:7.1f} {ms / base:7.2f}x")
        print(f"{name:10}" + "".join(f"{c:>26}" for c in cells))


if __name__ == "__main__":
    main()
