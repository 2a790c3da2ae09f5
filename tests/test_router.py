"""Data parallelism: two ``freetoken serve`` replicas of the default model behind SMG (the
Shepherd Model Gateway, ``pip install smg``) with ``--policy cache_aware``, all on loopback
(docs/data_parallel.md). Requests reach both replicas; requests that share a long prefix
all land on the replica that cached it (``usage.prompt_tokens_details.cached_tokens`` and
that replica's ``freetoken_requests_total``); a replica killed with SIGKILL is routed around
and the router's health checks take it out of rotation; stopping everything leaves no
process behind.

The replicas run with ``--api-key`` and the router with the same key, which it requires of
clients and sends to the replicas: the set-up the docs recommend. Each replica gets a CPU
of its own where there are two. Skipped, with the reason, where ``smg`` is not installed.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest
from server_fixtures import START_TIMEOUT_S, free_port

pytestmark = pytest.mark.slow

pytest.importorskip("smg", reason="the router under test is SMG: pip install smg")

MODEL_NAME = "default"
API_KEY = "router-test-key"
HEALTH_INTERVAL_S = 1
HEALTH_FAILURES = 2
NUM_REPEATS = 6
WORDS = ("amber", "basalt", "cedar", "delta", "ember", "fjord", "granite", "harbor", "island",
         "juniper", "kelp", "lagoon", "meadow", "nectar", "orchard", "pebble", "quartz", "river",
         "summit", "tundra", "valley", "willow", "yarrow", "zephyr")


def words(seed: int, count: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(count))


@dataclass
class Replica:
    proc: subprocess.Popen
    url: str
    http: httpx.Client
    pids: set[int] = field(default_factory=set)
    """The replica's process tree (server, engine, resource tracker) once it is healthy."""

    def num_requests(self) -> int:
        r = self.http.get("/metrics")
        assert r.status_code == 200, r.text
        return int(re.search(r"^freetoken_requests_total (\d+)$", r.text, re.MULTILINE).group(1))


@dataclass
class Deployment:
    replicas: list[Replica]
    router: subprocess.Popen
    http: httpx.Client
    log_dir: Path

    def complete(self, prompt: str, max_tokens: int = 1) -> dict:
        r = self.http.post("/v1/completions", json={
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()

    def counts(self) -> list[int]:
        return [replica.num_requests() for replica in self.replicas]

    def workers(self) -> dict[str, dict]:
        r = self.http.get("/workers")
        assert r.status_code == 200, r.text
        return {w["url"]: w for w in r.json()["workers"]}


def start_replica(cpu: int | None, log: Path) -> Replica:
    port = free_port()
    # One CPU per replica, as on a host with a replica per socket or GPU.
    pin = [] if cpu is None else ["taskset", "-c", str(cpu)]
    cmd = [*pin, sys.executable, "-m", "freetoken_core.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", MODEL_NAME, "--api-key", API_KEY,
           "--kv-cache-tokens", "4096", "--max-num-seqs", "8", "--log-level", "warning"]
    with log.open("w") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    http = httpx.Client(base_url=url, timeout=60,
                        headers={"Authorization": f"Bearer {API_KEY}"})
    return Replica(proc, url, http)


def wait_until(predicate, timeout_s: float, what: str, logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (httpx.TransportError, KeyError, ValueError):
            pass
        time.sleep(0.25)
    tails = "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace")
                                                     .splitlines()[-20:]) for p in logs)
    pytest.fail(f"{what} not within {timeout_s:.0f} s; the logs' ends:\n{tails}")


def start_router(replicas: list[Replica], log: Path) -> tuple[subprocess.Popen, httpx.Client]:
    port = free_port()
    cmd = [sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1", "--port", str(port),
           "--worker-urls", *(r.url for r in replicas), "--policy", "cache_aware",
           "--api-key", API_KEY,
           "--health-check-interval-secs", str(HEALTH_INTERVAL_S),
           "--health-failure-threshold", str(HEALTH_FAILURES),
           "--health-check-timeout-secs", "1",
           "--worker-startup-check-interval", "1",
           # its metrics listener defaults to 0.0.0.0:29000: loopback, and a free port
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
           # nothing is in flight when the tests stop it (the default waits ~5 s)
           "--shutdown-grace-period-secs", "0",
           "--log-level", "warn"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT)
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60,
                        headers={"Authorization": f"Bearer {API_KEY}"})
    return proc, http


def process_tree(pid: int) -> set[int]:
    return {pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))}


def alive(pids: set[int]) -> set[int]:
    """The pids still running (a zombie is not running: it only waits to be reaped)."""
    left = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.add(pid)
        except psutil.NoSuchProcess:
            pass
    return left


def stop(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    log_dir = tmp_path_factory.mktemp("router")
    cpus = sorted(os.sched_getaffinity(0)) if shutil.which("taskset") else []
    replicas = [start_replica(cpus[i] if len(cpus) >= 2 else None, log_dir / f"replica{i}.log")
                for i in range(2)]
    router = None
    try:
        logs = [log_dir / f"replica{i}.log" for i in range(2)]
        for replica, log in zip(replicas, logs):
            wait_until(lambda r=replica: r.proc.poll() is None
                       and r.http.get("/health").status_code == 200,
                       START_TIMEOUT_S, f"replica {replica.url} healthy", [log])
            replica.pids = process_tree(replica.proc.pid)
        router, http = start_router(replicas, log_dir / "router.log")
        dep = Deployment(replicas, router, http, log_dir)
        wait_until(lambda: router.poll() is None and all(
            w["is_healthy"] and w["status"] == "ready" for w in dep.workers().values())
            and len(dep.workers()) == 2, 30, "the router's two workers ready",
            [*logs, log_dir / "router.log"])
        yield dep
    finally:
        if router is not None:
            stop(router, signal.SIGTERM)
            http.close()
        for replica in replicas:
            stop(replica.proc)
            replica.http.close()


def test_requests_reach_both_replicas(deployment: Deployment) -> None:
    """Prompts with nothing in common, sent at once: the policy falls back on load, and
    each replica serves some."""
    before = deployment.counts()
    prompts = [f"{i} {words(1000 + i, 30)}" for i in range(8)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(lambda p: deployment.complete(p, max_tokens=8), prompts))
    served = [after - b for after, b in zip(deployment.counts(), before)]
    assert sum(served) == len(prompts)
    assert all(n > 0 for n in served), served


def test_shared_prefix_lands_on_the_replica_that_cached_it(deployment: Deployment) -> None:
    """A ~600-token system text, then questions after it one at a time: every repeat goes
    to the replica whose prefix cache holds the text, and is served from it."""
    system = words(7, 600) + "\n\n"
    first_before = deployment.counts()
    first = deployment.complete(system + "Question 0:")
    home = [a - b for a, b in zip(deployment.counts(), first_before)].index(1)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] < 100
    r = deployment.replicas[home].http.post("/tokenize",
                                            json={"model": MODEL_NAME, "prompt": system})
    num_system_tokens = r.json()["count"]
    assert num_system_tokens >= 500
    for i in range(1, NUM_REPEATS + 1):
        before = deployment.counts()
        usage = deployment.complete(system + f"Question {i}:")["usage"]
        served = [a - b for a, b in zip(deployment.counts(), before)]
        assert served[home] == 1 and sum(served) == 1, (i, served)
        # the system text but for its last partial block (8 tokens) and a token the
        # question's first may have merged with
        assert usage["prompt_tokens_details"]["cached_tokens"] >= num_system_tokens - 16, usage


def test_killed_replica_is_routed_around(deployment: Deployment) -> None:
    """SIGKILL one replica: its engine goes with it, requests keep succeeding (the router
    retries on the other), its health checks mark it unhealthy, and from then on every
    request goes to the survivor."""
    victim, survivor = deployment.replicas
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(timeout=10)
    wait_until(lambda: not alive(victim.pids), 15, "the killed replica's processes gone",
               [deployment.log_dir / "replica0.log"])
    for i in range(4):
        deployment.complete(f"after the kill {i} {words(2000 + i, 20)}")
    wait_until(lambda: not deployment.workers()[victim.url]["is_healthy"],
               HEALTH_INTERVAL_S * (HEALTH_FAILURES + 2) + 5,
               "the killed replica marked unhealthy", [deployment.log_dir / "router.log"])
    assert deployment.workers()[survivor.url]["is_healthy"]
    before = survivor.num_requests()
    for i in range(4):
        deployment.complete(f"routed around {i} {words(3000 + i, 20)}")
    assert survivor.num_requests() - before == 4


def test_stopping_leaves_no_process(deployment: Deployment) -> None:
    """SIGTERM to the router and SIGKILL to the replicas: nothing they started lives on."""
    pids = {deployment.router.pid}.union(*(r.pids for r in deployment.replicas))
    assert pids
    stop(deployment.router, signal.SIGTERM)
    for replica in deployment.replicas:
        stop(replica.proc)
    deadline = time.monotonic() + 15
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert not alive(pids), [psutil.Process(p).cmdline() for p in alive(pids)]
