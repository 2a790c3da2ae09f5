"""End to end: a real ``freetoken serve`` subprocess on the tiny model, driven with the
official ``openai`` client and with raw HTTP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from server_fixtures import Server, free_port, serve_cmd, start_server, stop_server
from server_fixtures import post as _post


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[Server]:
    srv = start_server(tiny_model_dir)
    yield srv
    stop_server(srv)



GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
SDK_GREEDY = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


def test_health_is_503_until_the_model_is_loaded(server: Server) -> None:
    seen = server.health_seen
    assert seen[-1] == 200 and set(seen) <= {503, 200}
    assert 503 in seen, "the server answered before the engine process had loaded the model"
    r = server.http.get("/health")
    assert r.status_code == 200


def test_models_and_unknown_model(server: Server) -> None:
    models = server.client.models.list()
    assert [m.id for m in models.data] == [server.model]
    assert server.http.get(f"/v1/models/{server.model}").json()["id"] == server.model
    r = server.http.get("/v1/models/nope")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    r = _post(server, "/v1/completions", {"model": "nope", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_completion_streamed_equals_non_streamed(server: Server) -> None:
    kwargs = {"model": server.model, "prompt": "Once upon a time", "temperature": 0,
              "max_tokens": 12, "extra_body": {"ignore_eos": True}}
    full = server.client.completions.create(**kwargs)
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12
    count = _post(server, "/tokenize", {"prompt": "Once upon a time"}).json()["count"]
    assert full.usage.prompt_tokens == count
    assert full.usage.total_tokens == count + 12
    chunks = list(server.client.completions.create(stream=True, **kwargs))
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]


def test_a_stream_is_server_sent_events_one_data_line_each(server: Server) -> None:
    r = _post(server, "/v1/completions", {"model": server.model, "prompt": "Hi\nthere",
                                          "max_tokens": 4, "stream": True})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["cache-control"] == "no-cache" and r.headers["x-accel-buffering"] == "no"
    events = r.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    for event in events[:-2]:
        assert event.startswith("data: {") and "\n" not in event
        json.loads(event[len("data: "):])


def test_chat_streamed_equals_non_streamed_with_usage(server: Server) -> None:
    messages = [{"role": "user", "content": "Tell me a story"}]
    full = server.client.chat.completions.create(
        model=server.model, messages=messages, temperature=0, max_completion_tokens=10,
        extra_body={"ignore_eos": True})
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    count = _post(server, "/v1/tokenize", {"messages": messages}).json()["count"]
    assert full.usage.prompt_tokens == count
    assert full.usage.prompt_tokens_details.cached_tokens >= 0
    stream = server.client.chat.completions.create(
        model=server.model, messages=messages, temperature=0, max_completion_tokens=10,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1] and not chunks[-1].choices
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 10
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks
            if c.choices and c.choices[0].finish_reason] == ["length"]


def test_n_choices_streamed_and_not(server: Server) -> None:
    kwargs = {"model": server.model, "prompt": "Hello", "temperature": 1.0, "max_tokens": 6,
              "n": 2, "seed": 7, "extra_body": {"ignore_eos": True}}
    full = server.client.completions.create(**kwargs)
    assert sorted(c.index for c in full.choices) == [0, 1]
    assert full.usage.completion_tokens == 12
    assert full.usage.prompt_tokens == _post(server, "/tokenize",
                                             {"prompt": "Hello"}).json()["count"]
    finishes: dict[int, list[str]] = {0: [], 1: []}
    texts = {0: "", 1: ""}
    for chunk in server.client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finishes[choice.index].append(choice.finish_reason)
    assert finishes == {0: ["length"], 1: ["length"]}
    assert texts == {c.index: c.text for c in full.choices}  # seeded: same draws


def test_prompt_forms(server: Server) -> None:
    ids = _post(server, "/tokenize", {"prompt": "Hello world"}).json()["tokens"]
    by_ids = server.client.completions.create(model=server.model, prompt=ids, **SDK_GREEDY)
    by_text = server.client.completions.create(model=server.model, prompt="Hello world",
                                               **SDK_GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    many = server.client.completions.create(model=server.model, prompt=[ids, ids[:1]],
                                            **SDK_GREEDY)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == by_text.choices[0].text
    assert many.usage.prompt_tokens == len(ids) + 1
    texts = server.client.completions.create(model=server.model, prompt=["a", "b", "c"],
                                             **SDK_GREEDY)
    assert len(texts.choices) == 3
    r = _post(server, "/detokenize", {"tokens": ids})
    assert r.json()["prompt"] == "Hello world"


def test_stop_strings(server: Server) -> None:
    body = {"prompt": "The weather today", "temperature": 0, "max_tokens": 40,
            "ignore_eos": True}
    full = _post(server, "/v1/completions", body).json()["choices"][0]["text"]
    windows = [full[i:i + 2] for i in range(4, len(full) - 2)
               if full[i:i + 2].isprintable() and "\ufffd" not in full[i:i + 2]
               and full[i:i + 2].strip()]
    assert windows, full
    stop = windows[0]
    expected = full[:full.index(stop)]
    choice = _post(server, "/v1/completions", {**body, "stop": [stop]}).json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (
        expected, "stop", stop)
    kept = _post(server, "/v1/completions",
                 {**body, "stop": stop, "include_stop_str_in_output": True}).json()
    assert kept["choices"][0]["text"] == expected + stop
    streamed = "".join(c.choices[0].text for c in server.client.completions.create(
        model=server.model, stream=True, stop=[stop], extra_body={"ignore_eos": True},
        prompt=body["prompt"], temperature=0, max_tokens=40))
    assert streamed == expected


def test_logit_bias_steers_first_token(server: Server) -> None:
    plain = _post(server, "/v1/completions", {"prompt": "Hi", **GREEDY, "max_tokens": 1})
    plain_text = plain.json()["choices"][0]["text"]
    token = next(t for t in range(300, 600)
                 if _post(server, "/detokenize", {"tokens": [t]}).json()["prompt"] != plain_text
                 and _post(server, "/detokenize", {"tokens": [t]}).json()["prompt"].isalpha())
    word = _post(server, "/detokenize", {"tokens": [token]}).json()["prompt"]
    steered = server.client.completions.create(
        model=server.model, prompt="Hi", temperature=0, max_tokens=1,
        logit_bias={str(token): 100})
    assert steered.choices[0].text == word != plain_text


def test_stop_token_ids_stop_with_the_token_as_reason(server: Server) -> None:
    forced = {"prompt": "Hi", "temperature": 0, "max_tokens": 8, "logit_bias": {"300": 100}}
    free = _post(server, "/v1/completions", forced).json()
    assert free["usage"]["completion_tokens"] == 8  # token 300 every step, no stop
    stopped = _post(server, "/v1/completions", {**forced, "stop_token_ids": [300]}).json()
    choice = stopped["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == 300
    assert stopped["usage"]["completion_tokens"] == 1


def test_min_tokens_forces_length(server: Server) -> None:
    eos_first = {"prompt": "Hi", "temperature": 0, "max_tokens": 20, "logit_bias": {"2": 100}}
    plain = _post(server, "/v1/completions", eos_first).json()
    assert plain["usage"]["completion_tokens"] == 1
    assert plain["choices"][0]["finish_reason"] == "stop"
    held = server.client.completions.create(
        model=server.model, prompt="Hi", temperature=0, max_tokens=20,
        logit_bias={"2": 100}, extra_body={"min_tokens": 5})
    assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "x", "temperature": 3}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 17}, "n"),
    ("/v1/completions", {"prompt": "x", "top_k": 0}, "top_k"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "no_such_field": 1}, "no_such_field"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, "max_tokens"),
    ("/v1/completions", {"prompt": [7] * 2100}, "prompt"),
    ("/v1/completions", {"prompt": [99999]}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5, "min_tokens": 10}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [99999]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}},
     "stream_options"),
    ("/v1/chat/completions", {"prompt": "x"}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "x",
                                            "tool_calls": []}]}, "messages[0].tool_calls"),
    ("/v1/completions", {"prompt": "x", "stream": True,
                         "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "x", "tools": []}, "tools"),
    ("/detokenize", {"tokens": [99999]}, "tokens"),
])
def test_invalid_request_is_400_naming_the_field(server: Server, path: str, body: dict,
                                                  param: str) -> None:
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"]


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b""])
def test_malformed_body_is_400(server: Server, raw: bytes) -> None:
    r = server.http.post("/v1/chat/completions", content=raw,
                         headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


def test_user_field_is_accepted(server: Server) -> None:
    r = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "user": "me"})
    assert r.status_code == 200, r.text


def test_disconnect_aborts_while_other_stream_completes(server: Server) -> None:
    other: dict = {}

    def run_other() -> None:
        r = _post(server, "/v1/completions", {"prompt": "Other", **GREEDY, "max_tokens": 30,
                                              "stream": True})
        other["lines"] = [ln for ln in r.text.splitlines() if ln.startswith("data:")]

    body = {"prompt": "Long", "temperature": 0, "max_tokens": 2000, "ignore_eos": True,
            "stream": True, "n": 2}
    num_aborted = server.stats()["num_aborted_requests"]
    with (httpx.Client(base_url=server.url, timeout=30) as http,
          http.stream("POST", "/v1/completions", json=body) as r):
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(ln.startswith("data:") for ln in got)
        thread = threading.Thread(target=run_other)
        thread.start()
        assert server.stats()["num_running"] >= 2
    # The connection is closed: the two long choices must be aborted, not run to 2,000.
    deadline = time.monotonic() + 10
    stats = server.stats()
    while stats["num_running"] + stats["num_waiting"] > 0 and time.monotonic() < deadline:
        thread.join(0.1)
        stats = server.stats()
    thread.join(30)
    assert stats["num_running"] == stats["num_waiting"] == stats["num_requests"] == 0, stats
    assert stats["num_used_kv_blocks"] == 0, stats
    assert stats["num_aborted_requests"] == num_aborted + 1, stats
    assert other["lines"][-1] == "data: [DONE]"
    finishes = [json.loads(ln[5:])["choices"][0]["finish_reason"] for ln in other["lines"][:-1]]
    assert [f for f in finishes if f] == ["length"]


def test_load_failure_exits_with_one_line(tmp_path: Path) -> None:
    proc = subprocess.run(serve_cmd(str(tmp_path / "missing"), free_port()),
                          check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("freetoken: error:")]
    assert len(errors) == 1 and "missing" in errors[0], proc.stderr


def test_sigterm_leaves_no_child(server: Server) -> None:
    """Last in the module: it stops the shared server."""
    children = psutil.Process(server.proc.pid).children(recursive=True)
    assert children, "the engine runs in a child process"
    os.kill(server.proc.pid, signal.SIGTERM)
    # uvicorn shuts down gracefully, then re-raises the signal it caught.
    assert server.proc.wait(timeout=30) in (0, -signal.SIGTERM)
    output = server.proc.communicate()[0]
    assert "Traceback" not in output, output
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, alive
