"""End to end on a real ``freetoken serve --api-key`` (tiny model): the key check on every
route but ``/health``, ``/version``, and ``/metrics`` parsed by Prometheus' own parser."""

from __future__ import annotations

import time
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import Server, start_server, stop_server

API_KEY = "sekret-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
USER = [{"role": "user", "content": "Tell me a story"}]


@pytest.fixture(scope="module")
def locked(tiny_model_dir: Path) -> Iterator[Server]:
    srv = start_server(tiny_model_dir, "--api-key", API_KEY, api_key=API_KEY)
    yield srv
    stop_server(srv)


def _ok(server: Server, path: str, body: dict) -> dict:
    r = server.http.post(path, json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


# -- /version, /metrics -----------------------------------------------------------------


def test_version(locked: Server) -> None:
    r = locked.http.get("/version", headers=AUTH)
    assert r.status_code == 200 and r.json() == {"version": version("freetoken")}


def _metrics(locked: Server) -> dict[str, float]:
    """Every sample as ``name{label="v"}`` → value, parsed by Prometheus' own parser."""
    r = locked.http.get("/metrics", headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def test_metrics_count_what_was_served(locked: Server) -> None:
    before = _metrics(locked)
    for name in ("freetoken_num_seqs_running", "freetoken_num_seqs_waiting",
                 "freetoken_kv_blocks_used", "freetoken_kv_cache_usage_ratio",
                 "freetoken_e2e_request_latency_seconds_count"):
        assert name in before, sorted(before)
    assert before["freetoken_kv_blocks_total"] > 0
    out = _ok(locked, "/v1/completions", {"prompt": "Metrics please", "n": 2, **GREEDY})
    stopped = _ok(locked, "/v1/completions", {"prompt": "x", **GREEDY, "max_tokens": 1})
    after = _metrics(locked)

    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    usage = out["usage"]
    assert grew("freetoken_prompt_tokens_total") == (
        usage["prompt_tokens"] + stopped["usage"]["prompt_tokens"])
    assert grew("freetoken_generation_tokens_total") == usage["completion_tokens"] + 1
    assert grew('freetoken_choices_finished_total{finish_reason="length"}') == 3
    assert grew("freetoken_requests_total") == 2
    assert grew("freetoken_e2e_request_latency_seconds_count") == 2
    assert grew('freetoken_e2e_request_latency_seconds_bucket{le="+Inf"}') == 2
    assert grew("freetoken_e2e_request_latency_seconds_sum") > 0
    # The engine's steps: the n=2 request's 8 tokens are 7 decode steps after its prefill
    # (both choices in each), the 1-token request only a prefill.
    steps = grew("freetoken_engine_step_seconds_count")
    assert grew("freetoken_engine_decode_step_seconds_count") == 7 and steps >= 9
    assert grew('freetoken_engine_step_seconds_bucket{le="+Inf"}') == steps
    assert 0 < grew("freetoken_engine_decode_step_seconds_sum") < grew(
        "freetoken_engine_step_seconds_sum")
    assert after["freetoken_num_seqs_running"] == after["freetoken_kv_blocks_used"] == 0
    assert 0 <= after["freetoken_kv_cache_usage_ratio"] <= 1


def test_metrics_count_a_disconnect_as_abort(locked: Server) -> None:
    before = _metrics(locked)
    body = {"prompt": "Long", "temperature": 0, "max_tokens": 1500, "ignore_eos": True,
            "stream": True}
    with (httpx.Client(base_url=locked.url, headers=AUTH, timeout=30) as http,
          http.stream("POST", "/v1/completions", json=body) as r):
        lines = r.iter_lines()
        assert any(next(lines).startswith("data:") for _ in range(4))
    deadline = time.monotonic() + 10
    after = _metrics(locked)
    while (after.get('freetoken_choices_finished_total{finish_reason="abort"}', 0)
           == before.get('freetoken_choices_finished_total{finish_reason="abort"}', 0)
           and time.monotonic() < deadline):
        time.sleep(0.1)
        after = _metrics(locked)
    key = 'freetoken_choices_finished_total{finish_reason="abort"}'
    assert after.get(key, 0) - before.get(key, 0) == 1
    assert after["freetoken_num_seqs_running"] == after["freetoken_kv_blocks_used"] == 0


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/v1/models"), ("GET", "/v1/models/tiny/llama"), ("GET", "/metrics"),
    ("GET", "/version"), ("GET", "/internal/stats"), ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"), ("POST", "/tokenize"), ("POST", "/v1/detokenize"),
    ("GET", "/schema/openapi.json"),
])
def test_api_key_is_required_everywhere_but_health(locked: Server, method: str,
                                                   path: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = locked.http.request(method, path, headers=headers, json={"prompt": "x"})
        assert r.status_code == 401, (headers, r.text)
        error = r.json()["error"]
        assert error["code"] == "invalid_api_key" and error["message"]
    body = ({"tokens": [1]} if "detokenize" in path else
            {"prompt": "x"} if "tokenize" in path else
            {"messages": USER, "max_tokens": 1} if "chat" in path else
            {"prompt": "x", "max_tokens": 1})
    r = locked.http.request(method, path, json=body, headers=AUTH)
    assert r.status_code == 200, r.text


def test_api_key_with_the_openai_client(locked: Server) -> None:
    assert locked.http.get("/health").status_code == 200
    out = locked.client.completions.create(model=locked.model, prompt="Hi", max_tokens=2)
    assert out.usage.completion_tokens == 2
    wrong = openai.OpenAI(base_url=f"{locked.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
