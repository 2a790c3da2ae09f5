"""The defects the schema fuzz found (issue 31), each reproduced against a real server:

1. an integer msgpack cannot carry (>= 2**64 or < -2**63), or nesting too deep, anywhere in
   a request field that goes to the engine was a 500 ``OverflowError``: now a 400 naming
   where it is (``engine.carry``);
2. constraints that leave no token (``min_tokens`` with a grammar that must end at once)
   were a 500 ``engine_error`` (every logit masked): now a 400 naming the fields;
3. a 405 lost its ``Allow`` header in the error handler;
4. schema-valid integers written ``5.0`` or ``1e2`` were refused as floats.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from server_fixtures import Server, post

from freetoken_core.engine.carry import INT_MAX, INT_MIN, check_carryable, uncarryable
from freetoken_core.errors import InvalidRequest
from freetoken_core.sampling_params import SamplingParams
from freetoken_plugins.structured_outputs.processor import StructuredOutputs

CHAT = [{"role": "user", "content": "hi"}]


def schema_with(value: Any) -> dict[str, Any]:
    return {"type": "object", "properties": {"n": {"type": "integer", "maximum": value}}}


def refused(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    # msgspec encodes nesting deeper than Python's json module recurses.
    r = server.http.post(path, content=msgspec.json.encode(body),
                         headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    return r.json()["error"]


@pytest.mark.parametrize("value", [INT_MAX + 1, INT_MIN - 1, 10**40, -(10**40)])
@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions",
     lambda v: {"messages": CHAT, "response_format": {
         "type": "json_schema", "json_schema": {"name": "a", "schema": schema_with(v)}}},
     "response_format.json_schema.schema.properties.n.maximum"),
    ("/v1/completions", lambda v: {"prompt": "x", "structured_outputs": {"json": schema_with(v)}},
     "structured_outputs.json.properties.n.maximum"),
    ("/v1/chat/completions",
     lambda v: {"messages": CHAT, "tools": [{"type": "function", "function": {
         "name": "f", "parameters": schema_with(v)}}], "tool_choice": "required"},
     "tools[0].function.parameters.properties.n.maximum"),
    ("/v1/chat/completions",
     lambda v: {"messages": CHAT, "structured_outputs": {"json": {"enum": [[1, v]]}}},
     "structured_outputs.json.enum[0][1]"),
])
def test_an_integer_the_engine_cannot_carry_is_a_400(plain_server: Server, value: int,
                                                     path: str, body: Any,
                                                     param: str) -> None:
    error = refused(plain_server, path, {**body(value), "max_tokens": 2})
    assert error["param"] == param, error
    assert "2**64" in error["message"]


def test_the_largest_carried_integers_still_work(plain_server: Server) -> None:
    schema = {"type": "object", "properties": {"n": {"enum": [INT_MAX, -(2**62)]}}}
    r = post(plain_server, "/v1/completions", {
        "prompt": "x", "max_tokens": 2, "structured_outputs": {"json": schema}})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("fields", "param"), [
    ({"json": {"enum": [INT_MIN + 1]}}, "structured_outputs.json"),
    ({"json": {"type": "object", "properties": {"n": {"const": INT_MIN}}}},
     "structured_outputs.json"),
    ({"grammar": 'start: %json {"enum": [-9223372036854775807]}'}, "structured_outputs.grammar"),
])
def test_integers_that_crash_llguidance_are_a_400(plain_server: Server, fields: dict[str, Any],
                                                  param: str) -> None:
    """llguidance 1.9 takes its process down (SIGSEGV) on these: the engine would restart
    and every request in flight fail with a 503."""
    error = refused(plain_server, "/v1/completions",
                    {"prompt": "x", "max_tokens": 2, "structured_outputs": fields})
    assert error["param"] == param and "llguidance" in error["message"], error
    assert plain_server.http.get("/health").status_code == 200


@pytest.mark.parametrize("depth", [300, 900])
def test_deep_nesting_in_an_engine_field_is_a_400(plain_server: Server, depth: int) -> None:
    deep: Any = 1
    for _ in range(depth):
        deep = [deep]
    error = refused(plain_server, "/v1/completions", {
        "prompt": "x", "max_tokens": 2, "structured_outputs": {"json": {"x-deep": deep}}})
    assert error["param"].startswith("structured_outputs.json"), error
    assert plain_server.http.get("/health").status_code == 200


def test_uncarryable_walks_any_depth_without_recursion() -> None:
    deep: Any = {"k": 2**70}
    for _ in range(5000):
        deep = {"k": deep}
    found = uncarryable(deep, "f")
    assert found is not None and found[0].startswith("f.k.k.k")
    assert uncarryable({"a": [1, -(2**63), 2**64 - 1, "x", None, 1.5]}, "f") is None
    assert uncarryable([True, 2**64], "g") == ("g[1]",
                                               "holds an integer outside [-2**63, 2**64)")


def test_check_carryable_names_a_validated_field() -> None:
    """The last guard, after validation: a plugin's typed fields that would not encode."""
    params = SamplingParams(max_tokens=4)
    params.fields = {"structured_outputs": StructuredOutputs.Fields(
        structured_outputs={"json": {"maximum": 2**64}})}
    with pytest.raises(InvalidRequest) as info:
        check_carryable(params)
    assert info.value.param == "structured_outputs.json.maximum"
    params.fields = {"structured_outputs": StructuredOutputs.Fields(
        structured_outputs={"json": {"maximum": 2**63}})}
    check_carryable(params)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fields", [
    {"structured_outputs": {"choice": [""]}},
    {"structured_outputs": {"regex": ""}},
])
def test_constraints_that_leave_no_token_are_a_400(plain_server: Server, stream: bool,
                                                   fields: dict[str, Any]) -> None:
    error = refused(plain_server, "/v1/completions", {
        "prompt": "0", "max_tokens": 1, "min_tokens": 1, "stream": stream, **fields})
    assert error["param"] == "min_tokens"
    assert "structured_outputs" in error["message"] and "min_tokens" in error["message"]
    assert "no token" in error["message"]
    # The server is fine afterwards, and the same grammar without min_tokens is served.
    r = post(plain_server, "/v1/completions", {"prompt": "0", "max_tokens": 1, **fields})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ""


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("GET", "/v1/completions", "POST"), ("DELETE", "/v1/models", "GET"),
    ("PUT", "/health", "GET"), ("GET", "/tokenize", "POST")])
def test_405_keeps_its_allow_header(plain_server: Server, method: str, path: str,
                                    allow: str) -> None:
    r = plain_server.http.request(method, path)
    assert r.status_code == 405
    assert allow in [m.strip() for m in r.headers["allow"].split(",")]
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_integral_numbers_are_integers_as_json_schema_says(plain_server: Server) -> None:
    """schemathesis writes integers as ``5.0`` or ``1e2`` (JSON Schema's ``integer``)."""
    r = post(plain_server, "/v1/completions",
             {"prompt": [5.0, 6], "max_tokens": 2.0, "n": 1e0, "seed": 1e18})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1
    error = refused(plain_server, "/v1/completions", {"prompt": "x", "max_tokens": 2.5})
    assert error["param"] == "max_tokens"
    error = refused(plain_server, "/v1/completions", {"prompt": "x", "seed": 1e30})
    assert error["param"] == "seed"
