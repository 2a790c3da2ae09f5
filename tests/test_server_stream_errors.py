"""An error after a stream began is one ``data: {"error": …}`` event, then ``[DONE]``.

The engine is replaced by a fake ``EngineClient`` (a test double) that sends a few tokens
and then fails the way the real one can: the engine refuses the request
(``RequestFailed`` → ``InvalidRequest``), the engine process dies (``EngineDeadError``),
or something unexpected raises (a bug)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from litestar.testing import TestClient

from freetoken_core.config import EngineConfig
from freetoken_core.engine.client import EngineDeadError, EngineInfo
from freetoken_core.engine.process import Update
from freetoken_core.errors import InvalidRequest
from freetoken_core.sampling_params import SamplingParams
from freetoken_core.server.app import create_app
from freetoken_core.server.state import ServerConfig

NUM_TOKENS_BEFORE_FAILURE = 3


class FailingEngine:
    """Answers like ``EngineClient``; ``generate`` yields a few tokens, then raises
    ``failure`` (or finishes normally when it is ``None``)."""

    def __init__(self, model_dir: Path, failure: BaseException | None) -> None:
        self.info = EngineInfo(str(model_dir), 642, frozenset({2}), 2048)
        self.failure = failure
        self.dead_message: str | None = None
        self.num_closed = 0

    @property
    def ready(self) -> bool:
        return True

    def start(self) -> None:
        pass

    async def wait_ready(self) -> EngineInfo:
        return self.info

    async def generate(self, prompts: list[tuple[str, list[int]]],
                       params: SamplingParams, is_chat: bool = False
                       ) -> AsyncIterator[Update]:
        try:
            for request_id, _ in prompts:
                for i in range(NUM_TOKENS_BEFORE_FAILURE):
                    last = self.failure is None and i == NUM_TOKENS_BEFORE_FAILURE - 1
                    yield Update(request_id, 0, 300 + i, "length" if last else None, None, 0)
            if self.failure is not None:
                raise self.failure
        finally:
            self.num_closed += 1

    def stop_sequence(self, request_id: str, index: int, stop_reason: object) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _events(model_dir: Path, failure: BaseException | None, path: str,
            body: dict) -> tuple[list[dict], list[str], FailingEngine]:
    engine = FailingEngine(model_dir, failure)
    app = create_app(ServerConfig(EngineConfig(model=str(model_dir))), client=engine)
    with TestClient(app) as http:
        deadline = time.monotonic() + 30
        while http.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        r = http.post(path, json={**body, "stream": True, "max_tokens": 8})
        assert r.status_code == 200, r.text
    lines = [ln[len("data: "):] for ln in r.text.splitlines() if ln.startswith("data: ")]
    return [json.loads(ln) for ln in lines if ln != "[DONE]"], lines, engine


FAILURES = {
    "engine refused": InvalidRequest("logit_bias", "refused by the engine"),
    "engine died": EngineDeadError("the engine process exited (exit code -9)"),
    "unexpected": RuntimeError("boom"),
}
ROUTES = [("/v1/completions", {"prompt": "Hello"}),
          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})]


@pytest.mark.parametrize("failure", FAILURES.values(), ids=FAILURES.keys())
@pytest.mark.parametrize(("path", "body"), ROUTES, ids=["completions", "chat"])
def test_failure_after_first_chunk_is_one_error_event_then_done(
        tiny_model_dir: Path, failure: BaseException, path: str, body: dict) -> None:
    events, lines, engine = _events(tiny_model_dir, failure, path, body)
    assert lines[-1] == "[DONE]" and lines.count("[DONE]") == 1
    errors = [e for e in events if "error" in e]
    assert len(errors) == 1 and "error" in events[-1], events
    error = errors[0]["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if isinstance(failure, InvalidRequest):
        assert error["param"] == "logit_bias"
    if isinstance(failure, RuntimeError):
        assert error["type"] == "internal_error" and "boom" not in error["message"]
    # Tokens before the failure were streamed first, and the engine stream was closed.
    assert len(events) >= 2 and all("choices" in e for e in events[:-1])
    assert engine.num_closed == 1


def test_stream_without_failure_has_no_error_event(tiny_model_dir: Path) -> None:
    events, lines, _ = _events(tiny_model_dir, None, *ROUTES[0])
    assert lines[-1] == "[DONE]" and not any("error" in e for e in events)
    finishes = [c["finish_reason"] for e in events for c in e["choices"]]
    assert finishes.count("length") == 1
