"""Hostile request bodies against a real ``freetoken serve``: every one is a 400 in the
OpenAI error shape naming the field (never a 500, never a dead engine), and the extreme
ends of every accepted range generate normally."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from server_fixtures import Server, ok, post

from freetoken_core.sampling_params import GREEDY_TEMPERATURE, INT64_MAX, INT64_MIN
from freetoken_plugins.logit_bias import MAX_ENTRIES
from freetoken_plugins.penalties import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY
from freetoken_plugins.stop_tokens import MAX_STOP_TOKEN_IDS


@pytest.fixture(scope="module")
def server(plain_server: Server) -> Server:
    return plain_server  # conftest.py: one server for the modules that need no flags


@pytest.fixture(scope="module")
def vocab_size(tiny_model_dir: Path) -> int:
    return json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def max_model_len(server: Server) -> int:
    return server.http.get(f"/v1/models/{server.model}").json()["max_model_len"]


COMPLETION = {"prompt": "hi", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def send(server: Server, path: str, body: dict | bytes) -> httpx.Response:
    """POST ``body``: a dict as JSON (Python's encoder writes any integer in full), bytes as
    they are."""
    if isinstance(body, bytes):
        return server.http.post(path, content=body, headers={"content-type": "application/json"})
    return server.http.post(path, content=json.dumps(body).encode(),
                            headers={"content-type": "application/json"})


def assert_error(r: httpx.Response, param: str | None, code: str | None = None) -> dict:
    """A 400 with OpenAI's error body naming ``param``; returns the ``error`` object."""
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error"
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] == param, error
    assert error["code"] == code, error
    return error


def assert_alive(server: Server) -> None:
    """The engine survived: /health is 200 and a normal request generates."""
    assert server.http.get("/health").status_code == 200
    body = ok(server, "/v1/completions", {**COMPLETION, "temperature": 0, "ignore_eos": True})
    assert body["usage"]["completion_tokens"] == 2


def deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


HOSTILE = [
    # integers the engine cannot represent
    ("top_k", {"top_k": 2**63}),
    ("top_k", {"top_k": 10**400}),
    ("seed", {"seed": 2**64}),
    ("seed", {"seed": 2**63}),
    ("seed", {"seed": -(2**63) - 1}),
    ("n", {"n": 10**400}),
    ("logprobs", {"logprobs": 10**400}),
    # floats: out of range, or an integer literal no float holds
    ("temperature", {"temperature": 10**400}),
    ("top_p", {"top_p": 10**400}),
    ("min_p", {"min_p": 10**400}),
    ("presence_penalty", {"presence_penalty": 10**400}),
    ("frequency_penalty", {"frequency_penalty": -(10**400)}),
    ("repetition_penalty", {"repetition_penalty": 1e-39}),
    ("repetition_penalty", {"repetition_penalty": 10**400}),
    ("repetition_penalty", {"repetition_penalty": MAX_REPETITION_PENALTY * 2}),
    # plugin ids and counts
    ("logit_bias", {"logit_bias": {str(2**63): 1}}),
    ("logit_bias", {"logit_bias": {str(i): 1 for i in range(MAX_ENTRIES + 1)}}),
    ("stop_token_ids", {"stop_token_ids": [2**64]}),
    ("stop_token_ids", {"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}),
    ("min_tokens", {"min_tokens": 10**400}),  # more than max_tokens
]


@pytest.mark.parametrize(("param", "fields"), HOSTILE,
                         ids=[f"{p}-{i}" for i, (p, _) in enumerate(HOSTILE)])
def test_hostile_field_is_a_400_naming_it(server: Server, param: str, fields: dict) -> None:
    for path, base in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        if path.endswith("chat/completions") and param == "logprobs":
            continue  # a completions field (chat's logprobs is a bool)
        assert_error(send(server, path, {**base, **fields}), param)
    assert_alive(server)


def test_top_k_above_the_vocabulary_is_refused(server: Server, vocab_size: int) -> None:
    error = assert_error(send(server, "/v1/completions", {**COMPLETION, "top_k": vocab_size + 1}),
                         "top_k")
    assert str(vocab_size) in error["message"]
    assert_error(send(server, "/v1/completions",
                      {**COMPLETION, "logit_bias": {str(vocab_size): 1}}), "logit_bias")
    assert_error(send(server, "/v1/completions",
                      {**COMPLETION, "stop_token_ids": [vocab_size]}), "stop_token_ids")
    assert_alive(server)


@pytest.mark.parametrize("literal", [b"1e400", b"-1e400", b"1" + b"0" * 5000])
def test_number_the_decoder_cannot_take_is_a_400_naming_its_field(server: Server,
                                                                  literal: bytes) -> None:
    body = b'{"prompt": "hi", "max_tokens": 2, "temperature": ' + literal + b"}"
    assert_error(send(server, "/v1/completions", body), "temperature")
    body = b'{"prompt": "hi", "max_tokens": 2, "min_p": ' + literal + b"}"
    assert_error(send(server, "/v1/completions", body), "min_p")
    assert_alive(server)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize",
                                  "/detokenize"])
def test_json_nested_2000_deep_is_a_400(server: Server, path: str) -> None:
    body = b'{"prompt": "hi", "messages": [], "tokens": [], "x": ' + deep(2000) + b"}"
    error = assert_error(send(server, path, body), None)
    assert "nested too deeply" in error["message"]
    r = send(server, path, deep(100_000))
    assert_error(r, None)
    assert_alive(server)


def test_deep_chat_template_kwargs_is_never_a_500(server: Server) -> None:
    """Nested just under the decoder's limit, it reaches the template machinery."""
    for depth in (200, 500, 900):
        body = (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
                b'"chat_template_kwargs": {"x": ' + deep(depth) + b"}}")
        r = send(server, "/v1/chat/completions", body)
        assert r.status_code in (200, 400), r.text
        if r.status_code == 400:
            assert r.json()["error"]["param"] in ("chat_template_kwargs", None)
    assert_alive(server)


@pytest.mark.parametrize("key", ["tools", "documents", "functions", "tool_choice",
                                 "chat_template", "tokenize", "eos_token", "raise_exception"])
def test_reserved_chat_template_kwargs_are_a_400_naming_the_key(server: Server,
                                                                key: str) -> None:
    kwargs = {key: [{"type": "function", "function": {"name": "get_weather"}}]}
    for path, base in (("/v1/chat/completions", CHAT),
                       ("/tokenize", {"messages": CHAT["messages"]})):
        error = assert_error(send(server, path, {**base, "chat_template_kwargs": kwargs}),
                             "chat_template_kwargs")
        assert key in error["message"]
    # An ordinary template variable is still accepted.
    ok(server, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"enable_thinking": 1}})


def test_prompt_over_the_context_is_context_length_exceeded(server: Server,
                                                            max_model_len: int) -> None:
    long_ids = [5] * max_model_len
    assert_error(send(server, "/v1/completions", {"prompt": long_ids, "max_tokens": 1}),
                 "prompt", "context_length_exceeded")
    assert_error(send(server, "/v1/completions",
                      {"prompt": long_ids, "max_tokens": 1, "stream": True}),
                 "prompt", "context_length_exceeded")
    long_text = "hi " * (max_model_len + 10)
    assert_error(send(server, "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": long_text}]}),
                 "messages", "context_length_exceeded")
    assert_error(send(server, "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": long_text}], "stream": True}),
                 "messages", "context_length_exceeded")
    for max_tokens in (max_model_len, 10**400):
        assert_error(send(server, "/v1/completions", {"prompt": "hi", "max_tokens": max_tokens}),
                     "max_tokens", "context_length_exceeded")
    assert_error(send(server, "/v1/chat/completions", {**CHAT, "max_tokens": max_model_len}),
                 "max_tokens", "context_length_exceeded")
    assert_alive(server)


def test_other_validation_errors_keep_code_null(server: Server) -> None:
    assert_error(send(server, "/v1/completions", {**COMPLETION, "top_k": 0}), "top_k", None)


def test_temperature_below_the_epsilon_is_greedy(server: Server) -> None:
    """1e-50 used to become 0.0 in float32 and be sampled at T = 1."""
    greedy = {"prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": True}
    expected = ok(server, "/v1/completions", {**greedy, "temperature": 0})["choices"][0]["text"]
    for temperature, seed in ((1e-50, 1), (5e-324, 2), (GREEDY_TEMPERATURE / 2, 3)):
        body = ok(server, "/v1/completions", {**greedy, "temperature": temperature, "seed": seed})
        assert body["choices"][0]["text"] == expected, temperature


def test_extreme_valid_values_generate(server: Server, vocab_size: int) -> None:
    """The ends of every accepted range: 200, the full max_tokens, and the engine lives."""
    biased = range(min(MAX_ENTRIES, vocab_size))
    extremes = [
        {"temperature": GREEDY_TEMPERATURE, "repetition_penalty": MIN_REPETITION_PENALTY,
         "presence_penalty": -2, "frequency_penalty": -2, "min_p": 5e-324, "seed": INT64_MIN,
         "top_p": 5e-324, "logit_bias": {str(t): 100 for t in biased}},
        {"temperature": 2, "repetition_penalty": MAX_REPETITION_PENALTY, "presence_penalty": 2,
         "frequency_penalty": 2, "min_p": 1, "seed": INT64_MAX, "top_k": vocab_size,
         "logit_bias": {str(t): -100 for t in biased}},
        {"temperature": 1e-50, "top_k": 1, "seed": -1, "logit_bias": {"5": 10**400}},
        {"temperature": 1, "min_tokens": 4, "stop_token_ids": [3, 4], "logprobs": 5},
    ]
    for fields in extremes:
        body = ok(server, "/v1/completions",
                  {"prompt": "hello", "max_tokens": 4, "ignore_eos": True, **fields})
        choice = body["choices"][0]
        assert choice["finish_reason"] == "length", (fields, body)
        assert body["usage"]["completion_tokens"] == 4
    assert_alive(server)


def test_unknown_route_body_shapes_still_answer(server: Server) -> None:
    """Non-object bodies are a 400 too (not a decoder crash)."""
    for body in (b"[]", b"1e400", b"null", b'"x"'):
        assert_error(send(server, "/v1/completions", body), None)
    r = post(server, "/v1/completions", COMPLETION)
    assert r.status_code == 200
