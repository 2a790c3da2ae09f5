"""The linears of the default model's block, from its GGUF blocks against float32 GEMMs.

For each row count, the four projections of one SmolLM2-135M block (q/k/v fused 960 x 576,
o 576 x 576, gate/up fused 3072 x 576, down 576 x 1536) and the tied LM head (49,152 x 576,
Q8_0) run through ``torch.ops.freetoken.gguf_linear`` (the float32 kernel, Q4_1 / Q8_0
blocks of random weights), through ``gguf_linear_int`` (the int24 kernel, where the CPU has
AVX-512 VNNI) and through the oneDNN-packed float32 GEMM of the same dequantized weights,
alternating, in one process. Prints milliseconds per call of the block's four and of the
head, the GEMM's time over the float32 kernel's, and GFLOP/s; with int24, its milliseconds
and the float32 kernel's time over its.

    python bench/gguf_linear.py [--rows 1,2,4,8,9,16,17,24,32,48,64,128,256] [--repeat 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

BLOCK = [(960, 576, 3), (576, 576, 3), (3072, 576, 3), (576, 1536, 3)]
HEAD = [(49152, 576, 8)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,9,16,17,24,32,48,64,128,256")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    from gguf import quants
    from gguf.constants import GGMLQuantizationType

    from freetoken_core.kernels import cpu_kernels_available
    from freetoken_core.models.block_layout import int_blocks, int_linear_available
    from freetoken_core.models.linear import Linear

    assert cpu_kernels_available(), "the native kernels could not be built"
    torch.manual_seed(0)

    def build(shapes: list[tuple[int, int, int]]) -> tuple[list[Linear], list[Linear], float]:
        ggufs, gemms, flop = [], [], 0.0
        for n, k, qtype in shapes:
            blocks = quants.quantize(torch.randn(n, k).numpy() * 0.05,
                                     GGMLQuantizationType(qtype))
            weight = torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType(qtype)))
            ggufs.append(Linear(weight, blocks=(qtype, torch.from_numpy(blocks))))
            gemms.append(Linear(weight))
            flop += 2.0 * n * k
        return ggufs, gemms, flop

    def timed(linears: list[Linear], x: dict[int, torch.Tensor]) -> float:
        start = time.perf_counter()
        for lin in linears:
            lin(x[lin.in_features])
        return (time.perf_counter() - start) * 1000

    def timed_int(linears: list[tuple[int, int, int, torch.Tensor]],
                  x: dict[int, torch.Tensor], out: dict[int, torch.Tensor]) -> float:
        start = time.perf_counter()
        for n, k, qtype, blocks in linears:
            torch.ops.freetoken.gguf_linear_int(x[k], blocks, qtype, out[n])
        return (time.perf_counter() - start) * 1000

    with_int = int_linear_available()
    print(f"{'rows':>5}  {'what':<6}{'GGUF ms':>10}{'fp32 ms':>10}{'ratio':>8}"
          f"{'GGUF GFLOP/s':>14}{'fp32 GFLOP/s':>14}"
          + (f"{'int24 ms':>10}{'GGUF/int24':>12}" if with_int else ""))
    for name, shapes in (("block", BLOCK), ("head", HEAD)):
        ggufs, gemms, flop = build(shapes)
        ints = [(lin.out_features, lin.in_features, lin.blocks[0],
                 int_blocks(lin.blocks[1], lin.blocks[0])) for lin in ggufs] if with_int else []
        for rows in map(int, args.rows.split(",")):
            x = {k: torch.randn(rows, k) for k in {s[1] for s in shapes}}
            out = {n: torch.empty(rows, n) for n in {s[0] for s in shapes}}
            times: dict[str, list[float]] = {"gguf": [], "fp32": [], "int": []}
            for _ in range(2):  # warm-up
                timed(ggufs, x), timed(gemms, x)
                if with_int:
                    timed_int(ints, x, out)
            for _ in range(args.repeat):
                times["gguf"].append(timed(ggufs, x))
                times["fp32"].append(timed(gemms, x))
                if with_int:
                    times["int"].append(timed_int(ints, x, out))
            g, f = statistics.median(times["gguf"]), statistics.median(times["fp32"])
            line = (f"{rows:>5}  {name:<6}{g:>10.3f}{f:>10.3f}{f / g:>7.2f}x"
                    f"{flop * rows / g / 1e6:>14.1f}{flop * rows / f / 1e6:>14.1f}")
            if with_int:
                i = statistics.median(times["int"])
                line += f"{i:>10.3f}{g / i:>11.2f}x"
            print(line, flush=True)


if __name__ == "__main__":
    main()
