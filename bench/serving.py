"""Serving benchmark: N concurrent streaming clients against a real ``freetoken serve``.

    python bench/serving.py [--model PATH] [--clients 1,8,32] [--max-tokens 64] [--json-schema]
                            [--serve-args '--structured-outputs-backend xgrammar']

Starts the server on a free loopback port (the embedded default model unless ``--model``),
then for each client count runs that many concurrent streaming chat requests (each a
different prompt, ``max_tokens`` greedy tokens with ``ignore_eos`` so every request has the
same length) and prints output tokens/s, time to first token and inter-token latency
(p50 / p99). Every request and the whole run are bounded in time; the server is stopped at
the end.

``--json-schema``: the cost of structured outputs. Each client count runs twice, round
robin: request ``i`` asks for the document of ``bench/json_schemas.py``'s case ``i % 30``
(its own prompt) without a constraint, then with ``response_format`` json_schema (the
``structured_outputs`` plugin, the server's default grammar backend); the same greedy
``max_tokens`` with ``ignore_eos`` in both (a constrained document that completes early
runs on with EOS only, which the grammar still masks), and the ratio of tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from json_schemas import SCHEMAS

TOPICS = ["the sea", "a robot", "the moon", "a library", "winter", "a city at night",
          "an old tree", "the desert"]


@dataclass
class Run:
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    tokens: int = 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, port: int, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "freetoken_core.cli", "serve", "--port", str(port), *extra]
    if model:
        cmd += ["--model", model]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {proc.stderr.read() if proc.stderr else ''}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not become healthy within 300 s")


def request_body(model: str, index: int, max_tokens: int, mode: str) -> dict:
    """``mode``: ``topics`` (the default workload), ``plain`` or ``schema`` (a json_schemas
    case's prompt, without or with its schema)."""
    body = {"model": model, "stream": True, "temperature": 0, "max_tokens": max_tokens,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if mode == "topics":
        content = f"Request {index}: write about {TOPICS[index % 8]}."
    else:
        case = SCHEMAS[index % len(SCHEMAS)]
        content = case.prompt
        if mode == "schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": case.name, "schema": case.schema, "strict": True}}
    body["messages"] = [{"role": "user", "content": content}]
    return body


async def one_request(client: httpx.AsyncClient, model: str, index: int, max_tokens: int,
                      run: Run, mode: str = "topics") -> None:
    body = request_body(model, index, max_tokens, mode)
    start = last = time.perf_counter()
    first = True
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                run.tokens += chunk["usage"]["completion_tokens"]
            if not any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                continue
            now = time.perf_counter()
            if first:
                run.ttft.append(now - start)
                first = False
            else:
                run.itl.append(now - last)
            last = now


async def measure(port: int, model: str, clients: int, max_tokens: int,
                  mode: str = "topics") -> tuple[Run, float]:
    run = Run()
    timeout = httpx.Timeout(600.0)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=timeout) as c:
        start = time.perf_counter()
        await asyncio.gather(*(one_request(c, model, i, max_tokens, run, mode)
                               for i in range(clients)))
        return run, time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    if len(values) < 2:
        return values[0] * 1e3 if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--clients", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json-schema", action="store_true",
                        help="each client count without and with a JSON schema per request")
    parser.add_argument("--rounds", type=int, default=2,
                        help="with --json-schema: plain/schema rounds per client count")
    parser.add_argument("--serve-args", default="",
                        help="more `freetoken serve` options, e.g. "
                             "'--structured-outputs-backend xgrammar'")
    args = parser.parse_args()
    port = free_port()
    server = start_server(args.model, port, shlex.split(args.serve_args))
    try:
        model = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
        asyncio.run(measure(port, model, 1, 4))  # warm-up
        if args.json_schema:
            compare_schema(port, model, args)
            return
        print(f"model {model}, {args.max_tokens} greedy tokens per request, streaming")
        print(f"{'clients':>7} {'tok/s':>9} {'TTFT p50':>10} {'TTFT p99':>10} "
              f"{'ITL p50':>9} {'ITL p99':>9}  (ms)")
        for clients in (int(c) for c in args.clients.split(",")):
            run, elapsed = asyncio.run(measure(port, model, clients, args.max_tokens))
            print(f"{clients:>7} {run.tokens / elapsed:>9.1f} {pct(run.ttft, 50):>10.0f} "
                  f"{pct(run.ttft, 99):>10.0f} {pct(run.itl, 50):>9.1f} "
                  f"{pct(run.itl, 99):>9.1f}")
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(server.pid, signal.SIGKILL)


def compare_schema(port: int, model: str, args: argparse.Namespace) -> None:
    # Every schema compiles once first (the cache then serves), so the rounds time decoding.
    asyncio.run(measure(port, model, len(SCHEMAS), 2, "schema"))
    print(f"model {model}, {args.max_tokens} greedy tokens per request (ignore_eos), "
          f"streaming; json_schemas.py cases, plain vs response_format json_schema; "
          f"{args.rounds} rounds, best of each")
    print(f"{'clients':>7} {'plain tok/s':>12} {'schema tok/s':>13} {'ratio':>6} "
          f"{'ITL p50 plain/schema':>21} {'ITL p99 plain/schema':>21}  (ms)")
    for clients in (int(c) for c in args.clients.split(",")):
        best: dict[str, tuple[float, Run]] = {}
        for _ in range(args.rounds):
            for mode in ("plain", "schema"):
                run, elapsed = asyncio.run(measure(port, model, clients, args.max_tokens, mode))
                expected = clients * args.max_tokens
                if run.tokens != expected:
                    raise SystemExit(f"{mode}: {run.tokens} tokens, expected {expected}")
                rate = run.tokens / elapsed
                if mode not in best or rate > best[mode][0]:
                    best[mode] = (rate, run)
        (plain, p_run), (schema, s_run) = best["plain"], best["schema"]
        print(f"{clients:>7} {plain:>12.1f} {schema:>13.1f} {schema / plain:>6.2f} "
              f"{pct(p_run.itl, 50):>10.1f}/{pct(s_run.itl, 50):<10.1f} "
              f"{pct(p_run.itl, 99):>10.1f}/{pct(s_run.itl, 99):<10.1f}")


if __name__ == "__main__":
    main()
