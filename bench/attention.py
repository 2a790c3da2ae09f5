"""The native decode attention over the paged KV cache, alone: the default model's 30 layers.

16 sequences (``--sequences``) decode one token each against their contexts (``--context``
keys for the first, 7 fewer for each next one), the default model's heads (9 query heads,
3 KV heads of 64), each layer's cache in huge pages as the engine's, blocks of 16 slots scattered over each layer's cache as a long-running
server leaves them (``--in-order``: one after another), a cache of ``--kv-cache-dtype``.
Prints the median milliseconds of the 30 layers' ``paged_decode_attention`` calls and the
GB/s of keys and values they read. A long context's layers do not fit in the CPU's caches,
so this is the memory-bound case of a decode step (at 16 sequences of ~1,100 keys the
30 layers read 811 MB of a float32 cache); ``--layers 1`` with a short context keeps one
layer in the caches, the compute-bound case.

    python bench/attention.py [--context 1100] [--sequences 16] [--layers 30]
        [--kv-cache-dtype float32|float16|bfloat16] [--in-order] [--threads N] [--repeat 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=1100)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-cache-dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--in-order", action="store_true",
                        help="each sequence's blocks one after another in the cache")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    lens = [args.context - 7 * i for i in range(args.sequences)]
    if min(lens) < 1:
        parser.error("--context must leave every sequence a key (7 fewer for each next one)")
    from freetoken_core import hugepages
    from freetoken_core.kernels import cpu_kernels_available

    assert cpu_kernels_available(), "the native kernels could not be built"
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    width = (args.context + BLOCK - 1) // BLOCK
    num_blocks = args.sequences * width
    order = torch.arange(num_blocks) if args.in_order else torch.randperm(num_blocks)
    tables = order.view(args.sequences, width).to(torch.int32)
    dtype = DTYPES[args.kv_cache_dtype]
    caches = []
    for _ in range(args.layers):  # in huge pages, as the engine's cache (hugepages.py)
        cache = hugepages.zeros((num_blocks * BLOCK, 2, KV_HEADS, HEAD_DIM), dtype)
        cache.copy_(torch.randn(cache.shape))
        caches.append(cache)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(args.sequences, HEADS, HEAD_DIM)
    out = torch.empty_like(q)
    attend = torch.ops.freetoken.paged_decode_attention

    def step() -> float:
        start = time.perf_counter()
        for cache in caches:
            attend(q, cache, tables, context_lens, BLOCK, HEAD_DIM ** -0.5, out)
        return time.perf_counter() - start

    for _ in range(3):
        step()
    seconds = statistics.median(step() for _ in range(args.repeat))
    read = sum(lens) * args.layers * 2 * KV_HEADS * HEAD_DIM * caches[0].element_size()
    print(f"{args.kv_cache_dtype} cache, {args.sequences} sequences of up to {args.context} "
          f"keys, {args.layers} layers, blocks {'in order' if args.in_order else 'scattered'}, "
          f"{torch.get_num_threads()} threads: {seconds * 1000:.2f} ms, "
          f"{read / seconds / 1e9:.1f} GB/s of keys and values")


if __name__ == "__main__":
    main()
