"""Soak benchmark (issue 8: nothing a client or a plugin does takes the server down).

    .venv/bin/python bench/soak.py [--model PATH] [--requests 2000] [--concurrency 64]
        [--max-tokens-range 4-24] [--seed 0] [--url URL] [--tiny]

Not a test: it runs minutes and prints figures. It starts its own ``freetoken serve`` (the
embedded default model unless ``--model``; ``--tiny`` builds the tiny test model for a quick
smoke run; ``--url`` uses a server that is already running) and then:

1. **Load.** ``--concurrency`` workers run ``--requests`` seeded-random requests: completions
   or chat, streaming or not, ``n`` 1–4, greedy or seeded sampling, ``max_tokens`` from the
   range with ``ignore_eos`` (so a well-behaved request must come back with exactly
   ``n × max_tokens`` completion tokens, every choice finished by ``length``). 25 % of the
   clients go away at a random moment over a raw socket: during prefill (a long prompt,
   0–200 ms), after a random number of SSE events, or after 10 ms–4 s. 5 % send a
   malformed body, which must get a 4xx with the OpenAI error shape. The first 10 % of the
   requests are the warm-up.
2. **Leaks.** After the warm-up and after the load the server must go idle: ``/internal/stats``
   with nothing running, waiting or live and no KV block (or any other ``num_used_*``) in
   use. Resident memory of the server and its children, after the warm-up against the end.
3. **ITL** (between the warm-up and the rest of the load). 8 well-behaved streams of 64
   tokens alone, then while senders keep 3 prompts of 100,000 characters in flight (too long
   for the model: they end in a 400 after tokenization, which must not stall the other
   streams); alternated over 2 rounds; p99 with / p99 without.

Targets (exit status 1 when one is missed): no 5xx (nor an engine restart), every
well-behaved request complete, every malformed one a 4xx with the error shape, the server
idle with 0 blocks in use, RSS growth < 5 %, ITL p99 ratio < 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psutil

WORDS = ("the", "sea", "moon", "robot", "library", "winter", "city", "night", "old", "tree",
         "desert", "river", "mountain", "garden", "light", "stone", "bridge", "window", "music",
         "letter", "train", "forest", "cloud", "summer", "story", "friend", "morning", "quiet",
         "bright", "small", "house", "road", "fire", "clock", "paper", "island")
ASSUMED_TOK_S = 250.0
"""Generated tokens per second of the default model at 64 streams on 2 cores (the estimate
printed before the run; the measured rate after the warm-up replaces it)."""
ITL_STREAMS, ITL_TOKENS, ITL_ROUNDS, FLOOD_CHARS = 8, 64, 2, 100_000
BODY_LIMIT = 16 * 1024 * 1024  # the default --max-body-bytes
PROMPT_CHARS_LIMIT = 1_048_576  # the default --max-prompt-chars
REQUEST_TIMEOUT_S = 600.0


@dataclass
class Spec:
    """One request of the load: ``kind`` is ok, disconnect or malformed."""

    index: int
    kind: str
    path: str
    body: bytes
    stream: bool = False
    expected_tokens: int = 0
    n: int = 1
    how: str = ""  # disconnect: prefill / events / timed; malformed: the case's name
    delay_s: float = 0.0
    after_events: int = 0
    is_reset: bool = False  # disconnect: a reset (as a killed client sends), not a close


@dataclass
class Tally:
    statuses: dict[str, Counter] = field(default_factory=lambda: {
        k: Counter() for k in ("ok", "disconnect", "malformed", "itl", "flood")})
    server_errors: list[str] = field(default_factory=list)
    num_complete: int = 0
    incomplete: list[str] = field(default_factory=list)
    disconnects: Counter = field(default_factory=Counter)
    bad_malformed: list[str] = field(default_factory=list)
    num_tokens: int = 0

    def status(self, kind: str, status: int | str, what: str, text: str = "") -> None:
        self.statuses[kind][status] += 1
        if isinstance(status, int) and status >= 500:
            self.server_errors.append(f"{kind} {what}: {status} {text[:300]}")


# -- the server ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, port: int, log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "freetoken_core.cli", "serve", "--port", str(port),
           "--log-level", "warning"]
    if model:
        cmd += ["--model", model]
    with open(log_path, "w") as log:
        # A session of its own, so that stopping the group stops the engine process too.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise SystemExit(f"the server did not become healthy; its log:\n{log_path.read_text()}")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM to the server (which stops its engine), then SIGKILL to its process group
    (whatever is left of it)."""
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def listener_pid(port: int) -> int | None:
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
                return conn.pid
    except psutil.Error:
        pass
    return None


def rss_mib(pid: int | None) -> dict[str, float]:
    """Resident memory in MiB of the server ``pid`` (``server``) and of each of its
    descendants (``engine``: the spawned child running the model), by role; empty when
    ``pid`` is unknown."""
    if pid is None:
        return {}
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return {}
    rss: dict[str, float] = {}
    for proc in procs:
        try:
            cmdline = " ".join(proc.cmdline())
            role = ("server" if proc.pid == pid else "engine" if "spawn_main" in cmdline
                    else "tracker" if "resource_tracker" in cmdline else str(proc.pid))
            rss[role] = rss.get(role, 0.0) + proc.memory_info().rss / 2**20
        except psutil.Error:
            pass
    return rss


def fmt_rss(rss: dict[str, float]) -> str:
    if not rss:
        return "n/a"
    parts = " + ".join(f"{role} {mib:.0f}" for role, mib in rss.items())
    return f"{sum(rss.values()):.0f} MiB ({parts})"


async def wait_idle(client: httpx.AsyncClient, timeout_s: float = 10.0) -> dict[str, int]:
    """The engine's stats once nothing is running, waiting or live (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = (await client.get("/internal/stats")).json()
        idle = not (stats["num_running"] or stats["num_waiting"] or stats["num_requests"])
        if idle or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.25)


def leaks(stats: dict[str, int]) -> dict[str, int]:
    """What is still held: live sequences and requests and every ``num_used_*`` count."""
    return {k: v for k, v in stats.items()
            if v and (k.startswith("num_used_") or k in ("num_running", "num_waiting",
                                                           "num_requests"))}


async def engine_restarts(client: httpx.AsyncClient) -> int:
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith("freetoken_engine_restarts_total "):
            return int(float(line.split()[1]))
    return 0


# -- the requests ---------------------------------------------------------------------------


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def text_of_chars(rng: random.Random, num_chars: int) -> str:
    text = words(rng, num_chars // 5 + 10)
    while len(text) < num_chars:
        text += " " + words(rng, 1000)
    return text[:num_chars]


def generation_body(rng: random.Random, model: str, chat: bool, prompt: str, stream: bool,
                    n: int, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "n": n, "max_tokens": max_tokens,
                            "ignore_eos": True, "stream": stream}
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body.update(temperature=0.8, seed=rng.randrange(2**31))
    if stream:
        body["stream_options"] = {"include_usage": True}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        if rng.random() < 0.3:
            body["messages"].insert(0, {"role": "system", "content": "You are brief."})
    else:
        body["prompt"] = prompt
    return body


def deep(levels: int) -> str:
    return "[" * levels + "1" + "]" * levels


def malformed_cases(model: str) -> list[tuple[str, str, bytes]]:
    """(name, path, body): each must be answered with a 4xx and the OpenAI error shape."""
    c, ch = "/v1/completions", "/v1/chat/completions"
    m = json.dumps(model)

    def js(path: str, **fields: Any) -> tuple[str, bytes]:
        base: dict[str, Any] = {"model": model, "max_tokens": 4}
        if path == c:
            base["prompt"] = "hello"
        else:
            base["messages"] = [{"role": "user", "content": "hello"}]
        return path, json.dumps({**base, **fields}).encode()

    cases: list[tuple[str, str, bytes]] = [
        ("invalid json", c, b'{"model": ' + m.encode() + b', "prompt": "hi", '),
        ("invalid utf-8", c, b'{"model": ' + m.encode() + b', "prompt": "\xff\xfe"}'),
        ("not an object", ch, b"[1, 2, 3]"),
        ("null body", c, b"null"),
        ("empty body", c, b""),
        ("NaN literal", c, b'{"model": ' + m.encode() + b', "prompt": "hi", "top_p": NaN}'),
        ("deep nesting prompt", c, b'{"model": ' + m.encode() + b', "prompt": '
         + deep(2000).encode() + b"}"),
        ("deep nesting content", ch, b'{"model": ' + m.encode() + b', "messages": [{"role": '
         b'"user", "content": ' + deep(2000).encode() + b"}]}"),
        ("deep nesting template kwargs", ch, b'{"model": ' + m.encode() + b', "messages": '
         b'[{"role": "user", "content": "hi"}], "chat_template_kwargs": {"a": '
         + deep(2000).encode() + b"}}"),
        ("body over the limit", c, b'{"model": ' + m.encode() + b', "prompt": "'
         + b"a" * (BODY_LIMIT + 1024) + b'"}'),
        ("prompt over max chars", *js(c, prompt="a " * (PROMPT_CHARS_LIMIT // 2 + 8))),
        ("missing prompt", c, json.dumps({"model": model, "max_tokens": 4}).encode()),
        ("prompt wrong type", *js(c, prompt=123)),
        ("max_tokens wrong type", *js(c, max_tokens="ten")),
        ("stream wrong type", *js(ch, stream="yes")),
        ("unknown field", *js(c, frobnicate=1)),
        ("unknown stream_options field", *js(ch, stream=True,
                                              stream_options={"include_usage": True, "x": 1})),
        ("unknown message key", *js(ch, messages=[{"role": "user", "content": "hi",
                                                   "tool_call_id": "x"}])),
        ("top_k 2**63", *js(c, top_k=2**63)),
        ("seed 2**64", *js(ch, seed=2**64)),
        ("max_tokens 2**70", *js(c, max_tokens=2**70)),
        ("max_tokens -5", *js(ch, max_tokens=-5)),
        ("temperature 1e999", c, b'{"model": ' + m.encode() + b', "prompt": "hi", '
         b'"temperature": 1e999}'),
        ("n=0", *js(c, n=0)),
        ("n=10**6", *js(ch, n=10**6)),
        ("temperature -1", *js(ch, temperature=-1)),
        ("top_p 0", *js(c, top_p=0)),
        ("empty messages", *js(ch, messages=[])),
        ("messages not a list", *js(ch, messages="hello")),
        ("prompt ids out of vocab", *js(c, prompt=[10**9])),
        ("prompt ids negative", *js(c, prompt=[-1, 5])),
        ("prompt ids 2**64", *js(c, prompt=[2**64])),
        ("too many stop strings", *js(c, stop=["x"] * 100)),
        ("top_logprobs 2**40", *js(ch, logprobs=True, top_logprobs=2**40)),
        ("logit_bias huge key", *js(c, logit_bias={str(2**70): 1})),
        ("min_p 2", *js(c, min_p=2)),
    ]
    return cases


def make_specs(rng: random.Random, count: int, model: str, tokens_range: tuple[int, int],
               long_prompt: str) -> list[Spec]:
    cases = malformed_cases(model)
    rng.shuffle(cases)
    specs = []
    for i in range(count):
        roll = rng.random()
        chat = rng.random() < 0.5
        path = "/v1/chat/completions" if chat else "/v1/completions"
        stream = rng.random() < 0.5
        n = rng.randint(1, 4)
        max_tokens = rng.randint(*tokens_range)
        if roll < 0.05:
            name, mpath, body = cases[sum(s.kind == "malformed" for s in specs) % len(cases)]
            specs.append(Spec(i, "malformed", mpath, body, how=name))
            continue
        prompt = f"Request {i}: write about {words(rng, rng.randint(2, 12))}."
        if roll < 0.30:
            how = rng.choice(["prefill", "events", "timed"] if stream else ["prefill", "timed"])
            if how == "prefill":
                prompt = long_prompt[rng.randrange(50):] + " " + prompt
            body = generation_body(rng, model, chat, prompt, stream, n, max_tokens)
            specs.append(Spec(i, "disconnect", path, json.dumps(body).encode(), stream,
                              n * max_tokens, n, how,
                              # timed: log-uniform 10 ms–4 s, mid-answer on any model
                              delay_s=rng.uniform(0, 0.2) if how == "prefill"
                              else math.exp(rng.uniform(math.log(0.01), math.log(4.0))),
                              after_events=rng.randint(1, max(1, n * max_tokens - 1)),
                              is_reset=rng.random() < 0.5))
            continue
        body = generation_body(rng, model, chat, prompt, stream, n, max_tokens)
        specs.append(Spec(i, "ok", path, json.dumps(body).encode(), stream, n * max_tokens, n))
    return specs


async def run_ok(client: httpx.AsyncClient, spec: Spec, tally: Tally) -> None:
    what = f"#{spec.index} {spec.path} stream={spec.stream} n={spec.n}"
    headers = {"Content-Type": "application/json"}
    finishes: dict[int, str] = {}
    usage: dict[str, Any] | None = None
    problem = ""
    try:
        if not spec.stream:
            r = await client.post(spec.path, content=spec.body, headers=headers)
            tally.status("ok", r.status_code, what, r.text)
            if r.status_code != 200:
                tally.incomplete.append(f"{what}: {r.status_code} {r.text[:200]}")
                return
            data = r.json()
            usage = data.get("usage")
            finishes = {c["index"]: c.get("finish_reason") for c in data["choices"]}
        else:
            async with client.stream("POST", spec.path, content=spec.body,
                                     headers=headers) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")
                    tally.status("ok", r.status_code, what, text)
                    tally.incomplete.append(f"{what}: {r.status_code} {text[:200]}")
                    return
                tally.status("ok", 200, what)
                done = False
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        problem = f"error event {line[:300]}"
                        tally.server_errors.append(f"ok {what}: in-stream {line[:300]}")
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or []:
                        if choice.get("finish_reason"):
                            finishes[choice["index"]] = choice["finish_reason"]
                if not done:
                    problem = problem or "no [DONE]"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        tally.statuses["ok"][type(exc).__name__] += 1
        tally.incomplete.append(f"{what}: {type(exc).__name__}: {exc}")
        return
    tokens = (usage or {}).get("completion_tokens")
    tally.num_tokens += tokens or 0
    lengths = sorted(finishes.items()) == [(i, "length") for i in range(spec.n)]
    if tokens == spec.expected_tokens and lengths and not problem:
        tally.num_complete += 1
    else:
        tally.incomplete.append(f"{what}: completion_tokens {tokens} (expected "
                                f"{spec.expected_tokens}), finish {finishes} {problem}")


async def run_disconnect(url: str, spec: Spec, tally: Tally, api_key: str | None) -> None:
    """Send the request over a raw socket and close it: after ``delay_s`` or, for ``events``,
    after that many SSE events (or when the answer is complete, whichever comes first)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    head = (f"POST {spec.path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(spec.body)}\r\n{auth}"
            "Connection: close\r\n\r\n").encode()
    received = b""
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as exc:
        tally.statuses["disconnect"][type(exc).__name__] += 1
        return
    start = time.monotonic()
    finished = False
    try:
        writer.write(head + spec.body)
        await writer.drain()
        deadline = start + (REQUEST_TIMEOUT_S if spec.how == "events" else spec.delay_s)
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                data = await asyncio.wait_for(reader.read(65536), remaining)
            except asyncio.TimeoutError:
                break
            if not data:
                finished = True
                break
            received += data
            if spec.how == "events" and received.count(b"data: ") >= spec.after_events:
                break
    except OSError as exc:
        tally.disconnects[f"error {type(exc).__name__}"] += 1
    finally:
        if spec.is_reset:
            writer.transport.abort()
        else:
            writer.close()
    status: int | str = "none"
    if received.startswith(b"HTTP/1.1 "):
        status = int(received[9:12])
    what = f"#{spec.index} {spec.how} {spec.path} stream={spec.stream}"
    tally.status("disconnect", status, what, received.decode(errors="replace"))
    if finished or b"data: [DONE]" in received:
        tally.disconnects["answer complete before closing"] += 1
    elif status == "none":
        tally.disconnects[f"{spec.how}: closed before the first byte"] += 1
    else:
        tally.disconnects[f"{spec.how}: closed after the first byte"] += 1


async def run_malformed(client: httpx.AsyncClient, spec: Spec, tally: Tally) -> None:
    try:
        r = await client.post(spec.path, content=spec.body,
                              headers={"Content-Type": "application/json"})
    except httpx.HTTPError as exc:
        tally.statuses["malformed"][type(exc).__name__] += 1
        tally.bad_malformed.append(f"{spec.how}: {type(exc).__name__}: {exc}")
        return
    tally.status("malformed", r.status_code, spec.how, r.text)
    try:
        error = r.json()["error"]
        shaped = set(error) >= {"message", "type", "param", "code"}
    except (ValueError, KeyError, TypeError):
        shaped = False
    if not (400 <= r.status_code < 500 and shaped):
        tally.bad_malformed.append(f"{spec.how}: {r.status_code} {r.text[:200]}")


async def run_load(url: str, specs: list[Spec], concurrency: int, tally: Tally,
                   api_key: str | None, server_pid: int | None) -> float:
    """Run ``specs`` on ``concurrency`` workers, printing progress (and the server's RSS
    under load) every tenth of the way; the seconds it took."""
    queue: asyncio.Queue[Spec] = asyncio.Queue()
    for spec in specs:
        queue.put_nowait(spec)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, limits=limits,
                                 headers=headers) as client:

        num_done = 0

        async def worker() -> None:
            nonlocal num_done
            while not queue.empty():
                spec = queue.get_nowait()
                if spec.kind == "ok":
                    await run_ok(client, spec, tally)
                elif spec.kind == "disconnect":
                    await run_disconnect(url, spec, tally, api_key)
                else:
                    await run_malformed(client, spec, tally)
                num_done += 1
                if num_done % max(1, len(specs) // 10) == 0:
                    print(f"  {num_done}/{len(specs)} in {time.monotonic() - start:.0f} s, "
                          f"RSS {fmt_rss(rss_mib(server_pid))}", flush=True)

        start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.monotonic() - start


# -- inter-token latency under long prompts ------------------------------------------------


async def itl_stream(client: httpx.AsyncClient, model: str, i: int, tally: Tally) -> list[float]:
    body = {"model": model, "stream": True, "temperature": 0, "max_tokens": ITL_TOKENS,
            "ignore_eos": True, "messages": [{"role": "user", "content": f"Story {i}."}]}
    gaps: list[float] = []
    last = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        tally.status("itl", r.status_code, f"itl stream {i}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if not any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
    return gaps


async def flood(client: httpx.AsyncClient, bodies: list[tuple[str, bytes]], stop: asyncio.Event,
                tally: Tally) -> None:
    i = 0
    while not stop.is_set():
        path, body = bodies[i % len(bodies)]
        i += 1
        try:
            r = await client.post(path, content=body,
                                  headers={"Content-Type": "application/json"})
            tally.status("flood", r.status_code, "100k-char prompt", r.text)
        except httpx.HTTPError as exc:
            tally.statuses["flood"][type(exc).__name__] += 1


async def measure_itl(url: str, model: str, rng: random.Random, tally: Tally,
                      api_key: str | None, in_flight: int
                      ) -> tuple[list[float], list[float]]:
    """ITL gaps of the well-behaved streams alone, then while ``in_flight`` senders post
    100,000-character prompts back to back."""
    bodies = [(path, json.dumps(
        {"model": model, "max_tokens": 4, "prompt": text_of_chars(rng, FLOOD_CHARS)}
        if path == "/v1/completions" else
        {"model": model, "max_tokens": 4,
         "messages": [{"role": "user", "content": text_of_chars(rng, FLOOD_CHARS)}]}).encode())
        for path in ("/v1/completions", "/v1/chat/completions") * 3]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    without: list[float] = []
    with_flood: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S,
                                 headers=headers) as client, \
            httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S,
                              headers=headers) as flood_client:
        await itl_stream(client, model, -1, Tally())  # warm-up
        for _ in range(ITL_ROUNDS):
            for gaps in await asyncio.gather(*(itl_stream(client, model, i, tally)
                                               for i in range(ITL_STREAMS))):
                without += gaps
            stop = asyncio.Event()
            senders = [asyncio.create_task(flood(flood_client, bodies[k:] + bodies[:k], stop,
                                                 tally))
                       for k in range(in_flight)]
            await asyncio.sleep(0.3)  # the long prompts are arriving
            for gaps in await asyncio.gather(*(itl_stream(client, model, i, tally)
                                               for i in range(ITL_STREAMS))):
                with_flood += gaps
            stop.set()
            await asyncio.gather(*senders)
    return without, with_flood


def p99_ms(values: list[float]) -> float:
    if len(values) < 2:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[98] * 1e3


def p50_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3 if values else float("nan")


# -- the run -----------------------------------------------------------------------------------


async def long_prompt_for(client: httpx.AsyncClient, model: str, rng: random.Random) -> str:
    """Words for a prompt whose prefill takes a while: ~1,500 tokens, at most a third of the
    context (the disconnecting clients' ``prefill`` case)."""
    text = words(rng, 1000)
    r = await client.post("/tokenize", json={"model": model, "prompt": text})
    r.raise_for_status()
    count, max_model_len = r.json()["count"], r.json()["max_model_len"]
    target = min(1500, max_model_len // 3)
    return words(rng, max(50, 1000 * target // count))


async def soak(args: argparse.Namespace, url: str, server_pid: int | None) -> bool:
    rng = random.Random(args.seed)
    lo, hi = (int(x) for x in args.max_tokens_range.split("-"))
    tally = Tally()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    async with httpx.AsyncClient(base_url=url, timeout=60, headers=headers) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        long_prompt = await long_prompt_for(client, model, rng)
        specs = make_specs(rng, args.requests, model, (lo, hi), long_prompt)
        num_tokens = sum(s.expected_tokens for s in specs if s.kind == "ok")
        print(f"model {model}: {args.requests} requests at {args.concurrency} concurrency, "
              f"{Counter(s.kind for s in specs)}; {num_tokens} tokens from the well-behaved "
              f"ones (~{num_tokens / ASSUMED_TOK_S / 60:.1f} min at {ASSUMED_TOK_S:.0f} "
              f"tok/s on the default model)", flush=True)
        num_warmup = max(1, args.requests // 10)
        elapsed = await run_load(url, specs[:num_warmup], args.concurrency, tally,
                                 args.api_key, server_pid)
        rate = tally.num_tokens / elapsed
        rest = sum(s.expected_tokens for s in specs[num_warmup:] if s.kind == "ok")
        print(f"warm-up: {num_warmup} requests in {elapsed:.0f} s, {rate:.0f} tok/s; the rest "
              f"~{rest / max(rate, 1e-9) / 60:.1f} min", flush=True)
        stats_warm = await wait_idle(client)
        rss_warm = rss_mib(server_pid)
        start = time.monotonic()
        without, with_flood = await measure_itl(url, model, rng, tally, args.api_key,
                                                args.flood_in_flight)
        rss_itl = rss_mib(server_pid)
        print(f"idle after the warm-up: RSS {fmt_rss(rss_warm)}; after the ITL phase "
              f"({time.monotonic() - start:.0f} s): {fmt_rss(rss_itl)}", flush=True)
        elapsed += await run_load(url, specs[num_warmup:], args.concurrency, tally,
                                  args.api_key, server_pid)
        stats_end = await wait_idle(client)
        rss_end = rss_mib(server_pid)
        restarts = await engine_restarts(client)
        healthy = (await client.get("/health")).status_code
    num_ok = sum(s.kind == "ok" for s in specs)
    print(f"idle at the end: RSS {fmt_rss(rss_end)}")
    return report(tally, args, num_ok, elapsed, stats_warm, stats_end, (rss_warm, rss_end),
                  without, with_flood, restarts, healthy)


def fmt(value: float | None, spec: str = ".0f") -> str:
    return "n/a" if value is None else format(value, spec)


def report(tally: Tally, args: argparse.Namespace, num_ok: int, elapsed: float,
           stats_warm: dict[str, int], stats_end: dict[str, int],
           rss: tuple[dict[str, float], dict[str, float]], without: list[float],
           with_flood: list[float], restarts: int, healthy: int) -> bool:
    for kind, statuses in tally.statuses.items():
        print(f"{kind:>10}: {dict(sorted(statuses.items(), key=str))}")
    print(f"disconnects: {dict(sorted(tally.disconnects.items()))}")
    for line in tally.server_errors[:5]:
        print(f"5xx: {line}")
    for line in tally.incomplete[:5]:
        print(f"incomplete: {line}")
    for line in tally.bad_malformed[:10]:
        print(f"malformed not a 4xx with the error shape: {line}")
    rss_warm, rss_end = (sum(r.values()) if r else None for r in rss)
    num_malformed = sum(tally.statuses["malformed"].values())
    growth = (None if rss_warm is None or rss_end is None
              else 100 * (rss_end - rss_warm) / rss_warm)
    ratio = p99_ms(with_flood) / p99_ms(without)
    rows = [
        ("5xx (and in-stream errors)", len(tally.server_errors), "0",
         not tally.server_errors),
        ("engine restarts", restarts, "0", restarts == 0),
        ("/health at the end", healthy, "200", healthy == 200),
        ("well-behaved complete", f"{tally.num_complete}/{num_ok}", "all",
         tally.num_complete == num_ok),
        ("malformed: 4xx + error shape",
         f"{num_malformed - len(tally.bad_malformed)}/{num_malformed}", "all",
         not tally.bad_malformed),
        ("held after warm-up", leaks(stats_warm) or 0, "0", not leaks(stats_warm)),
        ("held at the end", leaks(stats_end) or 0, "0", not leaks(stats_end)),
        ("KV blocks in use at the end",
         f"{stats_end['num_used_kv_blocks']}/{stats_end['num_kv_blocks']}", "0",
         stats_end["num_used_kv_blocks"] == 0),
        ("RSS MiB after warm-up / end", f"{fmt(rss_warm)} / {fmt(rss_end)}", "", True),
        ("RSS growth %", fmt(growth, "+.1f"), "< 5", growth is None or growth < 5),
        ("ITL p50 ms alone / with 100k", f"{p50_ms(without):.1f} / {p50_ms(with_flood):.1f}",
         "", True),
        ("ITL p99 ms alone / with 100k", f"{p99_ms(without):.1f} / {p99_ms(with_flood):.1f}",
         "", True),
        ("ITL p99 ratio", f"{ratio:.2f}", "< 2", ratio < 2),
    ]
    print(f"\nsoak: {args.requests} requests at {args.concurrency} concurrency in "
          f"{elapsed:.0f} s (load phases), {tally.num_tokens} tokens from well-behaved "
          f"requests; aborted since start: {stats_end.get('num_aborted_requests')}")
    print(f"{'':<32} {'value':>24} {'target':>7}")
    for name, value, target, met in rows:
        print(f"{name:<32} {value!s:>24} {target:>7} {'' if met else '  MISSED'}")
    return all(met for *_, met in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--tiny", action="store_true",
                        help="build and serve the tiny test model (a quick smoke run)")
    parser.add_argument("--url", default=None,
                        help="use this running server (RSS only if it listens on this host)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens-range", default="4-24", metavar="LO-HI")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--flood-in-flight", type=int, default=3, metavar="N",
                        help="senders posting 100,000-character prompts back to back during "
                             "the ITL phase (default: 3)")
    args = parser.parse_args()
    if args.url:
        port = urlsplit(args.url).port
        ok = asyncio.run(soak(args, args.url.rstrip("/"), port and listener_pid(port)))
        raise SystemExit(0 if ok else 1)
    with tempfile.TemporaryDirectory(prefix="freetoken-soak-") as tmp:
        model = args.model
        if args.tiny:
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
            from tiny_models import make_tiny_model

            model = str(make_tiny_model(Path(tmp) / "tiny", "llama"))
        port = free_port()
        log_path = Path(tempfile.gettempdir()) / f"freetoken-soak-{port}.log"
        proc = start_server(model, port, log_path)
        try:
            ok = asyncio.run(soak(args, f"http://127.0.0.1:{port}", proc.pid))
            alive = proc.poll() is None
        finally:
            stop_server(proc)
        log = log_path.read_text(errors="replace")
        print(f"server log ({log_path}, {len(log.splitlines())} lines); its end:")
        print("\n".join(log.splitlines()[-15:]))
        if not alive:
            print("the server process exited during the soak  MISSED")
        raise SystemExit(0 if ok and alive else 1)


if __name__ == "__main__":
    main()
