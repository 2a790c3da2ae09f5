"""End to end on a real ``freetoken serve`` (tiny model): logprobs in both shapes, echo,
the chat template controls, ``request_id`` and ``max_completion_tokens``.
(``/version``, ``/metrics`` and ``--api-key`` are in ``test_server_ops.py``.)"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from server_fixtures import Server
from server_fixtures import events as _events
from server_fixtures import ok as _ok
from server_fixtures import post as _post

from freetoken_core.server.protocol import ChatMessage
from freetoken_core.server.serving import render_chat
from freetoken_core.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def server(plain_server: Server) -> Server:
    return plain_server  # conftest.py: one server for the modules that need no flags


GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
USER = [{"role": "user", "content": "Tell me a story"}]





def _bad(server: Server, path: str, body: dict, param: str) -> str:
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    return error["message"]


# -- logprobs ---------------------------------------------------------------------------


def test_completion_logprobs_shape_and_greedy_consistency(server: Server) -> None:
    out = _ok(server, "/v1/completions", {"prompt": "The quick brown", "logprobs": 3, **GREEDY})
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 8
    offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(8)]
    assert lp["text_offset"] == offsets
    assert "".join(lp["tokens"]) == choice["text"]
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert value <= 0 and 3 <= len(top) <= 4 and top[token] == value
        # Greedy with no processor active: the sampled token is the most likely one.
        assert math.isclose(value, max(top.values()), abs_tol=1e-5)
    sdk = server.client.completions.create(model=server.model, prompt="The quick brown",
                                           logprobs=3, temperature=0, max_tokens=8,
                                           extra_body={"ignore_eos": True})
    assert sdk.choices[0].logprobs.tokens == lp["tokens"]
    assert sdk.choices[0].logprobs.token_logprobs == pytest.approx(lp["token_logprobs"])
    zero = _ok(server, "/v1/completions", {"prompt": "The quick brown", "logprobs": 0,
                                           **GREEDY})["choices"][0]["logprobs"]
    assert [list(t) for t in zero["top_logprobs"]] == [[t] for t in lp["tokens"]]
    plain = _ok(server, "/v1/completions", {"prompt": "The quick brown", **GREEDY})
    assert plain["choices"][0]["logprobs"] is None


def test_completion_logprobs_streamed_equal_non_streamed(server: Server) -> None:
    body = {"prompt": "A language model", "logprobs": 2, "n": 2, "seed": 3,
            "temperature": 1.0, "max_tokens": 7, "ignore_eos": True}
    full = _ok(server, "/v1/completions", body)["choices"]
    merged = {i: {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
              for i in (0, 1)}
    for event in _events(server, "/v1/completions", body):
        for choice in event["choices"]:
            if choice["logprobs"] is not None:
                for key, values in choice["logprobs"].items():
                    merged[choice["index"]][key] += values
    for choice in full:
        assert merged[choice["index"]] == choice["logprobs"]
        assert len(choice["logprobs"]["tokens"]) == 7


def test_chat_logprobs_shape_streamed_and_not(server: Server) -> None:
    body = {"messages": USER, "logprobs": True, "top_logprobs": 2, **GREEDY}
    out = _ok(server, "/v1/chat/completions", body)
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"] == 8
    assert "".join(c["token"] for c in content) == out["choices"][0]["message"]["content"]
    for entry in content:
        assert entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy
        assert math.isclose(entry["top_logprobs"][0]["logprob"], entry["logprob"], abs_tol=1e-5)
        assert all(t["bytes"] == list(t["token"].encode()) for t in entry["top_logprobs"])
    streamed = [entry for event in _events(server, "/v1/chat/completions", body)
                for choice in event["choices"] if choice["logprobs"]
                for entry in choice["logprobs"]["content"]]
    assert streamed == content
    sdk = server.client.chat.completions.create(
        model=server.model, messages=USER, logprobs=True, temperature=0, max_tokens=8,
        extra_body={"ignore_eos": True})
    entries = sdk.choices[0].logprobs.content
    assert [e.token for e in entries] == [c["token"] for c in content]
    assert all(e.top_logprobs == [] for e in entries)
    plain = _ok(server, "/v1/chat/completions", {"messages": USER, **GREEDY})
    assert plain["choices"][0]["logprobs"] is None


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": USER, "logprobs": False, "top_logprobs": 1},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": USER, "logprobs": 3}, "logprobs"),
    ("/v1/chat/completions", {"messages": USER, "add_generation_prompt": True,
                              "continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {"messages": USER, "add_generation_prompt": False,
                              "continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"tokenize": True}},
     "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": [1]},
     "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": USER, "request_id": ""}, "request_id"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 3,
                              "max_completion_tokens": 4}, "max_completion_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 3, "max_completion_tokens": 4},
     "max_completion_tokens"),
])
def test_invalid_extras_are_400_naming_the_field(server: Server, path: str, body: dict,
                                                 param: str) -> None:
    _bad(server, path, body, param)


# -- echo -------------------------------------------------------------------------------


def test_echo_leads_the_text_streamed_and_not(server: Server) -> None:
    body = {"prompt": "Once upon a time", **GREEDY}
    plain = _ok(server, "/v1/completions", body)
    echoed = _ok(server, "/v1/completions", {**body, "echo": True})
    assert echoed["choices"][0]["text"] == "Once upon a time" + plain["choices"][0]["text"]
    assert echoed["usage"] == plain["usage"]
    events = _events(server, "/v1/completions", {**body, "echo": True})
    assert events[0]["choices"][0]["text"] == "Once upon a time"
    assert "".join(c["text"] for e in events for c in e["choices"]) == \
        echoed["choices"][0]["text"]
    sdk = server.client.completions.create(model=server.model, prompt="Once upon a time",
                                           echo=True, temperature=0, max_tokens=8,
                                           extra_body={"ignore_eos": True})
    assert sdk.choices[0].text == echoed["choices"][0]["text"]


def test_echo_of_token_prompts_and_n(server: Server) -> None:
    ids = _ok(server, "/tokenize", {"prompt": "Hello world"})["tokens"]
    out = _ok(server, "/v1/completions", {"prompt": [ids, ids[:1]], "echo": True, "n": 2,
                                          **GREEDY})
    texts = {c["index"]: c["text"] for c in out["choices"]}
    first = _ok(server, "/detokenize", {"tokens": ids[:1]})["prompt"]
    assert all(texts[i].startswith("Hello world") for i in (0, 1))
    assert all(texts[i].startswith(first) for i in (2, 3)) and len(texts) == 4


# -- chat template controls, request_id, max_completion_tokens -------------------------


def test_add_generation_prompt_false_changes_the_prompt(server: Server) -> None:
    with_prompt = _ok(server, "/v1/chat/completions", {"messages": USER, **GREEDY})
    without = _ok(server, "/v1/chat/completions",
                  {"messages": USER, "add_generation_prompt": False, **GREEDY})
    count = _ok(server, "/tokenize", {"messages": USER, "add_generation_prompt": False})["count"]
    assert without["usage"]["prompt_tokens"] == count < with_prompt["usage"]["prompt_tokens"]


def test_continue_final_message_continues_the_assistant(server: Server) -> None:
    messages = [*USER, {"role": "assistant", "content": "Once upon"}]
    body = {"messages": messages, "add_generation_prompt": False,
            "continue_final_message": True}
    tokens = _ok(server, "/tokenize", body)["tokens"]
    assert _ok(server, "/detokenize", {"tokens": tokens})["prompt"].endswith("Once upon")
    out = server.client.chat.completions.create(
        model=server.model, messages=messages, temperature=0, max_tokens=4,
        extra_body={"add_generation_prompt": False, "continue_final_message": True,
                    "ignore_eos": True})
    assert out.usage.prompt_tokens == len(tokens)
    closed = _ok(server, "/tokenize", {"messages": messages,
                                       "add_generation_prompt": False})["count"]
    assert closed > len(tokens)  # the end-of-turn marker is left off


def test_chat_template_kwargs_reach_the_template(server: Server, tiny_model_dir: Path) -> None:
    r = _post(server, "/v1/chat/completions",
              {"messages": USER, "chat_template_kwargs": {"enable_thinking": False}, **GREEDY})
    assert r.status_code == 200, r.text

    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.chat_template = "{{ greeting }}:{% for m in messages %}{{ m.content }}{% endfor %}"
    text = render_chat(tokenizer, [ChatMessage("user", "hi")], add_generation_prompt=True,
                       chat_template_kwargs={"greeting": "hello"})
    assert text == "hello:hi"


def test_request_id_is_the_response_id(server: Server) -> None:
    out = server.client.chat.completions.create(
        model=server.model, messages=USER, max_tokens=3, extra_body={"request_id": "abc-1"})
    assert out.id == "abc-1"
    events = _events(server, "/v1/chat/completions",
                     {"messages": USER, "max_tokens": 3, "request_id": "abc-2"})
    assert {e["id"] for e in events} == {"abc-2"}
    # Two live requests with one request_id do not collide in the engine.
    again = _ok(server, "/v1/chat/completions",
                {"messages": USER, "request_id": "abc-1", **GREEDY})
    assert again["id"] == "abc-1" and again["usage"]["completion_tokens"] == 8


def test_max_completion_tokens_alias(server: Server) -> None:
    for path, body in (("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/chat/completions", {"messages": USER})):
        out = _ok(server, path, {**body, "temperature": 0, "ignore_eos": True,
                                 "max_completion_tokens": 5})
        assert out["usage"]["completion_tokens"] == 5
        same = _ok(server, path, {**body, "temperature": 0, "ignore_eos": True,
                                  "max_tokens": 4, "max_completion_tokens": 4})
        assert same["usage"]["completion_tokens"] == 4
