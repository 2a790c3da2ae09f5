"""``freetoken serve`` with no ``--model`` serves the embedded default model, and the official
``openai`` client gets real answers from it: greedy chat is sensible, streaming changes
nothing, and ``usage.prompt_tokens`` is what ``/tokenize`` counts for the same messages.
Forced tool calls and ``json_schema`` answers, with schemas as agent frameworks send them
(no ``additionalProperties``), hold exactly the declared keys and finish (issue 31)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_fixtures import START_TIMEOUT_S, Server, free_port, stop_server

from freetoken_core.affinity import plan_cpus

MODEL_NAME = "default"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 32
WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}
TIME: dict[str, Any] = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}},
                   "required": ["timezone"]}}}
PERSON: dict[str, Any] = {  # as pydantic (instructor) writes a model's schema
    "title": "Person", "type": "object",
    "properties": {"name": {"title": "Name", "type": "string"},
                   "age": {"title": "Age", "type": "integer"}},
    "required": ["name", "age"]}


def start_default_server() -> Server:
    """``freetoken serve`` without ``--model``; waits until ``/health`` is 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "freetoken_core.cli", "serve", "--port", str(port),
           "--kv-cache-tokens", "8192", "--log-level", "warning",
           "--served-model-name", MODEL_NAME]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    srv = Server(proc, port, MODEL_NAME)
    deadline = time.monotonic() + START_TIMEOUT_S
    status = None
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            status = srv.http.get("/health").status_code
        except httpx.TransportError:
            status = None
        if status == 200:
            return srv
        time.sleep(0.25)
    proc.kill()
    output = proc.communicate()[0]
    pytest.fail(f"freetoken serve (default model) did not become healthy within "
                f"{START_TIMEOUT_S} s (last status {status}); its output:\n{output}")


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = start_default_server()
    try:
        yield srv
    finally:
        stop_server(srv)


def _chat(server: Server, **kwargs):
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    return server.client.chat.completions.create(
        model=server.model, messages=MESSAGES, temperature=0, **kwargs)


def test_greedy_chat_answers_paris_streamed_equal_non_streamed(server: Server) -> None:
    full = _chat(server)
    text = full.choices[0].message.content
    assert "Paris" in text
    assert full.choices[0].finish_reason in ("stop", "length")

    pieces, finishes = [], []
    for chunk in _chat(server, stream=True):
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
    assert "".join(pieces) == text
    assert finishes == [full.choices[0].finish_reason]


def test_prompt_tokens_equal_tokenize_count(server: Server) -> None:
    full = _chat(server, max_tokens=1)
    r = server.http.post("/tokenize", json={"model": server.model, "messages": MESSAGES})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) == full.usage.prompt_tokens
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens


def _cpus_of_threads(pid: int) -> dict[int, set[int]]:
    return {int(tid): os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.skipif(plan_cpus() is None, reason="pinning needs Linux and at least two CPUs")
def test_serve_pins_the_engine_main_thread_alone(server: Server) -> None:
    """``--pin-threads`` (the default): the engine's main thread on the lowest CPU, its other
    threads and every thread of the HTTP process on the rest."""
    plan = plan_cpus()
    assert plan is not None
    server_pid = server.proc.pid
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    engines = [int(p) for p in children
               if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(engines) == 1, children
    engine = _cpus_of_threads(engines[0])
    assert engine.pop(engines[0]) == {plan.main}
    assert engine and all(cpus == plan.shared for cpus in engine.values()), engine
    assert all(cpus == plan.shared for cpus in _cpus_of_threads(server_pid).values())


def _declared(arguments: str, schema: dict[str, Any]) -> dict[str, Any]:
    """``arguments`` parsed; its keys must be declared and include the required ones."""
    value = json.loads(arguments)
    assert set(value) <= set(schema["properties"]), (value, schema)
    assert set(schema["required"]) <= set(value), (value, schema)
    return value


WEATHER_QUESTION = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.mark.parametrize("tool_choice", [
    {"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_forced_tool_calls_hold_only_the_declared_keys(server: Server,
                                                       tool_choice: Any) -> None:
    out = server.client.chat.completions.create(
        model=server.model, messages=WEATHER_QUESTION, tools=[WEATHER, TIME],
        tool_choice=tool_choice, parallel_tool_calls=False, temperature=0, max_tokens=200)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    tools = {"get_weather": WEATHER, "get_time": TIME}
    assert call.function.name in tools
    _declared(call.function.arguments, tools[call.function.name]["function"]["parameters"])


def test_forced_tool_call_streamed_finishes_with_tool_calls(server: Server) -> None:
    arguments, finishes = "", []
    for chunk in server.client.chat.completions.create(
            model=server.model, messages=WEATHER_QUESTION, tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            temperature=0, max_tokens=200, stream=True):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                arguments += call.function.arguments or ""
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
    assert finishes == ["tool_calls"]
    _declared(arguments, WEATHER["function"]["parameters"])


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_answer_holds_only_the_declared_keys(server: Server, stream: bool) -> None:
    body = {"model": server.model, "temperature": 0, "max_tokens": 200,
            "messages": [{"role": "user", "content": "Describe a person as JSON."}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "Person", "schema": PERSON}}}
    if stream:
        pieces, finishes = [], []
        for chunk in server.client.chat.completions.create(**body, stream=True):
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
                if choice.finish_reason is not None:
                    finishes.append(choice.finish_reason)
        text, finish = "".join(pieces), finishes[-1]
    else:
        choice = server.client.chat.completions.create(**body).choices[0]
        text, finish = choice.message.content, choice.finish_reason
    assert finish == "stop", text
    _declared(text, PERSON)


def test_disable_additional_properties_is_accepted(server: Server) -> None:
    """vLLM's per-request switch (``false`` reads the schema literally): a 200."""
    for value in (True, False):
        r = server.http.post("/v1/chat/completions", json={
            "model": server.model, "messages": MESSAGES, "max_tokens": 8,
            "structured_outputs": {"json": PERSON, "disable_additional_properties": value}})
        assert r.status_code == 200, r.text
