"""Tensor parallelism on one host: ``freetoken serve`` at TP=1 against TP=2, and the cost of
TP=2's communication.

    python bench/parallel.py [--clients 1,16] [--max-tokens 64] [--rounds 1] [--passes 2]
                             [--serve-args '...'] [--json OUT]

Two servers of the default model (``--serve-args`` may name another), never both at once,
each a fresh ``freetoken serve`` per pass:

* TP=1, ``--tensor-parallel-size 1``: the ordinary engine, its torch threads over every CPU
  (2 on a 2-core machine; ``--pin-threads`` puts its main thread alone on the lowest CPU);
* TP=2, ``--tensor-parallel-size 2``: the weights split over two processes (rank 0 the engine
  process, rank 1 its child), each pinned to its own run of CPUs with as many torch threads
  (one each on 2 cores, ``freetoken_core/engine/tensor_parallel.py`` ``rank_cpus``), meeting
  in the all-reduces of every layer, the logits gather and the broadcast of each step's plan.

The workload is ``bench/vs_llamacpp.py``'s, greedy: streaming ``/v1/completions``, every
request its own prompt, ``--max-tokens`` tokens with ``ignore_eos``, ``temperature`` 0. After a
warm-up (one request, then one short request per client of the largest count), for each
client count N: N concurrent clients, each sending ``--rounds`` requests back to back.
``--passes N`` runs both servers N times, alternating and in mirrored order (TP=1, TP=2,
TP=2, TP=1, ...) so that a machine whose speed drifts over minutes hits both alike; every
figure pools the passes (tokens over summed wall time, step and communication seconds over
summed steps), and a note gives each pass's ratio.

The columns, per client count:

* tok/s: output tokens of every request / the wall time of that client count; TP2/TP1 their
  ratio (the goal in issue 32: at least 0.8 at 16 clients on 2 cores);
* step ms: the engine's mean step (``GET /internal/stats``: ``step_seconds`` over
  ``num_steps``, read before and after the client count; nearly all decode steps here, the
  mean decode step alone is in ``--json``);
* comm ms/step: rank 0's wall time in the group's collectives over the same steps
  (``comm_seconds`` / ``num_steps``), waiting for the other rank included (so an imbalance
  between the ranks counts as communication); comm share: its part of TP=2's step.

How to read it: on 2 cores TP=2 cannot win, the two ranks do the work TP=1's two threads do,
only split by layer outputs instead of by the rows of each matmul, and they must meet twice
per layer. The figure is what that meeting costs: TP=2's step less its communication (the
"compute" in the notes) against TP=1's step says how much of the gap is communication and
how much the split itself. Nothing else has a CPU of its own: the bench's clients run
unpinned, and ``--pin-threads`` (the default) puts the server's HTTP process on every CPU but
the lowest, at TP=1 beside the engine's OpenMP worker, at TP=2 on 2 cores beside rank 1. Its
work per token (16 streams at 16 clients) then slows rank 1, and rank 0's wait for it in the
collectives counts as communication. Server logs go to a temporary directory named at the
start; the script exits 1 when a server fails, after printing what ran.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving import free_port
from sse_client import HTTPStreamError
from vs_llamacpp import Record, run_clients, summarise
from vs_servers import BenchError, busy_cpus, running

GREEDY = {"temperature": 0}
SIZES = (1, 2)
BUSY_WARNING = 0.3
STAT_KEYS = ("num_steps", "step_seconds", "num_decode_steps", "decode_step_seconds",
             "comm_seconds", "num_comm_calls")


def serve_command(tp: int, port: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "freetoken_core.cli", "serve", "--host", "127.0.0.1",
            "--port", str(port), "--tensor-parallel-size", str(tp), *extra]


def engine_stats(url: str) -> dict[str, float]:
    stats = httpx.get(f"{url}/internal/stats", timeout=30).json()
    return {k: float(stats.get(k, 0)) for k in STAT_KEYS}


@dataclass
class Count:
    """One server's runs of one client count, pooled over passes."""
    records: list[Record] = field(default_factory=list)
    elapsed: float = 0.0
    stats: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAT_KEYS, 0.0))
    per_pass_tok_s: list[float] = field(default_factory=list)

    def figures(self, num_clients: int) -> dict:
        s = self.stats
        steps, decode_steps = s["num_steps"], s["num_decode_steps"]

        def per_step(seconds: float, count: float) -> float | None:
            return round(seconds / count * 1000, 3) if count else None

        return {**summarise(num_clients, self.records, self.elapsed),
                "step_ms": per_step(s["step_seconds"], steps),
                "decode_step_ms": per_step(s["decode_step_seconds"], decode_steps),
                "comm_ms_per_step": per_step(s["comm_seconds"], steps),
                "comm_share": round(s["comm_seconds"] / s["step_seconds"], 4)
                if s["step_seconds"] else None,
                "comm_calls_per_step": round(s["num_comm_calls"] / steps, 2) if steps else None,
                "per_pass_tok_s": self.per_pass_tok_s,
                "engine": {k: round(v, 6) for k, v in s.items()}}


@dataclass
class Side:
    tp: int
    counts: dict[int, Count] = field(default_factory=dict)
    busy: list[float] = field(default_factory=list)
    failure: str | None = None


def run_load(url: str, model: str, args: argparse.Namespace, num_clients: int, rounds: int,
             first: int, max_tokens: int) -> tuple[list[Record], float]:
    try:
        return asyncio.run(asyncio.wait_for(run_clients(
            url, model, num_clients, rounds, first, max_tokens, GREEDY, args.request_timeout),
            args.timeout))
    except (TimeoutError, asyncio.TimeoutError) as exc:
        raise BenchError(f"{num_clients} clients took over {args.timeout:.0f} s") from exc
    except (httpx.HTTPError, HTTPStreamError, OSError) as exc:
        raise BenchError(f"{num_clients} clients: {type(exc).__name__}: {exc}") from exc


def measure(side: Side, url: str, args: argparse.Namespace) -> None:
    """Warm-up, then every client count: its records, wall time and engine-stats deltas."""
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    warm_up = -10_000  # prompt indices no measured request uses
    run_load(url, model, args, 1, 1, warm_up, 16)
    run_load(url, model, args, max(args.client_counts), 1, warm_up + 1, 4)
    for i, n in enumerate(args.client_counts):
        before = engine_stats(url)
        records, elapsed = run_load(url, model, args, n, args.rounds, i * 1000,
                                    args.max_tokens)
        after = engine_stats(url)
        delta = {k: after[k] - before[k] for k in STAT_KEYS}
        if side.tp > 1 and delta["num_comm_calls"] == 0:
            raise BenchError(f"TP={side.tp} made no collective calls: not tensor parallel?")
        count = side.counts.setdefault(n, Count())
        count.records += records
        count.elapsed += elapsed
        for k in STAT_KEYS:
            count.stats[k] += delta[k]
        f = summarise(n, records, elapsed)
        count.per_pass_tok_s.append(f["tok_s"])
        steps = delta["num_steps"] or 1
        print(f"TP={side.tp}, {n:>3} clients: {f['tok_s']:8.1f} tok/s, ITL p50 "
              f"{f['itl_p50_ms']} ms, step {delta['step_seconds'] / steps * 1000:.2f} ms, "
              f"comm {delta['comm_seconds'] / steps * 1000:.2f} ms/step "
              f"({int(delta['num_steps'])} steps)", file=sys.stderr)


def run_side(side: Side, args: argparse.Namespace, logs: Path, pass_index: int) -> None:
    """Start one server, measure it (every client count), stop it."""
    busy = busy_cpus()
    if busy is not None:
        side.busy.append(busy)
        if busy > BUSY_WARNING:
            print(f"warning: other processes keep {busy} CPUs busy before TP={side.tp} "
                  "starts: its figures will be low and noisy", file=sys.stderr)
    port = free_port()
    cmd = serve_command(side.tp, port, shlex.split(args.serve_args))
    print(f"TP={side.tp}: {shlex.join(cmd)}", file=sys.stderr)
    try:
        with running(f"TP={side.tp}", cmd, port, logs / f"tp{side.tp}-{pass_index + 1}.log",
                     args.start_timeout) as url:
            measure(side, url, args)
    except (BenchError, httpx.HTTPError, OSError) as exc:
        side.failure = str(exc)
        print(f"TP={side.tp} failed: {exc}", file=sys.stderr)


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def step_note(n: int, one: dict, two: dict) -> list[str]:
    """TP=2's step cut into compute and communication, against TP=1's step."""
    step, comm, calls = two["step_ms"], two["comm_ms_per_step"], two["comm_calls_per_step"]
    if not step or comm is None or not calls or not one["step_ms"] or step <= comm:
        return []
    compute = step - comm
    note = (f"{n} clients: TP=2 step {step:.2f} ms = compute {compute:.2f} + comm {comm:.2f} "
            f"ms ({calls:g} collectives/step, {comm / calls * 1000:.0f} us each); TP=1 step "
            f"{one['step_ms']:.2f} ms: with free communication TP=2 would step at "
            f"{one['step_ms'] / compute:.2f}x TP=1's speed")
    return [note]


def report(args: argparse.Namespace, sides: dict[int, Side]) -> None:
    figures = {tp: {n: c.figures(n) for n, c in side.counts.items()}
               for tp, side in sides.items()}
    print(f"default model{' ' + args.serve_args if args.serve_args else ''}, "
          f"{args.max_tokens} tokens per request (ignore_eos, greedy), streaming "
          f"/v1/completions, {args.rounds} round(s) per client, {args.passes} pass(es) per "
          f"server, alternating; {os.cpu_count()} CPUs")
    git = git_state()
    if git is not None:
        print(f"freetoken at {git['head'][:7]}"
              + (f" with uncommitted changes in {', '.join(git['changed'])}"
                 if git["changed"] else ""))
    print("| clients | TP=1 tok/s | TP=2 tok/s | TP2/TP1 | TP=1 step ms | TP=2 step ms "
          "| TP=2 comm ms/step | comm share |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    notes = []
    for n in args.client_counts:
        one, two = figures[1].get(n, {}), figures[2].get(n, {})
        ratio = two["tok_s"] / one["tok_s"] if one and two and one["tok_s"] else None
        share = two.get("comm_share")
        print(f"| {n} | {fmt(one.get('tok_s'), '.1f')} | {fmt(two.get('tok_s'), '.1f')} "
              f"| {fmt(ratio, '.2f')} | {fmt(one.get('step_ms'), '.2f')} "
              f"| {fmt(two.get('step_ms'), '.2f')} | {fmt(two.get('comm_ms_per_step'), '.2f')} "
              f"| {'-' if share is None else f'{share * 100:.0f} %'} |")
        if one and two:
            notes += step_note(n, one, two)
        if args.passes > 1 and one and two:
            per_pass = [f"{b / a:.2f}" for a, b in zip(one["per_pass_tok_s"],
                                                       two["per_pass_tok_s"]) if a]
            notes.append(f"{n} clients, TP2/TP1 in each pass: {', '.join(per_pass)}")
    for note in notes:
        print(f"note: {note}")
    for tp, side in sides.items():
        for n, f in figures[tp].items():
            expected = f["requests"] * args.max_tokens
            if f["tokens"] != expected:
                print(f"note: TP={tp}, {n} clients: {f['tokens']} tokens, expected {expected}")
        if side.busy and max(side.busy) > BUSY_WARNING:
            print(f"note: TP={tp} started on a busy machine (other processes used up to "
                  f"{max(side.busy)} CPUs): the figures are low and noisy")
        if side.failure:
            print(f"failed: TP={tp}: {side.failure.splitlines()[0]}")
    if args.json:
        meta = {k: v for k, v in vars(args).items()}
        meta["cpus"] = os.cpu_count()
        meta["git"] = git
        meta["busy_cpus_before"] = {tp: s.busy for tp, s in sides.items()}
        meta["failures"] = {tp: s.failure for tp, s in sides.items() if s.failure}
        out = {"meta": meta, **{f"tp{tp}": [figures[tp][n] for n in sorted(figures[tp])]
                                for tp in sides}}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


def git_state() -> dict[str, object] | None:
    """The commit measured and the files it differs in (uncommitted changes count too)."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "freetoken_core"],
                               cwd=root, capture_output=True, text=True, timeout=10,
                               check=True).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    return {"head": head, "changed": [line[3:] for line in dirty]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="1,16")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1,
                        help="requests each client sends back to back")
    parser.add_argument("--passes", type=int, default=2,
                        help="passes per server, alternating in mirrored order (TP=1, TP=2, "
                             "TP=2, TP=1, ...), each a fresh start; the table pools them")
    parser.add_argument("--serve-args", default="--max-num-seqs 16",
                        help="`freetoken serve` options for both (default: --max-num-seqs 16)")
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds one client count may take")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--json", default=None, metavar="OUT", help="write the raw figures")
    args = parser.parse_args(argv)
    args.client_counts = [int(c) for c in args.clients.split(",")]
    if min(args.client_counts) < 1 or args.max_tokens < 1 or args.rounds < 1 \
            or args.passes < 1:
        parser.error("client counts, --max-tokens, --rounds and --passes must be positive")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks
    logs = Path(tempfile.mkdtemp(prefix="parallel-"))
    print(f"server logs: {logs}", file=sys.stderr)
    sides = {tp: Side(tp) for tp in SIZES}
    for p in range(args.passes):
        for tp in (SIZES if p % 2 == 0 else SIZES[::-1]):
            if sides[tp].failure is None:
                run_side(sides[tp], args, logs, p)
    report(args, sides)
    if any(side.failure for side in sides.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
