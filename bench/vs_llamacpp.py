"""FreeToken against llama.cpp's ``llama-server``: the same GGUF, the same streaming workload.

    python bench/vs_llamacpp.py [--model FILE] [--llama-server PATH] [--clients 1,8,16,32,64]
                                [--max-tokens 128] [--prompt-words 0] [--rounds 1] [--passes 1]
                                [--only freetoken|llamacpp]
                                [--serve-args '...'] [--llama-args '...'] [--json OUT]

Starts one server, measures it, stops it, then the other: never both at once. With
``--passes N`` they alternate N times (FreeToken, llama.cpp, FreeToken, ...), each pass a
fresh server start, and the table pools the passes (tokens over summed wall time, TTFT and
ITL over every request), with each pass's ratio in a note: a VM whose speed drifts by tens
of percent over minutes then hits both servers alike. FreeToken is
``freetoken serve --model GGUF`` (plus ``--serve-args``); llama.cpp is ``llama-server -m GGUF
-np N -c C -t T`` (plus ``--llama-args``, which win over these), N the largest client count,
C enough for every slot (at least 16384), T ``--threads`` (default: the CPU count). The
binary: ``--llama-server``, else ``$LLAMA_SERVER``, else where ``bash
bench/build_llama_server.sh`` puts it, else ``llama-server`` on the PATH; without one the
script says how to build it and exits 2. The GGUF defaults to FreeToken's embedded model.
On a CUDA machine FreeToken picks the GPU while the script's llama-server build is CPU-only:
compare like with like, ``--serve-args '--device cpu'``, or a CUDA llama-server
(``LLAMA_CMAKE_ARGS=-DGGML_CUDA=ON bash bench/build_llama_server.sh`` and
``--llama-args '-ngl 999'``). Run it on an otherwise idle machine: both servers use every CPU
and llama.cpp's threads spin-wait for each other, so another busy process slows llama.cpp
many times over (the script warns when it sees one).

The workload, identical for both: streaming ``/v1/completions``, every request its own prompt
(a topic and an index, first, so that neither server's prefix cache gets free hits),
(``--prompt-words N``: each prompt a passage of N words of its own longer, a long context)
``max_tokens`` tokens with ``ignore_eos`` and ``temperature`` 0.8 (each server's other sampling
defaults apply; ``--extra-body`` adds fields to every request). For each client count N:
N concurrent clients, each sending ``--rounds`` requests back to back. After a warm-up
(one request, then one 2-token request per client of the largest count), per client count:

* output tok/s: the generated tokens of all requests / the wall time of that client count
  (ratio: FreeToken's / llama.cpp's).
  A request's tokens are its ``usage.completion_tokens`` (both servers send usage on the
  last chunk), else its number of chunks that carried text;
* TTFT: request start to the first chunk with text; ITL: the gaps between successive chunks
  with text. Both servers hold back the text of a token that ends inside a UTF-8 character
  and send no chunk for it, so a chunk can carry several tokens (a gap then spans them);
  ``text_chunks`` next to ``tokens`` in ``--json`` and a note under the table say how often;
* FreeToken's engine decode step in the same runs: the growth of its /metrics
  ``freetoken_engine_decode_step_seconds`` sum over its count while that client count ran
  (a note under the table sets the ITL p50 against it: what serving adds to the step,
  without the minutes between two commands in which the machine drifts).

Every request, every client count and every server start is bounded in time; the servers are
stopped on the way out, Ctrl-C and SIGTERM included. A side that fails (a server that does
not start, a failed request, a client count over ``--timeout``) stops there, the other side
still runs, the table shows what was measured and the script exits 1. Server logs go to a
temporary directory named at the start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving import free_port, pct
from sse_client import HTTPStreamError, SSEConnection
from vs_servers import (
    BenchError,
    busy_cpus,
    find_llama_server,
    freetoken_command,
    llama_command,
    running,
    version_of,
)

SIDES = ("freetoken", "llamacpp")
LABELS = {"freetoken": "FreeToken", "llamacpp": "llama.cpp"}
TOPICS = ["The sea", "A robot", "The moon", "A library", "Winter", "A city at night",
          "An old tree", "The desert", "A lighthouse", "Volcanoes", "A train journey",
          "Honeybees", "A chess game", "The northern lights", "A bakery", "Glaciers"]
PASSAGE_WORDS = ("light", "water", "stone", "wind", "old", "bright", "under", "across", "river",
                 "glass", "quiet", "market", "evening", "north", "copper", "bridge", "song",
                 "paper", "salt", "garden", "machine", "cloud", "harbor", "slowly", "green",
                 "winter", "story", "iron", "window", "field", "silver", "morning")
PROMPT_TOKENS_PER_WORD = 3
"""Room per passage word in llama-server's slots (-c): the rarest word takes three tokens."""
BUSY_WARNING = 0.3
"""CPUs other processes may keep busy before a server starts without a warning."""


@dataclass
class Record:
    """One streamed request: when it started and when its text chunks arrived."""
    start: float
    first: float | None = None
    last: float | None = None
    gaps: list[float] = field(default_factory=list)
    num_chunks: int = 0
    usage_tokens: int | None = None
    timings_tokens: int | None = None  # llama.cpp's timings.predicted_n, a cross-check

    @property
    def num_tokens(self) -> int:
        return self.num_chunks if self.usage_tokens is None else self.usage_tokens


def prompt(index: int, words: int = 0) -> str:
    """Request ``index``'s prompt: the index first, so that two prompts share at most a token
    or two of prefix; with ``words``, a passage of that many words of its own after the
    topic (a long context: each word one to three tokens), which the answer continues."""
    topic = f"{index}. {TOPICS[index % len(TOPICS)]}"
    if not words:
        return f"{topic}: a long, vivid description.\n\n"
    rng = random.Random(index)
    passage = " ".join(rng.choice(PASSAGE_WORDS) for _ in range(words))
    return f"{topic}. Notes: {passage}\n\nA long, vivid description:\n\n"


def request_body(model: str, index: int, max_tokens: int, extra: dict | None = None,
                 words: int = 0) -> dict:
    return {"model": model, "prompt": prompt(index, words), "max_tokens": max_tokens,
            "temperature": 0.8, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **(extra or {})}


def parse_event(line: str) -> dict | None:
    """The JSON of one SSE ``data:`` line; ``None`` for other lines and ``[DONE]``."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return None
    return json.loads(data)


def add_chunk(record: Record, chunk: dict, now: float) -> None:
    """Account one streamed ``/v1/completions`` chunk received at ``now``."""
    if "error" in chunk:
        raise BenchError(f"the server streamed an error: {chunk['error']}")
    if chunk.get("usage"):
        record.usage_tokens = chunk["usage"]["completion_tokens"]
    if chunk.get("timings"):
        record.timings_tokens = chunk["timings"].get("predicted_n")
    if not any(c.get("text") for c in chunk.get("choices") or []):
        return
    record.num_chunks += 1
    if record.last is None:
        record.first = now
    else:
        record.gaps.append(now - record.last)
    record.last = now


async def one_request(conn: SSEConnection, body: dict) -> Record:
    record = Record(time.perf_counter())

    def on_line(line: bytes, now: float) -> None:
        chunk = parse_event(line.decode())
        if chunk is not None:
            add_chunk(record, chunk, now)

    response = await conn.post_stream("/v1/completions", body, on_line)
    if response.status != 200:
        raise BenchError(f"HTTP {response.status}: {response.text[:300]}")
    return record


async def run_clients(url: str, model: str, num_clients: int, rounds: int, first_index: int,
                      max_tokens: int, extra: dict, request_timeout: float, words: int = 0
                      ) -> tuple[list[Record], float]:
    """``num_clients`` concurrent clients, each sending ``rounds`` requests back to back
    over its own keep-alive connection (bench/sse_client.py: a lighter client than httpx,
    which took ~10 % of a core from the servers at 16 clients); request
    ``first_index + round * num_clients + client`` gets that prompt index."""
    address = urlsplit(url)
    conns = [SSEConnection(address.hostname, address.port, request_timeout)
             for _ in range(num_clients)]

    async def one_client(c: int) -> list[Record]:
        return [await one_request(conns[c], request_body(
            model, first_index + r * num_clients + c, max_tokens, extra, words))
            for r in range(rounds)]

    try:
        start = time.perf_counter()
        per_client = await asyncio.gather(*(one_client(c) for c in range(num_clients)))
        return [r for records in per_client for r in records], time.perf_counter() - start
    finally:
        for conn in conns:
            await conn.close()


def summarise(num_clients: int, records: list[Record], elapsed: float) -> dict:
    """The figures of one client count (times in ms; ``None`` where there is no sample)."""
    ttfts = [r.first - r.start for r in records if r.first is not None]
    gaps = [g for r in records for g in r.gaps]
    num_tokens = sum(r.num_tokens for r in records)

    def ms(values: list[float], q: float) -> float | None:
        value = pct(values, q)
        return None if math.isnan(value) else round(value, 3)

    return {"clients": num_clients, "requests": len(records), "tokens": num_tokens,
            "text_chunks": sum(r.num_chunks for r in records),
            "usage_reported": sum(r.usage_tokens is not None for r in records),
            "timings_disagree": sum(r.timings_tokens not in (None, r.usage_tokens)
                                    for r in records),
            "elapsed_s": round(elapsed, 3), "tok_s": round(num_tokens / elapsed, 2),
            "ttft_p50_ms": ms(ttfts, 50), "ttft_p99_ms": ms(ttfts, 99),
            "itl_p50_ms": ms(gaps, 50), "itl_p99_ms": ms(gaps, 99)}


def format_table(results: dict[str, list[dict]]) -> str:
    """The side-by-side table; ``-`` where a side did not run."""
    by_clients: dict[int, dict[str, dict]] = {}
    for side, figures in results.items():
        for f in figures:
            by_clients.setdefault(f["clients"], {})[side] = f

    def fmt(value: float | None, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    header = ("| clients | FreeToken tok/s | llama.cpp tok/s | ratio | FreeToken ITL p50 "
              "| llama.cpp ITL p50 | TTFT p50 FT / llama.cpp |")
    lines = [header, "|---:|---:|---:|---:|---:|---:|---:|"]
    for clients in sorted(by_clients):
        ft, lc = by_clients[clients].get("freetoken", {}), by_clients[clients].get("llamacpp", {})
        ratio = (ft["tok_s"] / lc["tok_s"]) if ft and lc and lc["tok_s"] else None
        itl = [fmt(side.get("itl_p50_ms"), 1) + ("" if side.get("itl_p50_ms") is None else " ms")
               for side in (ft, lc)]
        ttft = f"{fmt(ft.get('ttft_p50_ms'), 0)} / {fmt(lc.get('ttft_p50_ms'), 0)} ms"
        lines.append(f"| {clients} | {fmt(ft.get('tok_s'), 1)} | {fmt(lc.get('tok_s'), 1)} "
                     f"| {fmt(ratio, 2)} | {itl[0]} | {itl[1]} | {ttft} |")
    return "\n".join(lines)


def accounting_notes(results: dict[str, list[dict]], max_tokens: int) -> list[str]:
    """Lines for whatever makes a token count less than exact."""
    notes = []
    for side, figures in results.items():
        for f in figures:
            where = f"{LABELS[side]}, {f['clients']} clients"
            if f["usage_reported"] < f["requests"]:
                notes.append(f"{where}: {f['requests'] - f['usage_reported']} requests without "
                             "usage; their tokens are counted as chunks with text")
            if f["timings_disagree"]:
                notes.append(f"{where}: {f['timings_disagree']} requests whose "
                             "timings.predicted_n differs from usage.completion_tokens")
            if f["tokens"] != f["requests"] * max_tokens:
                notes.append(f"{where}: {f['tokens']} tokens, expected "
                             f"{f['requests'] * max_tokens} (ignore_eos)")
            if f["text_chunks"] != f["tokens"]:
                notes.append(f"{where}: {f['text_chunks']} chunks with text for {f['tokens']} "
                             "tokens (held-back UTF-8: one chunk, several tokens)")
    return notes


DECODE_STEP_METRIC = "freetoken_engine_decode_step_seconds"


def decode_steps(url: str) -> tuple[float, int] | None:
    """FreeToken's decode steps so far, from ``GET /metrics``: (seconds, count); ``None``
    where the server does not give them (an API key in ``--serve-args``, an older server)."""
    response = httpx.get(f"{url}/metrics", timeout=10)
    values = dict(line.split(" ", 1) for line in response.text.splitlines()
                  if line.startswith(DECODE_STEP_METRIC + "_"))
    try:
        return (float(values[DECODE_STEP_METRIC + "_sum"]),
                int(float(values[DECODE_STEP_METRIC + "_count"])))
    except (KeyError, ValueError):
        return None


def step_notes(run: SideRun | None, figures: list[dict]) -> list[str]:
    """FreeToken's served ITL p50 against its engine's mean decode step in the same runs."""
    if run is None:
        return []
    lines = []
    for f in figures:
        seconds, count = run.decode_steps.get(f["clients"], (0.0, 0))
        if count and f["itl_p50_ms"] is not None:
            step = seconds / count * 1000
            lines.append(f"FreeToken, {f['clients']} clients: ITL p50 {f['itl_p50_ms']:.2f} ms, "
                         f"engine decode step {step:.2f} ms in the same runs (mean of "
                         f"{int(count)}): {(f['itl_p50_ms'] / step - 1) * 100:+.1f} %")
    return lines


def measure_side(name: str, url: str, args: argparse.Namespace,
                 samples: dict[int, tuple[list[Record], float]],
                 steps: dict[int, list[float]] | None = None) -> None:
    """Warm-up, then every client count, each one's records and wall time into
    ``samples[count]`` as it ends; the prompt indices are the same for both sides. For
    FreeToken, ``steps[count]`` adds up the seconds and the number of the engine's decode
    steps while that count ran (its own /metrics): the step the inter-token latency stood
    on, measured in the same minutes."""
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]

    def run(num_clients: int, rounds: int, first: int, max_tokens: int
            ) -> tuple[list[Record], float]:
        try:
            return asyncio.run(asyncio.wait_for(run_clients(
                url, model, num_clients, rounds, first, max_tokens, args.extra_body,
                args.request_timeout, args.prompt_words), args.timeout))
        except (TimeoutError, asyncio.TimeoutError) as exc:
            raise BenchError(f"{num_clients} clients took over {args.timeout:.0f} s") from exc
        except (httpx.HTTPError, HTTPStreamError, OSError) as exc:
            raise BenchError(f"{num_clients} clients: {type(exc).__name__}: {exc}") from exc

    warm_up = -10_000  # prompt indices no measured request uses
    run(1, 1, warm_up, 16)
    run(max(args.client_counts), 1, warm_up + 1, 2)
    first = 0
    for num_clients in args.client_counts:
        before = decode_steps(url) if steps is not None else None
        records, elapsed = run(num_clients, args.rounds, first, args.max_tokens)
        first += num_clients * args.rounds
        samples[num_clients] = (records, elapsed)
        f = summarise(num_clients, records, elapsed)
        step = ""
        after = decode_steps(url) if before is not None else None
        if steps is not None and before is not None and after is not None:
            total = steps.setdefault(num_clients, [0.0, 0])
            total[0] += after[0] - before[0]
            total[1] += after[1] - before[1]
            if after[1] > before[1]:
                step = (f", engine decode step "
                        f"{(after[0] - before[0]) / (after[1] - before[1]) * 1000:.2f} ms")
        print(f"{LABELS[name]:>9}, {num_clients:>3} clients: {f['tok_s']:8.1f} tok/s, "
              f"ITL p50 {f['itl_p50_ms']} ms, TTFT p50 {f['ttft_p50_ms']} ms{step}",
              file=sys.stderr)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", "--gguf", dest="gguf", default=None, metavar="FILE",
                        help="the GGUF file both servers serve (default: FreeToken's "
                             "embedded model)")
    parser.add_argument("--llama-server", default=None, metavar="PATH")
    parser.add_argument("--clients", default="1,8,16,32,64")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-words", type=int, default=0, metavar="N",
                        help="a passage of N words of its own in every prompt (a long "
                             "context: ~1 token a word for the default model; default 0, "
                             "the short prompts)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="requests each client sends back to back")
    parser.add_argument("--passes", type=int, default=1,
                        help="passes per server, the servers alternating (FreeToken, "
                             "llama.cpp, FreeToken, ...), each pass a fresh start of the "
                             "server and every client count; the table pools the passes, so "
                             "a machine whose speed drifts over minutes hits both alike")
    parser.add_argument("--only", choices=SIDES, default=None)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="llama-server -t (default: the CPU count)")
    parser.add_argument("--serve-args", default="", help="more `freetoken serve` options")
    parser.add_argument("--llama-args", default="",
                        help="more llama-server options; they win over -np/-c/-t")
    parser.add_argument("--extra-body", default="{}", type=json.loads, metavar="JSON",
                        help="fields added to every request, for both servers")
    parser.add_argument("--request-timeout", type=float, default=300.0,
                        help="seconds a request may wait for its next chunk")
    parser.add_argument("--timeout", type=float, default=1200.0,
                        help="seconds one client count may take")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--json", default=None, metavar="OUT", help="write the raw figures")
    args = parser.parse_args(argv)
    args.client_counts = [int(c) for c in args.clients.split(",")]
    if min(args.client_counts) < 1 or args.max_tokens < 1 or args.rounds < 1 or args.passes < 1:
        parser.error("client counts, --max-tokens, --rounds and --passes must be positive")
    if args.prompt_words < 0:
        parser.error("--prompt-words must be 0 or more")
    return args


Samples = dict[int, tuple[list[Record], float]]
"""Per client count: the records of its requests and its wall time."""


def figures_of(samples: Samples) -> list[dict]:
    return [summarise(n, records, elapsed) for n, (records, elapsed) in sorted(samples.items())]


@dataclass
class SideRun:
    """What one server's passes left: each pass's samples, why it stopped early (if it
    did), and how many CPUs other processes kept busy when it last started."""
    passes: list[Samples] = field(default_factory=list)
    failure: str | None = None
    busy_cpus: float | None = None
    decode_steps: dict[int, list[float]] = field(default_factory=dict)
    """FreeToken only: per client count, [seconds, count] of its engine's decode steps
    while that count ran, over every pass."""

    @property
    def figures(self) -> list[dict]:
        """Per client count: tokens of every pass over their summed wall time, and TTFT and
        ITL percentiles over every pass's requests."""
        pooled: Samples = {}
        for samples in self.passes:
            for n, (records, elapsed) in samples.items():
                before, total = pooled.get(n, ([], 0.0))
                pooled[n] = (before + records, total + elapsed)
        return figures_of(pooled)


def run_side(side: str, args: argparse.Namespace, binary: str | None, logs: Path,
             run: SideRun) -> None:
    """Start one server, measure it (one pass: every client count), stop it."""
    port = free_port()
    if side == "freetoken":
        cmd = freetoken_command(args.gguf, port, shlex.split(args.serve_args))
    else:
        cmd = llama_command(binary, args.gguf, port, max(args.client_counts),
                            args.max_tokens + PROMPT_TOKENS_PER_WORD * args.prompt_words,
                            args.threads, shlex.split(args.llama_args))
    run.busy_cpus = busy_cpus()
    if run.busy_cpus is not None and run.busy_cpus > BUSY_WARNING:
        print(f"warning: other processes keep {run.busy_cpus} CPUs busy before "
              f"{LABELS[side]} starts: its figures will be low and noisy", file=sys.stderr)
    print(f"{LABELS[side]}: {shlex.join(cmd)}", file=sys.stderr)
    log = logs / f"{side}-{len(run.passes) + 1}.log"
    run.passes.append({})  # filled as each client count ends: a failure keeps what ran
    try:
        with running(LABELS[side], cmd, port, log, args.start_timeout) as url:
            measure_side(side, url, args, run.passes[-1],
                         run.decode_steps if side == "freetoken" else None)
    except (BenchError, httpx.HTTPError) as exc:
        run.failure = str(exc)
        print(f"{LABELS[side]} failed: {exc}", file=sys.stderr)


def report(args: argparse.Namespace, binary: str | None, runs: dict[str, SideRun]) -> None:
    """The table and its notes on stdout; the raw figures to ``--json``."""
    results = {side: run.figures for side, run in runs.items()}
    context = f", prompts of {args.prompt_words} more words" if args.prompt_words else ""
    print(f"{Path(args.gguf).name}, {args.max_tokens} tokens per request{context} (ignore_eos, "
          f"temperature 0.8), streaming /v1/completions, {args.rounds} round(s) per client, "
          f"{args.passes} pass(es) per server, alternating")
    print(format_table(results))
    if args.passes > 1 and len(runs) == 2:
        # Each pass's ratio, the first server's pass k against the other's pass k: how much
        # the machine drifted between passes.
        for n in args.client_counts:
            ratios = []
            for ft, lc in zip(runs["freetoken"].passes, runs["llamacpp"].passes):
                if n in ft and n in lc:
                    a, b = summarise(n, *ft[n]), summarise(n, *lc[n])
                    if b["tok_s"]:
                        ratios.append(f"{a['tok_s'] / b['tok_s']:.2f}")
            print(f"note: {n} clients, ratio in each pass: {', '.join(ratios) or '-'}")
    for line in step_notes(runs.get("freetoken"), results.get("freetoken", [])):
        print(f"note: {line}")
    for note in accounting_notes(results, args.max_tokens):
        print(f"note: {note}")
    for side, run in runs.items():
        if run.busy_cpus is not None and run.busy_cpus > BUSY_WARNING:
            print(f"note: {LABELS[side]} ran on a busy machine (other processes used "
                  f"{run.busy_cpus} CPUs when it started)")
        if run.failure is not None:
            print(f"failed: {LABELS[side]}: {run.failure.splitlines()[0]}")
    if args.json:
        meta = {"gguf": args.gguf, "max_tokens": args.max_tokens, "rounds": args.rounds,
                "prompt_words": args.prompt_words,
                "threads": args.threads, "serve_args": args.serve_args,
                "llama_args": args.llama_args, "extra_body": args.extra_body,
                "llama_server": binary,
                "llama_server_version": version_of(binary) if binary else None,
                "passes": args.passes,
                "per_pass": {side: [figures_of(p) for p in run.passes]
                             for side, run in runs.items()},
                "busy_cpus_before": {side: run.busy_cpus for side, run in runs.items()},
                "freetoken_decode_steps": {
                    n: {"seconds": v[0], "count": v[1]}
                    for n, v in runs["freetoken"].decode_steps.items()}
                if "freetoken" in runs else None,
                "failures": {side: run.failure for side, run in runs.items() if run.failure}}
        Path(args.json).write_text(json.dumps({"meta": meta, **results}, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sides = [args.only] if args.only else list(SIDES)
    binary = find_llama_server(args.llama_server) if "llamacpp" in sides else None
    if args.gguf is None:
        from freetoken_core.models.resolve import default_gguf_path
        args.gguf = str(default_gguf_path())
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks
    logs = Path(tempfile.mkdtemp(prefix="vs_llamacpp-"))
    print(f"server logs: {logs}", file=sys.stderr)
    runs = {side: SideRun() for side in sides}
    for _ in range(args.passes):  # one server at a time, alternating
        for side in sides:
            if runs[side].failure is None:
                run_side(side, args, binary, logs, runs[side])
    report(args, binary, runs)
    if any(run.failure is not None for run in runs.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
