"""The reasoning plugin: the ``<think>`` splitter and counter against plain references, where
an answer starts (``freetoken_answer_start``), and chat end to end on a real ``freetoken serve`` (tiny model: ``<think>`` 640, ``</think>``
641), streamed and not, checked against the raw text of the same prompt on completions."""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import pytest
from server_fixtures import Server
from server_fixtures import events as _events
from server_fixtures import ok as _ok

from freetoken_core import SamplingParams
from freetoken_core.models.resolve import resolve_model
from freetoken_core.plugins import PluginManager
from freetoken_core.processors import AnswerStart, RequestView
from freetoken_core.tokenizer import load_tokenizer
from freetoken_plugins.reasoning import (
    Reasoning,
    ThinkSplitter,
    count_reasoning_tokens,
    prompt_leaves_open,
    split,
)

OPEN, CLOSE = 640, 641


@pytest.fixture(scope="module")
def server(plain_server: Server) -> Server:
    return plain_server  # conftest.py: one server for the modules that need no flags


# -- the splitter and the counter ------------------------------------------------------


@pytest.mark.parametrize(("text", "in_reasoning", "expected"), [
    ("plain answer", False, (None, "plain answer")),
    ("<think>hmm</think>\n\nyes", False, ("hmm", "\n\nyes")),
    ("a<think>b</think>c<think>d</think>", False, ("b", "ac<think>d</think>")),
    ("<think>never closed", False, ("never closed", "")),
    ("hmm</think>yes", True, ("hmm", "yes")),
    ("</think>yes", False, (None, "</think>yes")),
    ("all reasoning <th", True, ("all reasoning <th", "")),
    ("", True, ("", "")),
])
def test_split(text: str, in_reasoning: bool, expected: tuple) -> None:
    assert split(text, in_reasoning) == expected


@pytest.mark.parametrize("seed", range(40))
def test_streamed_pieces_split_like_the_whole(seed: int) -> None:
    rng = random.Random(seed)
    words = ["<think>", "</think>", "<", "</", "<th", "think", ">", "a", " b", "\n", "</thi"]
    text = "".join(rng.choice(words) for _ in range(rng.randint(0, 20)))
    in_reasoning = rng.random() < 0.3
    splitter = ThinkSplitter(in_reasoning)
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 8))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    reasoning, content = "", ""
    for i, piece in enumerate(pieces):
        r, c = splitter.feed(piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    if not pieces:
        reasoning, content = splitter.feed("", final=True)
    whole = split(text, in_reasoning)
    assert (reasoning if splitter.has_reasoned else None, content) == whole


@pytest.mark.parametrize(("ids", "in_reasoning", "expected"), [
    ([5, 6, 7], False, 0),
    ([OPEN, 5, 6, CLOSE, 7], False, 4),
    ([8, OPEN, 5, CLOSE, 7], False, 4),
    ([OPEN, 5, 6], False, 3),
    ([5, CLOSE, 7, CLOSE], True, 2),
    ([5, 6], True, 2),
    ([CLOSE, OPEN, 5], False, 3),   # a stray </think> before the block does not close it
])
def test_count_reasoning_tokens(ids: list[int], in_reasoning: bool, expected: int) -> None:
    assert count_reasoning_tokens(ids, OPEN, CLOSE, in_reasoning) == expected


@pytest.mark.parametrize(("prompt", "expected"), [
    ([5, 6], False),
    ([5, OPEN], True),
    ([OPEN, 5, CLOSE, 6], False),
    ([OPEN, CLOSE, OPEN, 7], True),
    ([CLOSE, 5], False),
])
def test_prompt_leaves_open(prompt: list[int], expected: bool) -> None:
    assert prompt_leaves_open(prompt, OPEN, CLOSE) is expected


# -- where the answer starts -------------------------------------------------------------


def _view(prompt: list[int], is_chat: bool) -> RequestView:
    return RequestView("r", 0, None, SamplingParams(), prompt, (), is_chat)


def test_answer_start_of_chat_sequences(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    hook = PluginManager(plugins="reasoning").hook.freetoken_answer_start
    assert hook(request=_view([5, 6], True), tokenizer=tokenizer) == AnswerStart(
        CLOSE, False, OPEN)
    assert hook(request=_view([5, OPEN], True), tokenizer=tokenizer) == AnswerStart(
        CLOSE, True, OPEN)
    assert hook(request=_view([5, OPEN], False), tokenizer=tokenizer) is None  # completions
    # The split is a switch: the plugin's one request field is reasoning_effort.
    assert [f.name for f in msgspec.structs.fields(Reasoning.Fields)] == ["reasoning_effort"]


def test_no_answer_start_without_think_tokens() -> None:
    tokenizer = load_tokenizer(resolve_model(None, progress=False))  # SmolLM2: no <think>
    assert Reasoning.freetoken_answer_start(_view([5, 6], True), tokenizer) is None


# -- end to end ------------------------------------------------------------------------





USER = [{"role": "user", "content": "Tell me a story"}]
OPENED = [*USER, {"role": "assistant", "content": "<think>"}]
CASES = {
    "no tags": (USER, {}),
    "think forced": (USER, {str(OPEN): 100}),
    "prompt opened, close forced": (OPENED, {str(CLOSE): 100}),
    "prompt opened, free": (OPENED, {}),
    "prompt opened, close biased +8": (OPENED, {str(CLOSE): 8}),
}


@pytest.mark.parametrize(("messages", "bias"), CASES.values(), ids=CASES.keys())
def test_chat_splits_like_the_raw_text(server: Server, messages: list, bias: dict) -> None:
    opened = messages is OPENED
    template = {"continue_final_message": True, "add_generation_prompt": False} if opened else {}
    greedy = {"temperature": 0, "max_tokens": 6, "ignore_eos": True, "logit_bias": bias}
    prompt = _ok(server, "/tokenize", {"messages": messages, **template})["tokens"]
    raw = _ok(server, "/v1/completions", {"prompt": prompt, "logprobs": 0, **greedy})
    raw_text = raw["choices"][0]["text"]
    raw_tokens = raw["choices"][0]["logprobs"]["tokens"]
    reasoning, content = split(raw_text, opened)
    num_reasoning = count_reasoning_tokens(raw_tokens, "<think>", "</think>", opened)

    body = {"messages": messages, **template, **greedy}
    got = _ok(server, "/v1/chat/completions", body)
    message = got["choices"][0]["message"]
    assert message["content"] == content
    assert message.get("reasoning_content") == reasoning
    assert got["usage"]["completion_tokens_details"]["reasoning_tokens"] == num_reasoning

    events = _events(server, "/v1/chat/completions",
                     {**body, "stream_options": {"include_usage": True}})
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == content
    streamed_reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    assert streamed_reasoning == (reasoning or "")
    if reasoning is None:
        assert not any("reasoning_content" in d for d in deltas)
    usage = events[-1]["usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == num_reasoning


def test_forced_cases_mean_what_they_say(server: Server) -> None:
    greedy = {"temperature": 0, "max_tokens": 4, "ignore_eos": True}
    closed = _ok(server, "/v1/chat/completions", {
        "messages": OPENED, "continue_final_message": True, "add_generation_prompt": False,
        "logit_bias": {str(CLOSE): 100}, **greedy})
    assert closed["choices"][0]["message"] == {
        "role": "assistant", "content": "</think>" * 3, "reasoning_content": ""}
    assert closed["usage"]["completion_tokens_details"]["reasoning_tokens"] == 1
    opened = _ok(server, "/v1/chat/completions", {
        "messages": USER, "logit_bias": {str(OPEN): 100}, **greedy})
    assert opened["choices"][0]["message"]["reasoning_content"] == "<think>" * 3
    assert opened["choices"][0]["message"]["content"] == ""
    assert opened["usage"]["completion_tokens_details"]["reasoning_tokens"] == 4


def test_completions_are_not_split(server: Server) -> None:
    got = _ok(server, "/v1/completions", {"prompt": "Hi", "temperature": 0, "max_tokens": 3,
                                          "logit_bias": {str(OPEN): 100}})
    assert got["choices"][0]["text"] == "<think>" * 3
    assert "completion_tokens_details" not in got["usage"]
