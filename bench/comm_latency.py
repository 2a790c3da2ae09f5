"""All-reduce latency between 2 ranks on this machine: the shared-memory path against gloo.

Each rank is a process with one torch thread; both run the same all-reduces back to back,
and rank 0 prints the median, 10th percentile and minimum of its per-call times for each shape of float32 hidden
states (a decode step of 1, 16 and 64 sequences of a 576-wide model), over the
shared-memory channel (``same_node=True``) and over gloo on loopback (``same_node=False``).

    python bench/comm_latency.py [--iters 2000]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time

import torch
import torch.multiprocessing as mp

from freetoken_core.distributed.comm import init_communicator

SHAPES = [(1, 576), (16, 576), (64, 576)]
WARMUP = 100


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, port: int, same_node: bool, iters: int) -> None:
    torch.set_num_threads(1)
    comm = init_communicator(rank, 2, "127.0.0.1", port, torch.device("cpu"), same_node)
    for shape in SHAPES:
        t = torch.randn(shape)
        times = []
        for i in range(WARMUP + iters):
            start = time.perf_counter()
            comm.all_reduce(t)
            times.append(time.perf_counter() - start)
            t.mul_(0.5)  # keep the values finite
        if rank == 0:
            path = "shm " if same_node else "gloo"
            timed = sorted(times[WARMUP:])
            median_us, p10_us = statistics.median(timed) * 1e6, timed[len(timed) // 10] * 1e6
            print(f"{path} {list(shape)!s:>10}  median {median_us:8.1f} us"
                  f"  p10 {p10_us:8.1f} us  min {timed[0] * 1e6:8.1f} us", flush=True)
    comm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    for same_node in (True, False):
        port = free_port()
        ranks = [ctx.Process(target=rank_main, args=(r, port, same_node, args.iters))
                 for r in range(2)]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join()


if __name__ == "__main__":
    main()
