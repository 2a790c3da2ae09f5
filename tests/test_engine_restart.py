"""The engine process dies under load (``kill -9``): the server answers its in-flight
requests at once, reports 503 while it starts a new engine, then serves again."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from server_fixtures import MODEL_NAME, Server, start_server, stop_server

NUM_STREAMS = 16
START_AGAIN_TIMEOUT_S = 90.0


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Server:
    log = tmp_path_factory.mktemp("restart") / "server.log"
    srv = start_server(tiny_model_dir, "--engine-restart-delay", "0.2", log_file=log)
    yield srv
    stop_server(srv)


def _engine_process(srv: Server) -> psutil.Process:
    children = [c for c in psutil.Process(srv.proc.pid).children()
                if any("spawn_main" in part for part in c.cmdline())]
    assert len(children) == 1, [c.cmdline() for c in children]
    return children[0]


class Stream(threading.Thread):
    """A long greedy stream; records when its first chunk and its error event arrived."""

    def __init__(self, srv: Server, i: int) -> None:
        super().__init__(daemon=True)
        self.srv, self.i = srv, i
        self.first_chunk = threading.Event()
        self.error: dict | None = None
        self.error_at: float | None = None
        self.done_seen = False

    def run(self) -> None:
        body = {"model": MODEL_NAME, "prompt": f"Story {self.i}:", "max_tokens": 1500,
                "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{self.srv.url}/v1/completions", json=body,
                          timeout=60) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    self.done_seen = True
                elif line.startswith("data: "):
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        self.error, self.error_at = event["error"], time.monotonic()
                    else:
                        self.first_chunk.set()


def test_kill_9_of_the_engine_is_survived(server: Server) -> None:
    old_engine = _engine_process(server)
    streams = [Stream(server, i) for i in range(NUM_STREAMS)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.first_chunk.wait(60), "the stream never started"

    old_engine.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    for s in streams:
        s.join(10)
    # Every in-flight stream got its error event (503 semantics) within a second, then [DONE].
    for s in streams:
        assert s.error is not None and s.done_seen, s.i
        assert s.error["code"] == "engine_unavailable"
        assert s.error_at - killed_at < 1.0, s.error_at - killed_at

    # While the new engine starts: 503 with Retry-After, never a hang.
    r = server.http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi",
                                                  "max_tokens": 2})
    health = server.http.get("/health")
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
    assert r.json()["error"]["code"] == "engine_unavailable"
    assert health.status_code == 503 and "retry-after" in health.headers

    deadline = time.monotonic() + START_AGAIN_TIMEOUT_S
    while server.http.get("/health").status_code != 200:
        assert time.monotonic() < deadline, "the engine did not come back"
        time.sleep(0.2)
    assert _engine_process(server).pid != old_engine.pid
    r = server.http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi",
                                                  "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    stats = server.stats()
    assert stats["num_running"] == 0 and stats["num_used_kv_blocks"] == 0
    metrics = server.http.get("/metrics").text
    assert "freetoken_engine_restarts_total 1" in metrics
    assert "freetoken_engine_up 1" in metrics
