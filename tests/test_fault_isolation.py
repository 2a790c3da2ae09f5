"""Nothing a plugin or a client does takes the server down.

A real ``freetoken serve`` on the tiny model, with a test plugin (``tests/plugins/
freetoken_faulty.py``) that raises on purpose, installed for that server process only:
its directory and a generated ``.dist-info`` are on the process's ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_fixtures import MODEL_NAME, Server, start_server, stop_server

PLUGIN_DIR = Path(__file__).parent / "plugins"
NUM_STREAMS = 16
STREAM_TOKENS = 160


def _plugin_env(tmp: Path) -> dict[str, str]:
    """An environment in which ``freetoken_faulty`` is an installed plugin."""
    dist = tmp / "freetoken_faulty-0.1.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: freetoken-faulty\n"
                                   "Version: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[freetoken.plugins]\nfaulty = freetoken_faulty:Faulty\n")
    path = os.pathsep.join([str(PLUGIN_DIR), str(tmp), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Server:
    tmp = tmp_path_factory.mktemp("faulty")
    srv = start_server(tiny_model_dir, "--max-model-len", "1024", env=_plugin_env(tmp),
                       log_file=tmp / "server.log")
    srv.log = tmp / "server.log"
    yield srv
    stop_server(srv)


def _prompt(i: int) -> str:
    return f"Stream number {i} tells a story about the sea and"


def _stream_tokens(srv: Server, i: int, out: dict[int, list[str]], **extra: object) -> None:
    """One greedy stream of ``STREAM_TOKENS`` tokens; its text pieces (or the error)."""
    body = {"model": MODEL_NAME, "prompt": _prompt(i), "max_tokens": STREAM_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True, **extra}
    pieces: list[str] = []
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    pieces.append(f"ERROR {event['error']}")
                else:
                    pieces.extend(c["text"] for c in event["choices"])
    out[i] = pieces


def _run_streams(srv: Server) -> tuple[dict[int, list[str]], list[threading.Thread]]:
    out: dict[int, list[str]] = {}
    threads = [threading.Thread(target=_stream_tokens, args=(srv, i, out))
               for i in range(NUM_STREAMS)]
    for t in threads:
        t.start()
    return out, threads


def _wait_idle(srv: Server, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = srv.stats()
        if stats["num_requests"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


FAULTS = ["validate", "implies", "add_request", "apply", "update", "check_stop"]


def test_a_raising_plugin_fails_only_its_requests(server: Server) -> None:
    baseline, threads = _run_streams(server)
    for t in threads:
        t.join()
    assert all(not any(p.startswith("ERROR") for p in v) for v in baseline.values())

    concurrent, threads = _run_streams(server)
    answers = {}
    for stage in FAULTS:
        for stream in (False, True):
            body = {"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 8,
                    "fail_at": stage, "stream": stream}
            answers[stage, stream] = server.http.post("/v1/completions", json=body)
    for t in threads:
        t.join()

    for (stage, stream), r in answers.items():
        assert r.status_code == 500, (stage, stream, r.text)
        error = r.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "plugin_error"
        assert "'faulty'" in error["message"] and stage in error["message"], error
    # 16 well-behaved streams ran beside the failures and gave the same tokens as alone.
    assert concurrent == baseline
    stats = _wait_idle(server)
    assert stats["num_running"] == 0 and stats["num_used_kv_blocks"] == 0
    metrics = server.http.get("/metrics").text
    for stage in FAULTS:
        assert f'freetoken_request_failures_total{{stage="{stage}",plugin="faulty"}} 2' \
            in metrics, metrics
    assert server.http.get("/health").status_code == 200


def test_a_raising_chat_template_hook_fails_only_its_request(server: Server) -> None:
    messages = [{"role": "user", "content": "Hello"}]
    for stream in (False, True):
        r = server.http.post("/v1/chat/completions", json={
            "messages": messages, "max_tokens": 4, "fail_at": "chat_template", "stream": stream})
        assert r.status_code == 500, r.text
        error = r.json()["error"]
        assert error["code"] == "plugin_error" and "chat_template" in error["message"], error
    plain = server.http.post("/v1/chat/completions", json={"messages": messages,
                                                           "max_tokens": 4})
    assert plain.status_code == 200, plain.text
    assert 'freetoken_request_failures_total{stage="chat_template",plugin="faulty"} 2' \
        in server.http.get("/metrics").text


def test_a_row_whose_logits_become_nan_fails_instead_of_emitting(server: Server) -> None:
    r = server.http.post("/v1/completions", json={
        "model": MODEL_NAME, "prompt": "Hello", "max_tokens": 8, "fail_at": "nan", "n": 2})
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["code"] == "engine_error" and "NaN" in error["message"]
    assert "faulty" in error["message"]  # the processors on the row are named
    ok = server.http.post("/v1/completions", json={
        "model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert ok.status_code == 200
    assert _wait_idle(server)["num_used_kv_blocks"] == 0


def test_non_streaming_request_is_aborted_when_its_client_leaves(server: Server) -> None:
    before = server.stats()["num_aborted_requests"]
    body = {"model": MODEL_NAME, "prompt": ["one", "two"], "n": 3, "max_tokens": 200,
            "ignore_eos": True, "slow_step_s": 0.1}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.8)
    # 200 steps of 0.1 s would take 20 s: the request must be gone long before.
    stats = _wait_idle(server, timeout=5.0)
    assert stats["num_requests"] == 0 and stats["num_used_kv_blocks"] == 0
    assert stats["num_aborted_requests"] == before + 2  # both prompts, every choice


def test_stream_in_prefill_is_aborted_when_its_client_leaves(server: Server) -> None:
    """The first step (prefill and the first token) takes 2 s, every later one too. The
    client leaves during the first: the abort must land right after it, not after the
    second step, which is when the first token would have revealed the disconnect."""
    before = server.stats()["num_aborted_requests"]
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 50, "ignore_eos": True,
            "stream": True, "slow_step_s": 2.0}
    started = time.monotonic()
    with pytest.raises(httpx.ReadTimeout), httpx.stream(
            "POST", f"{server.url}/v1/completions", json=body, timeout=0.5) as r:
        r.read()
    time.sleep(max(0.0, started + 3.0 - time.monotonic()))
    stats = server.stats()
    assert stats["num_requests"] == 0, stats
    assert stats["num_aborted_requests"] == before + 1
