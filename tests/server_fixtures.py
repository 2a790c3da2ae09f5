"""Start and stop a real ``freetoken serve`` subprocess on the tiny model, for the server
test modules (each keeps its own module-scoped fixture over ``start_server``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

START_TIMEOUT_S = 60.0
MODEL_NAME = "tiny/llama"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A running server: ``http`` (raw httpx) and ``client`` (the official ``openai``
    client, with ``api_key`` sent as the bearer token)."""

    def __init__(self, proc: subprocess.Popen, port: int, model: str,
                 api_key: str = "x") -> None:
        self.proc, self.port, self.model = proc, port, model
        self.url = f"http://127.0.0.1:{port}"
        self.http = httpx.Client(base_url=self.url, timeout=30)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0)
        self.health_seen: list[int] = []

    def stats(self) -> dict:
        r = self.http.get("/internal/stats")
        assert r.status_code == 200, r.text
        return r.json()


def serve_cmd(model: str | None, port: int, *extra: str) -> list[str]:
    """``freetoken serve`` on ``model`` (``None``: the embedded default model)."""
    model_args = [] if model is None else ["--model", model]
    return [sys.executable, "-m", "freetoken_core.cli", "serve", *model_args,
            "--port", str(port), "--kv-cache-tokens", "8192", "--log-level", "warning",
            "--served-model-name", MODEL_NAME, *extra]


def start_server(model_dir: Path | None, *extra: str, api_key: str = "x",
                 env: dict[str, str] | None = None, log_file: Path | None = None) -> Server:
    """Start the server and wait until ``/health`` is 200 (fails the test otherwise).
    ``env`` replaces the server process's environment; ``log_file`` takes its output (a
    server that logs much must not write into a pipe nobody reads)."""
    port = free_port()
    out = open(log_file, "w") if log_file is not None else subprocess.PIPE  # noqa: SIM115
    model = None if model_dir is None else str(model_dir)
    proc = subprocess.Popen(serve_cmd(model, port, *extra), stdout=out,
                            stderr=subprocess.STDOUT, text=True, env=env)
    srv = Server(proc, port, MODEL_NAME, api_key)
    deadline = time.monotonic() + START_TIMEOUT_S
    status = None
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            status = srv.http.get("/health").status_code
            srv.health_seen.append(status)
        except httpx.TransportError:
            status = None
        if status == 200:
            break
        time.sleep(0.25)
    if status != 200:
        proc.kill()
        output = proc.communicate()[0] if log_file is None else log_file.read_text()
        pytest.fail(f"freetoken serve did not become healthy within {START_TIMEOUT_S} s "
                    f"(last status {status}); its output:\n{output}")
    return srv


def stop_server(srv: Server) -> None:
    if srv.proc.poll() is None:
        srv.proc.kill()
        srv.proc.wait()


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return server.http.post(path, json=body)


def ok(server: Server, path: str, body: dict) -> dict:
    """POST and return the JSON body, asserting a 200."""
    r = post(server, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def events(server: Server, path: str, body: dict) -> list[dict]:
    """POST with ``stream: true``; the SSE events before the final ``[DONE]``, decoded."""
    r = post(server, path, {**body, "stream": True})
    assert r.status_code == 200, r.text
    lines = [ln[len("data: "):] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def start_script_server(model_dir: Path, template: Path, tmp: Path) -> Server:
    """``freetoken serve`` of ``model_dir`` with the chat template ``template`` and the test
    plugin ``script`` (tests/plugins/freetoken_script.py: the model "writes" the token ids a
    request scripts), installed as an entry point from a dist-info made in ``tmp``."""
    dist = tmp / "freetoken_script-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: freetoken-script\n"
                                   "Version: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[freetoken.plugins]\nscript = freetoken_script:Script\n")
    plugins = Path(__file__).parent / "plugins"
    path = os.pathsep.join([str(plugins), str(tmp), os.environ.get("PYTHONPATH", "")])
    return start_server(model_dir, "--chat-template", str(template),
                        env={**os.environ, "PYTHONPATH": path}, log_file=tmp / "serve.log")
