"""Data parallelism: two ``freetoken serve`` replicas behind SMG against the sum of each alone.

    python bench/replicas.py [--clients 16] [--max-tokens 64] [--rounds 2] [--passes 1]
                             [--cpus 0,1] [--policy cache_aware] [--serve-args '...']
                             [--router-args '...'] [--json OUT]

The deployment of docs/data_parallel.md, measured on one host: each replica pinned to a CPU
set of its own (``taskset -c``, ``--cpus``: one set per replica, ``0,1`` by default, ``0-3;4-7``
for sets of several), in four phases, each from fresh processes:

1. replica 0 alone on its CPUs, ``--clients`` concurrent clients straight at it;
2. replica 1 alone on its CPUs, the same;
3. both replicas behind ``smg launch --policy cache_aware``, ``--clients`` clients per replica
   (so each replica sees the load it saw alone) through the router;
4. both replicas with no router, half of those clients straight at each: the control that
   tells the router's cost from what the replicas, the clients and the router cost each
   other on the host's CPUs.

The figure: output tokens/s of phase 3 over the sum of phases 1 and 2 (the goal in issue 32
is at least 0.9). The workload is ``bench/vs_llamacpp.py``'s: streaming ``/v1/completions``,
every request its own prompt, ``max_tokens`` tokens with ``ignore_eos``, greedy here
(``temperature`` 0); each client sends ``--rounds`` requests back to back, after a warm-up.
With ``--passes N`` the four phases run N times in turn and each phase's figures pool its
passes (tokens over summed wall time), so that a machine whose speed drifts hits all alike.
The per-replica split of phase 3 comes from each replica's ``freetoken_requests_total``.

The bench's clients run in this process, unpinned: alone, a replica has the other CPUs free
for its clients, behind the router the clients and the router share the replicas' CPUs. On a
host with CPUs to spare, give the replicas fewer (``--cpus``) so that the clients and the
router have their own. Needs ``pip install smg`` (docs/data_parallel.md) and ``taskset``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving import free_port
from vs_llamacpp import Record, run_clients, summarise
from vs_servers import BenchError, busy_cpus, running, stop, tail

GREEDY = {"temperature": 0}
ROUTER_READY_TIMEOUT_S = 60.0


def replica_command(cpus: str, port: int, extra: list[str]) -> list[str]:
    return ["taskset", "-c", cpus, sys.executable, "-m", "freetoken_core.cli", "serve",
            "--host", "127.0.0.1", "--port", str(port), *extra]


def router_command(port: int, urls: list[str], policy: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *urls, "--policy", policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--shutdown-grace-period-secs", "0", "--log-level", "warn", *extra]


@contextmanager
def router(urls: list[str], args: argparse.Namespace, logs: Path) -> Iterator[str]:
    """``smg launch`` over ``urls``; yields its URL once it lists every one of them ready."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = logs / "router.log"
    cmd = router_command(port, urls, args.policy, shlex.split(args.router_args))
    print(f"router: {shlex.join(cmd)}", file=sys.stderr)
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + ROUTER_READY_TIMEOUT_S
        while not workers_ready(url, len(urls)):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"the router did not list {len(urls)} ready workers; "
                                 f"log: {log}\n{tail(log)}")
            time.sleep(0.5)
        yield url
    finally:
        stop(proc)


def workers_ready(url: str, num_workers: int) -> bool:
    try:
        workers = httpx.get(f"{url}/workers", timeout=5).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    return len(workers) == num_workers and all(w["is_healthy"] for w in workers)


def num_requests(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    match = re.search(r"^freetoken_requests_total (\d+)$", text, re.MULTILINE)
    return int(match.group(1)) if match else 0


def model_of(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def load(targets: list[tuple[str, int]], args: argparse.Namespace, first: int,
         max_tokens: int, rounds: int) -> tuple[list[Record], float]:
    """``(url, clients)`` pairs all at once; every request its own prompt index from
    ``first`` on; the records of all and the wall time until the last one ended."""
    models = [model_of(url) for url, _ in targets]
    offsets = [first + sum(n for _, n in targets[:i]) * rounds for i in range(len(targets))]

    async def all_targets() -> tuple[list[Record], float]:
        start = time.perf_counter()
        results = await asyncio.gather(*(
            run_clients(url, model, n, rounds, offset, max_tokens, GREEDY,
                        args.request_timeout)
            for (url, n), model, offset in zip(targets, models, offsets)))
        return [r for records, _ in results for r in records], time.perf_counter() - start

    try:
        return asyncio.run(asyncio.wait_for(all_targets(), args.timeout))
    except (TimeoutError, asyncio.TimeoutError) as exc:
        raise BenchError(f"a phase took over {args.timeout:.0f} s") from exc


@dataclass
class Phase:
    """One phase's measured requests over every pass (warm-ups left out)."""
    name: str
    num_clients: int
    records: list[Record] = field(default_factory=list)
    elapsed: float = 0.0
    served: list[int] = field(default_factory=list)
    """Requests each replica served, from their ``freetoken_requests_total``."""
    busy: list[float] = field(default_factory=list)
    """CPUs other processes kept busy just before each pass's measured load."""

    def figures(self) -> dict:
        """Tokens of every pass over their summed wall time; latencies over every request."""
        return {"phase": self.name, **summarise(self.num_clients, self.records, self.elapsed),
                "requests_per_replica": self.served, "busy_cpus_before": self.busy}


def measure(phase: Phase, targets: list[tuple[str, int]], args: argparse.Namespace,
            replica_urls: list[str]) -> None:
    """Warm-up, then the measured load, added to ``phase``."""
    warm_up = -10_000  # prompt indices no measured request uses
    load([(url, 1) for url, _ in targets], args, warm_up, 16, 1)
    load(targets, args, warm_up + 100, 2, 1)
    busy = busy_cpus()
    before = [num_requests(u) for u in replica_urls]
    records, elapsed = load(targets, args, 0, args.max_tokens, args.rounds)
    served = [num_requests(u) - b for u, b in zip(replica_urls, before)]
    phase.records += records
    phase.elapsed += elapsed
    phase.served = [a + b for a, b in zip(phase.served, served)] if phase.served else served
    if busy is not None:
        phase.busy.append(busy)
    f = summarise(phase.num_clients, records, elapsed)
    print(f"{phase.name:>22}: {f['tok_s']:8.1f} tok/s, requests per replica {served}, "
          f"ITL p50 {f['itl_p50_ms']} ms, TTFT p50 {f['ttft_p50_ms']} ms, other processes "
          f"busy on {busy} CPUs before", file=sys.stderr)


def replicas(stack: ExitStack, which: list[int], args: argparse.Namespace,
             logs: Path, tag: str) -> list[str]:
    """Replicas ``which`` (indices into ``--cpus``), each on its CPU set, until ``stack``
    closes; their URLs once each is healthy."""
    urls = []
    for i in which:
        cpus = args.cpu_sets[i]
        port = free_port()
        cmd = replica_command(cpus, port, shlex.split(args.serve_args))
        print(f"replica {i}: {shlex.join(cmd)}", file=sys.stderr)
        urls.append(stack.enter_context(running(
            f"replica {i}", cmd, port, logs / f"{tag}-replica{i}.log", args.start_timeout)))
    return urls


def run_pass(args: argparse.Namespace, logs: Path, phases: list[Phase]) -> None:
    """Every phase once, each from fresh processes: ``phases`` are each replica alone, then
    all behind the router, then all with no router."""
    everyone = list(range(len(args.cpu_sets)))
    for i in everyone:
        with ExitStack() as stack:
            (url,) = replicas(stack, [i], args, logs, "alone")
            measure(phases[i], [(url, args.clients)], args, [url])
    routed, direct = phases[len(everyone):]
    with ExitStack() as stack:
        urls = replicas(stack, everyone, args, logs, "together")
        url = stack.enter_context(router(urls, args, logs))
        measure(routed, [(url, args.clients * len(urls))], args, urls)
        measure(direct, [(u, args.clients) for u in urls], args, urls)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=16,
                        help="concurrent clients per replica (default: 16)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2,
                        help="requests each client sends back to back")
    parser.add_argument("--cpus", default="0,1",
                        help="the replicas' CPU sets for taskset -c: one CPU each as '0,1', "
                             "sets as '0-3;4-7' (default: 0,1)")
    parser.add_argument("--passes", type=int, default=1,
                        help="run every phase this many times, alternating, and pool them: "
                             "a machine whose speed drifts hits every phase alike")
    parser.add_argument("--policy", default="cache_aware")
    parser.add_argument("--serve-args", default="--max-num-seqs 16",
                        help="`freetoken serve` options for every replica "
                             "(default: --max-num-seqs 16)")
    parser.add_argument("--router-args", default="", help="more `smg launch` options")
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds one phase's load may take")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--json", default=None, metavar="OUT")
    args = parser.parse_args(argv)
    args.cpu_sets = args.cpus.split(";") if ";" in args.cpus else args.cpus.split(",")
    if len(args.cpu_sets) < 2 or args.clients < 1 or args.max_tokens < 1 or args.rounds < 1 \
            or args.passes < 1:
        parser.error("two or more CPU sets; --clients, --max-tokens, --rounds, --passes "
                     "positive")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if shutil.which("taskset") is None:
        raise SystemExit("taskset not found (util-linux)")
    try:
        import smg  # noqa: F401
    except ImportError:
        raise SystemExit("the router is SMG: pip install smg") from None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks
    logs = Path(tempfile.mkdtemp(prefix="replicas-"))
    print(f"logs: {logs}", file=sys.stderr)
    n = len(args.cpu_sets)
    phases = [*(Phase(f"replica {i} alone", args.clients) for i in range(n)),
              Phase(f"{n} behind {args.policy}", args.clients * n),
              Phase(f"{n} direct, no router", args.clients * n)]
    try:
        for _ in range(args.passes):
            run_pass(args, logs, phases)
    except (BenchError, httpx.HTTPError, OSError) as exc:
        raise SystemExit(f"failed: {exc}") from exc
    figures = [p.figures() for p in phases]
    alone, (routed, direct) = figures[:n], figures[n:]
    total = sum(p["tok_s"] for p in alone)
    print(f"{args.max_tokens} tokens per request (ignore_eos, greedy), streaming "
          f"/v1/completions, {args.clients} clients per replica, {args.rounds} round(s), "
          f"{args.passes} pass(es); "
          f"replicas on CPUs {' / '.join(args.cpu_sets)}")
    print("| phase | clients | tok/s | requests per replica | ITL p50 ms | TTFT p50 ms |")
    print("|---|---:|---:|---|---:|---:|")
    for p in figures:
        print(f"| {p['phase']} | {p['clients']} | {p['tok_s']:.1f} | "
              f"{p['requests_per_replica']} | {p['itl_p50_ms']} | {p['ttft_p50_ms']} |")
    print(f"router / sum of alone: {routed['tok_s']:.1f} / {total:.1f} = "
          f"{routed['tok_s'] / total:.2f}")
    print(f"router / direct (same load, no router): {routed['tok_s'] / direct['tok_s']:.2f}")
    busy = [b for p in figures for b in p["busy_cpus_before"]]
    if busy and max(busy) > 0.3:
        print(f"note: other processes kept up to {max(busy)} CPUs busy before a phase: "
              "the figures are low and noisy")
    if args.json:
        meta = {k: v for k, v in vars(args).items() if k != "cpu_sets"}
        Path(args.json).write_text(json.dumps({"meta": meta, "phases": figures}, indent=2) + "\n")


if __name__ == "__main__":
    main()
