"""Serving benchmark: N concurrent streaming clients against a real ``freetoken serve``.

    python bench/serving.py [--model PATH] [--clients 1,8,32] [--max-tokens 64]

Starts the server on a free loopback port (the embedded default model unless ``--model``),
then for each client count runs that many concurrent streaming chat requests (each a
different prompt, ``max_tokens`` greedy tokens with ``ignore_eos`` so every request has the
same length) and prints output tokens/s, time to first token and inter-token latency
(p50 / p99). Every request and the whole run are bounded in time; the server is stopped at
the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

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


def start_server(model: str | None, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "freetoken_core.cli", "serve", "--port", str(port)]
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


async def one_request(client: httpx.AsyncClient, model: str, index: int, max_tokens: int,
                      run: Run) -> None:
    body = {"model": model, "stream": True, "temperature": 0, "max_tokens": max_tokens,
            "ignore_eos": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user",
                          "content": f"Request {index}: write about {TOPICS[index % 8]}."}]}
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


async def measure(port: int, model: str, clients: int, max_tokens: int) -> tuple[Run, float]:
    run = Run()
    timeout = httpx.Timeout(600.0)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=timeout) as c:
        start = time.perf_counter()
        await asyncio.gather(*(one_request(c, model, i, max_tokens, run)
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
    args = parser.parse_args()
    port = free_port()
    server = start_server(args.model, port)
    try:
        model = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
        asyncio.run(measure(port, model, 1, 4))  # warm-up
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


if __name__ == "__main__":
    main()
