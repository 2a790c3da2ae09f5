"""A bounded fuzz of a real ``freetoken serve`` on the default model from its own OpenAPI
document (schemathesis, through ``bench/fuzz.py``'s ``run_fuzz``, fixed seed, positive and
negative data, every schemathesis check; the bench runs thousands of cases): no answer
>= 500, every 4xx an OpenAI error, every answer as the document declares it, schema-invalid
data refused, schema-valid data refused only by a rule the document states, and the engine
idle afterwards. Plus the served pages the fuzz does not reach: ``/metrics``'s exact content
type and the schema pages under ``--api-key``."""

from __future__ import annotations

import copy
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from server_fixtures import Server, start_server, stop_server

KEY = "fuzz-key"
CASES_PER_OPERATION = 8  # ~ 190 cases over the 12 operations, positive and negative


def _load_bench_fuzz() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "bench" / "fuzz.py"
    spec = importlib.util.spec_from_file_location("bench_fuzz", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench_fuzz = _load_bench_fuzz()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    # The default model; a short context keeps every generation the fuzz asks for short.
    srv = start_server(None, "--api-key", KEY, "--max-model-len", "64", api_key=KEY)
    srv.log_lines = bench_fuzz.drain(srv)  # type: ignore[attr-defined]
    yield srv
    stop_server(srv)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def document(server: Server) -> dict[str, Any]:
    return server.http.get("/schema/openapi.json", headers=auth()).json()


def test_fuzz_from_the_served_schema(server: Server) -> None:
    report = bench_fuzz.run_fuzz(server.url, KEY, CASES_PER_OPERATION, seed=1,
                                 log=lambda _: None)
    print(report.table())
    operations = {f"{method.upper()} {path}" for path, item in document(server)["paths"].items()
                  for method in item}
    assert set(report.counts) == operations
    assert report.num_cases >= 150
    # Both kinds of data reached the generation routes: some served, some refused.
    for route in ("POST /v1/completions", "POST /v1/chat/completions"):
        assert report.counts[route][200] and report.counts[route][400], report.table()
    failures = "\n\n".join(report.failures)
    server_log = "".join(server.log_lines)[-10_000:]  # type: ignore[attr-defined]
    assert report.num_server_errors == 0, f"{failures}\n\nserver log:\n{server_log}"
    assert not report.failures, f"{failures}\n\nserver log:\n{server_log}"
    assert bench_fuzz.settle(server.url, KEY) == []


def test_a_document_that_lies_fails_the_fuzz(server: Server) -> None:
    lying = copy.deepcopy(document(server))
    lying["components"]["schemas"]["ModelList"]["required"].append("num_models")
    report = bench_fuzz.run_fuzz(server.url, KEY, 1, log=lambda _: None, document=lying)
    assert any(f.startswith("GET /v1/models ->") for f in report.failures), report.failures


class FakeResponse:
    def __init__(self, status_code: int, content: bytes) -> None:
        self.status_code, self.content = status_code, content


@pytest.mark.parametrize(("status", "body", "is_ok"), [
    (400, b'{"error": {"message": "m", "type": "t", "param": "p", "code": null}}', True),
    (404, b'{"error": {"message": "m", "type": "t", "param": null, "code": "c"}}', True),
    (200, b"<html>", True),
    (400, b'{"detail": "nope"}', False),
    (404, b"<html>404</html>", False),
    (401, b'{"error": {"message": "m", "type": "t"}}', False),
])
def test_the_openai_error_check(status: int, body: bytes, is_ok: bool) -> None:
    try:
        bench_fuzz.openai_error_shape(None, FakeResponse(status, body), None)
    except AssertionError:
        assert not is_ok
    else:
        assert is_ok


def test_metrics_content_type_is_exact(server: Server) -> None:
    r = server.http.get("/metrics", headers=auth())
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"


@pytest.mark.parametrize("page", ["/schema", "/schema/swagger", "/schema/openapi.json"])
def test_schema_pages_under_an_api_key(server: Server, page: str) -> None:
    r = server.http.get(page)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = server.http.get(page, headers=auth())
    assert r.status_code == 200
