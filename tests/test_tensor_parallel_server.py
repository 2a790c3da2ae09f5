"""``freetoken serve --tensor-parallel-size 2``: rank 1 killed in the middle of a stream.
The stream ends with an error event, new requests get 503 while the supervisor starts a
new engine and group, then 200; no rank is left behind."""

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

START_AGAIN_TIMEOUT_S = 120.0


def _ranks(srv: Server) -> list[psutil.Process]:
    """The server's tensor-parallel rank processes (not rank 0, the engine process)."""
    return [p for p in psutil.Process(srv.proc.pid).children(recursive=True)
            if "freetoken_core.engine.tp_rank" in " ".join(p.cmdline())]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Server:
    log = tmp_path_factory.mktemp("tp") / "server.log"
    srv = start_server(tiny_model_dir, "--tensor-parallel-size", "2",
                       "--engine-restart-delay", "0.2", log_file=log)
    yield srv
    ranks = _ranks(srv)
    stop_server(srv)
    _, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive, f"ranks outlived the server: {[p.pid for p in alive]}"


def test_serves_greedy_like_one_rank(server: Server, tiny_model_dir: Path) -> None:
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 12,
            "temperature": 0}
    two = server.http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    from freetoken_core import LLM, SamplingParams

    with LLM(str(tiny_model_dir), kv_cache_tokens=8192, progress=False) as llm:
        one = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=12))
    assert two == one[0].outputs[0].text
    assert len(_ranks(server)) == 1


def test_killed_rank_fails_the_stream_then_the_group_comes_back(server: Server) -> None:
    [rank1] = _ranks(server)
    events: list[dict] = []
    arrived: list[float] = []
    started = threading.Event()

    def stream() -> None:
        body = {"model": MODEL_NAME, "prompt": "Story:", "max_tokens": 1500,
                "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                          timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[len("data: "):]))
                    arrived.append(time.monotonic())
                    started.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert started.wait(60), "the stream never started"
    rank1.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    reader.join(15)
    assert not reader.is_alive()
    assert "error" in events[-1], events[-1]
    assert events[-1]["error"]["code"] == "engine_unavailable", events[-1]
    assert arrived[-1] - killed_at < 1.5, arrived[-1] - killed_at  # noticed within a second

    r = server.http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi",
                                                  "max_tokens": 2})
    assert r.status_code == 503, r.text
    deadline = time.monotonic() + START_AGAIN_TIMEOUT_S
    while server.http.get("/health").status_code != 200:
        assert time.monotonic() < deadline, "the group did not come back"
        time.sleep(0.2)
    r = server.http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi",
                                                  "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    ranks = _ranks(server)
    assert len(ranks) == 1 and ranks[0].pid != rank1.pid  # the old one is gone, not orphaned
