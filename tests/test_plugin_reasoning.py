"""The reasoning plugin: the ``<think>`` splitter and counter against plain references, where
an answer starts (``freetoken_answer_start``), and chat end to end on a real ``freetoken serve`` (tiny model: ``<think>`` 640, ``</think>``
641), streamed and not, checked against the raw text of the same prompt on completions.
Then history: an earlier answer's ``reasoning_content`` (or ``reasoning``) sent back on an
assistant message, rendered by small test templates that read it as Qwen3's and gpt-oss's
do, its 400s, and a round trip through the server and the official client
(``tests/test_harmony.py`` has the gpt-oss one)."""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import pytest
from server_fixtures import Server
from server_fixtures import events as _events
from server_fixtures import ok as _ok

from freetoken_core import InvalidRequest, ModelInfo, SamplingParams
from freetoken_core.models.resolve import resolve_model
from freetoken_core.plugins import PluginManager
from freetoken_core.processors import AnswerStart, RequestView
from freetoken_core.server import protocol as p
from freetoken_core.server.serving import parse_body, render_chat
from freetoken_core.tokenizer import load_tokenizer
from freetoken_plugins.reasoning import (
    Reasoning,
    ThinkSplitter,
    count_reasoning_tokens,
    hand_history,
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


# -- history: an earlier answer's reasoning sent back ------------------------------------

QWEN3_TEMPLATE = (  # reads it as Qwen3's does (which does so after the last user message)
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and m.reasoning_content is string %}"
    "<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
THINKING_TEMPLATE = (  # reads it as gpt-oss's does: the message's thinking
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if 'thinking' in m and m.thinking %}[analysis: {{ m.thinking }}]{% endif %}"
    "{% if m.reasoning_content is defined %}[reasoning_content read]{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}")
THOUGHT = "the user greets me"
MODEL = ModelInfo(vocab_size=642, eos_token_ids=frozenset({2}), max_model_len=2048)


def _history(**reasoning: object) -> list[dict]:
    return [*USER, {"role": "assistant", "content": "Hello.", **reasoning},
            {"role": "user", "content": "And then?"}]


def _render(tiny_model_dir: Path, template: str | None, messages: list[dict],
            plugins: str = "reasoning,tool_calls", **extra: object) -> str:
    """The prompt as the chat route renders it (the body decoded and checked as the server
    does), with ``template`` as the model's chat template (``None``: the tiny model's
    ChatML, which reads no reasoning)."""
    manager = PluginManager(plugins)
    request, rest, extras = parse_body(msgspec.json.encode({"messages": messages, **extra}),
                                       p.ChatCompletionRequest)
    params = SamplingParams(**rest)
    manager.validate(params, MODEL, "chat")
    return render_chat(load_tokenizer(tiny_model_dir, template), request.messages,
                       add_generation_prompt=True, plugins=manager, params=params,
                       extras=extras)


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning"])
def test_history_reaches_a_template_that_reads_reasoning_content(tiny_model_dir: Path,
                                                                 key: str) -> None:
    text = _render(tiny_model_dir, QWEN3_TEMPLATE, _history(**{key: THOUGHT}))
    assert f"<|im_start|>assistant\n<think>\n{THOUGHT}\n</think>\n\nHello.<|im_end|>" in text
    # vLLM's responses carry both names with the same text: that is one reasoning.
    both = _render(tiny_model_dir, QWEN3_TEMPLATE,
                   _history(reasoning_content=THOUGHT, reasoning=THOUGHT))
    assert both == text


def test_history_reaches_a_template_that_reads_thinking(tiny_model_dir: Path) -> None:
    text = _render(tiny_model_dir, THINKING_TEMPLATE, _history(reasoning_content=THOUGHT))
    assert f"<|im_start|>assistant\n[analysis: {THOUGHT}][reasoning_content read]Hello." in text
    assert text.count("[analysis:") == 1 and text.count("[reasoning_content read]") == 1


def test_history_is_accepted_where_the_template_reads_none(tiny_model_dir: Path) -> None:
    plain = _render(tiny_model_dir, None, _history())
    assert _render(tiny_model_dir, None, _history(reasoning_content=THOUGHT)) == plain
    for template in (None, QWEN3_TEMPLATE):  # null: as if absent
        assert (_render(tiny_model_dir, template, _history(reasoning_content=None))
                == _render(tiny_model_dir, template, _history()))
    assert "<think>" not in _render(tiny_model_dir, QWEN3_TEMPLATE, _history())


def test_history_goes_under_every_name_templates_read() -> None:
    """reasoning_content (Qwen3), reasoning (vLLM's name) and thinking (gpt-oss): not left
    to the installed transformers, whose recent releases fill thinking themselves."""
    for sent in ({"reasoning_content": THOUGHT}, {"reasoning": THOUGHT},
                 {"reasoning": THOUGHT, "reasoning_content": THOUGHT}):
        messages = [{"role": "user", "content": "x"},
                    {"role": "assistant", "content": "y", **sent}]
        hand_history(messages)
        assert messages == [{"role": "user", "content": "x"},
                            {"role": "assistant", "content": "y", "reasoning_content": THOUGHT,
                             "reasoning": THOUGHT, "thinking": THOUGHT}]


TOOL_CALL = {"id": "call_1", "type": "function",
             "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(("messages", "param", "says"), [
    (_history(reasoning_content=5), "messages[1].reasoning_content", "str"),
    (_history(reasoning_content=["a"]), "messages[1].reasoning_content", "str"),
    (_history(reasoning={"text": "a"}), "messages[1].reasoning", "str"),
    ([{"role": "user", "content": "x", "reasoning_content": "r"}],
     "messages[0].reasoning_content", "only assistant messages"),
    ([{"role": "system", "content": "x", "reasoning": "r"}, *USER],
     "messages[0].reasoning", "only assistant messages"),
    # A tool message: checked before tool_calls turns tool results into user messages.
    ([*USER, {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
      {"role": "tool", "tool_call_id": "call_1", "content": "18", "reasoning_content": "r"}],
     "messages[2].reasoning_content", "only assistant messages"),
    (_history(reasoning_content="a", reasoning="b"), "messages[1].reasoning", "differ"),
])
def test_history_refusals_name_the_message_field(tiny_model_dir: Path, messages: list,
                                                 param: str, says: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        _render(tiny_model_dir, QWEN3_TEMPLATE, messages)
    assert info.value.param == param, info.value.message
    assert says in info.value.message and "unknown" not in info.value.message


def test_history_needs_the_plugin(tiny_model_dir: Path) -> None:
    with pytest.raises(InvalidRequest) as info:
        _render(tiny_model_dir, QWEN3_TEMPLATE, _history(reasoning_content=THOUGHT),
                plugins="tool_calls")
    assert info.value.param == "messages[1].reasoning_content"
    assert "plugin 'reasoning'" in info.value.message


def test_answer_sent_back_as_is(server: Server) -> None:
    """A client appends the answer's message to its messages, as it got it: the official
    client (its message object) and plain JSON (the response's dict)."""
    greedy = {"temperature": 0, "max_tokens": 4, "logit_bias": {str(OPEN): 100}}
    first = server.client.chat.completions.create(model=server.model, messages=USER,
                                                  **greedy)
    message = first.choices[0].message
    assert message.reasoning_content == "<think>" * 3
    follow_up = {"role": "user", "content": "Go on."}
    again = server.client.chat.completions.create(
        model=server.model, messages=[*USER, message, follow_up], **greedy)
    assert again.choices[0].message.reasoning_content == "<think>" * 3

    raw = _ok(server, "/v1/chat/completions", {"messages": USER, **greedy})
    messages = [*USER, raw["choices"][0]["message"], follow_up]
    assert "reasoning_content" in messages[1]
    _ok(server, "/v1/chat/completions", {"messages": messages, **greedy})
    sent = _ok(server, "/tokenize", {"messages": messages})["tokens"]
    without = [*USER, {"role": "assistant", "content": ""}, follow_up]
    assert sent == _ok(server, "/tokenize", {"messages": without})["tokens"]  # ChatML: unread
    bad = [*messages[:2], {**follow_up, "reasoning_content": "x"}]
    for path, body in (("/v1/chat/completions", greedy), ("/tokenize", {})):
        r = server.http.post(path, json={"messages": bad, **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "messages[2].reasoning_content"
