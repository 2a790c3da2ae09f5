"""Tensor parallelism's communication on one device, for ``bench/gpu_check.py``: the
group of one rank (TP=1) over NCCL on CUDA (gloo on the CPU).

It forms a group with ``init_communicator`` (NCCL for a CUDA device: ``backend_for``), runs
each collective once and checks its result (all-reduce, gather to rank 0, the step
broadcast), then builds a random Llama-shaped model twice, as one rank's part of a
tensor-parallel model (``Shard``: every linear's output through the group) and plain, and
checks that a prefill and a decode step give bitwise equal logits: one rank's all-reduce
and gather return what they are given.

    python bench/gpu_nccl.py --device cuda

Prints one JSON line: backend, device, the collectives' median microseconds, the logits'
largest difference (0.0 expected). Exit status 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_decode import SHAPES, write_random_llama

from freetoken_core.distributed.comm import backend_for, init_communicator
from freetoken_core.engine.tensor_parallel import free_port
from freetoken_core.models.attention import AttentionMetadata
from freetoken_core.models.loader import load_model
from freetoken_core.models.sharding import Shard


def timed_us(fn, repeats: int = 50) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def logits_of(model, device: torch.device, block_size: int = 16) -> torch.Tensor:
    """A 12-token prefill then one decode step; both steps' last logits."""
    cfg = model.config
    caches = torch.zeros((cfg.num_layers, 4 * block_size, 2, model.num_kv_heads,
                          cfg.head_dim), dtype=model.embedding.dtype, device=device)
    ids = torch.arange(3, 15, device=device)
    out = []
    for tokens, start in ((ids, 0), (ids[-1:], 12)):
        n = len(tokens)
        meta = AttentionMetadata.build([[0, 1]], [start + n], [n], block_size, device,
                                       native=model.native)
        pos = torch.arange(start, start + n, device=device)
        with torch.inference_mode():
            hidden = model.forward(tokens, pos, caches, meta)
            out.append(model.compute_logits(hidden[-1:]))
    return torch.cat(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    comm = init_communicator(0, 1, "127.0.0.1", free_port(), device, same_node=True)
    x = torch.randn(16, 576, device=device)
    reduced = x.clone()
    comm.all_reduce(reduced)
    gathered = comm.gather_to_first(x)
    ok = torch.equal(reduced, x) and len(gathered) == 1 and torch.equal(gathered[0], x)
    ok = ok and comm.broadcast_bytes(b"step") == b"step"
    figures = {"all_reduce_us": timed_us(lambda: comm.all_reduce(reduced)),
               "gather_us": timed_us(lambda: comm.gather_to_first(x)),
               "broadcast_us": timed_us(lambda: comm.broadcast_bytes(b"x" * 300))}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_random_llama(Path(tmp), SHAPES["tiny"], torch.float32, device)
        plain = load_model(model_dir, torch.float32, device, 2048)
        sharded = load_model(model_dir, torch.float32, device, 2048, shard=Shard(0, 1, comm))
        diff = (logits_of(plain, device) - logits_of(sharded, device)).abs().max().item()
    comm.close()
    ok = ok and diff == 0.0
    print(json.dumps({"backend": backend_for(device), "device": str(device),
                      "collectives_ok": ok, "logits_max_diff": diff,
                      **{k: round(v, 1) for k, v in figures.items()}}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
