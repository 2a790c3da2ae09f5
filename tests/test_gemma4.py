"""Gemma 4 answers through the reasoning and tool_calls plugins.

The thought-channel splitter and its token counter (``freetoken_plugins/gemma4.py``)
against expected values, partly llama.cpp's ([llama.cpp] ggml-org/llama.cpp,
tests/test-chat.cpp, "Google Gemma 4"), and against themselves fed in pieces; the real
Gemma 4 chat templates (``tests/fixtures/gemma4/``) rendered through FreeToken's chat-template
machinery with tools, calls, results and an earlier answer's reasoning; then end to end on
a real ``freetoken serve`` of a tiny model whose vocabulary has Gemma 4's markers as special
tokens, with the real template. As in ``tests/test_harmony.py``, the model writes scripted
answers (``tests/plugins/freetoken_script.py``); ``<turn|>`` and ``<|tool_response>`` are
its end-of-generation tokens, as in Gemma 4.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import msgspec
import pytest
from server_fixtures import Server, start_script_server, stop_server
from server_fixtures import events as _events
from server_fixtures import ok as _ok
from tiny_models import make_tiny_model
from tokenizers import AddedToken

from freetoken_core import InvalidRequest, ModelInfo, SamplingParams
from freetoken_core.plugins import PluginManager
from freetoken_core.processors import AnswerStart, ChoiceView, RequestView, ResponseView
from freetoken_core.server import protocol as p
from freetoken_core.server.serving import parse_body, render_chat
from freetoken_core.tokenizer import load_tokenizer
from freetoken_plugins.gemma4 import (
    MARKERS,
    Gemma4Splitter,
    MarkupLexer,
    count_reasoning_tokens,
    prompt_tail,
    split,
)
from freetoken_plugins.tool_calls.plugin import ToolCalls

FIXTURES = Path(__file__).parent / "fixtures" / "gemma4"
TEMPLATE = (FIXTURES / "google-gemma-4-31B-it.jinja").read_text()
PLUGIN_DIR = Path(__file__).parent / "plugins"
VOCAB_MARKERS = ("<|channel>", "<channel|>", "<|turn>", "<turn|>", "<|tool_call>",
                 "<tool_call|>", '<|"|>', "<|tool_response>", "<tool_response|>", "<|tool>",
                 "<tool|>", "<|think|>")
HELLO = "Hello, world!\nWhat's up?"
Q = '<|"|>'

# -- the format, without a server --------------------------------------------------------


@pytest.mark.parametrize(("text", "tail", "expected"), [
    ("Hello, world!", "", (None, "Hello, world!")),  # [llama.cpp] and the next six
    ("<|channel>thought\nI'm\nthinking<channel|>" + HELLO, "", ("I'm\nthinking", HELLO)),
    ("<|channel>thought<channel|>" + HELLO, "", ("", HELLO)),
    ("<|channel>thought\n<channel|>" + HELLO + "<channel|>", "", ("", HELLO)),
    ("<|channel>thought\n<channel|>" + HELLO + "<|channel>thought\n<channel|>", "", ("", HELLO)),
    ("<|channel><|channel>thought\n<channel|>" + HELLO, "", ("", HELLO)),
    (" thinking<channel|>" + HELLO, "<|channel>thought\nI'm", (" thinking", HELLO)),
    ("It is sunny.<turn|>", "", (None, "It is sunny.")),  # end of turn: markup
    ("<|channel>thought\n\n  a\n<channel|>b<|channel>thought c<channel|>d<turn|>", "",
     ("a\nc", "bd")),
    ("<|channel>thought\nNeed it.<channel|>Sure.<|tool_call>call:f{a:" + Q + "b" + Q
     + "}<tool_call|><|tool_response>", "",
     ("Need it.", "Sure.<|tool_call>call:f{a:" + Q + "b" + Q + "}<tool_call|>")),
    ("<|channel>final\nabc", "", (None, "final\nabc")),  # not a thought channel
    ("<|channel>tho", "", (None, "tho")),  # cut in the channel's name
    ("<|channel>thought\nnever closed", "", ("never closed", "")),
    ("<|channel>thought\nx<|channel>y<channel|>z", "", ("xy", "z")),
    ("a<eos>b", "", (None, "ab")),  # any special token of the vocabulary is markup
    ("answer", "<|channel>thought\n", ("answer", "")),  # the prompt opened the thought
    ("thought\nr<channel|>c", "<|channel>", ("r", "c")),  # the answer names the channel
    ("<|channel>thought\nr<channel|>c", "<|channel>", ("r", "c")),
])
def test_split(text: str, tail: str, expected: tuple) -> None:
    assert split(text, MARKERS | {"<eos>"}, tail) == expected


WORDS = [*VOCAB_MARKERS, "<eos>", "thought", "thou", "ght", "\n", " ", "a", " b", "<", "<|",
         "|>", "channel", "<|tool_", "call:f{}", "<channel", "|"]
TAILS = ["", "<|channel>", "<|channel>thought", "<|channel>thought\nx"]


@pytest.mark.parametrize("seed", range(60))
def test_streamed_pieces_split_like_the_whole(seed: int) -> None:
    rng = random.Random(seed)
    text = "".join(rng.choice(WORDS) for _ in range(rng.randint(0, 24)))
    tail = rng.choice(TAILS)
    markers = MARKERS | {"<eos>"}
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 10))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    splitter, reasoning, content = Gemma4Splitter(markers, tail), "", ""
    for i, piece in enumerate(pieces):
        r, c = splitter.feed(piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    if not pieces:
        reasoning, content = splitter.feed("", final=True)
    got = (reasoning if splitter.has_reasoned else None, content)
    assert got == split(text, markers, tail), (text, cuts)


def test_lexer_holds_what_may_begin_a_marker() -> None:
    lexer = MarkupLexer({"<|channel>", "<a>", "<a>b"})
    assert lexer.feed("x<|chan") == [(False, "x")]
    assert lexer.feed("nel>y<a>") == [(True, "<|channel>"), (False, "y")]
    assert lexer.feed("b") == [(True, "<a>b")]
    assert lexer.feed("<a", final=True) == [(False, "<a")]
    with pytest.raises(ValueError):
        MarkupLexer(set())


OPEN, CLOSE = 100, 101


def _decode(ids: Any) -> str:
    names = {OPEN: "<|channel>", CLOSE: "<channel|>", 1: "thought\n", 2: "final\n"}
    return "".join(names.get(i, "x") for i in ids)


@pytest.mark.parametrize(("ids", "in_reasoning", "expected"), [
    ([7, 7, 7], False, 0),
    ([OPEN, 1, 7, 7, CLOSE, 7], False, 5),
    ([OPEN, 1, CLOSE, 7, OPEN, 1, 7, CLOSE], False, 7),  # two blocks
    ([OPEN, 1, 7, 7], False, 4),  # cut inside the thought
    ([OPEN, 2, 7, CLOSE, 7], False, 0),  # not a thought channel
    ([OPEN, 2, OPEN, 1, 7, CLOSE], False, 4),  # a dropped <|channel>, then a thought
    ([7, 7, CLOSE, 7], True, 3),  # the prompt left the thought open
    ([7, 7], True, 2),
])
def test_count_reasoning_tokens(ids: list[int], in_reasoning: bool, expected: int) -> None:
    assert count_reasoning_tokens(ids, OPEN, CLOSE, _decode, in_reasoning) == expected


@pytest.mark.parametrize(("prompt", "tail"), [
    ([7, 7], ""),
    ([7, OPEN, 1, CLOSE], ""),  # enable_thinking false: an empty thought, closed
    ([7, OPEN, 1], "<|channel>thought\n"),
    ([OPEN, 1, CLOSE, OPEN], "<|channel>"),
])
def test_prompt_tail(prompt: list[int], tail: str) -> None:
    assert prompt_tail(prompt, OPEN, CLOSE, _decode) == tail


# -- the model: the tiny Llama with Gemma 4's markers and template -----------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The markers as special tokens (ids 642-653, beside the test tokenizer's non-special
    ``<think>`` and ``</think>``: Gemma 4's channels win), ``<turn|>`` and
    ``<|tool_response>`` as end-of-generation tokens, the real template."""
    out = make_tiny_model(tmp_path_factory.mktemp("tiny-gemma4"), "llama", vocab_size=656)
    tokenizer = load_tokenizer(out)
    tokenizer.add_tokens([AddedToken(m, special=True, normalized=False)
                          for m in VOCAB_MARKERS], special_tokens=True)
    tokenizer.save_pretrained(out)
    config = json.loads((out / "generation_config.json").read_text())
    config["eos_token_id"] = [tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(
        ["<turn|>", "<|tool_response>"])]
    (out / "generation_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    return load_tokenizer(model_dir, TEMPLATE)


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city"},
        "days": {"type": "integer"}}, "required": ["city"]}}}]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
THOUGHT = "<|channel>thought\nThe user wants the weather.<channel|>"
CALL = f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},days:2}}<tool_call|>"
ARGUMENTS = '{"city": "Paris", "days": 2}'
HISTORY = [*USER, {"role": "assistant", "content": None,
                   "reasoning_content": "The user wants the weather.",
                   "tool_calls": [{"id": "call_1", "type": "function", "function": {
                       "name": "get_weather", "arguments": ARGUMENTS}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
MODEL = ModelInfo(vocab_size=656, eos_token_ids=frozenset({2}), max_model_len=2048)


def _render(tokenizer: Any, messages: list[dict], options: dict[str, Any] | None = None,
            **extra: Any) -> str:
    """The prompt as the chat route renders it, every plugin that reads chats enabled
    (``options``: the command line's)."""
    manager = PluginManager("reasoning,tool_calls,structured_outputs", options)
    request, rest, extras = parse_body(msgspec.json.encode({"messages": messages, **extra}),
                                       p.ChatCompletionRequest)
    params = SamplingParams(**rest)
    manager.validate(params, MODEL, "chat")
    return render_chat(tokenizer, request.messages, add_generation_prompt=True,
                       plugins=manager, params=params, extras=extras,
                       chat_template_kwargs=request.chat_template_kwargs)


def test_the_real_template_renders_tools_calls_results_and_reasoning(tokenizer: Any) -> None:
    text = _render(tokenizer, HISTORY, tools=TOOLS)
    assert ("<|turn>system\n<|tool>declaration:get_weather{description:<|\"|>The weather in a "
            "city.<|\"|>,parameters:{properties:{city:{description:<|\"|>The city<|\"|>,type:"
            "<|\"|>STRING<|\"|>},days:{type:<|\"|>INTEGER<|\"|>}},required:[<|\"|>city<|\"|>],"
            "type:<|\"|>OBJECT<|\"|>}}<tool|><turn|>\n") in text
    # The call as the model writes it (arguments as an object), its reasoning before it,
    # and the result; the prompt ends there: the model goes on in the same turn.
    assert text.endswith(
        "<|turn>model\n<|channel>thought\nThe user wants the weather.\n<channel|>" + CALL
        + "<|tool_response>response:get_weather{value:<|\"|>sunny<|\"|>}<tool_response|>")
    for variant in ({"reasoning": "The user wants the weather."}, {}):
        messages = json.loads(json.dumps(HISTORY))
        messages[1].pop("reasoning_content")
        messages[1].update(variant)
        again = _render(tokenizer, messages, tools=TOOLS)
        assert ("<|channel>thought\nThe user wants" in again) == bool(variant)


def test_thinking_on_and_off(tokenizer: Any) -> None:
    off = _render(tokenizer, USER)
    assert off.endswith("<|turn>user\nWhat is the weather in Paris?<turn|>\n<|turn>model\n"
                        "<|channel>thought\n<channel|>")
    assert "<|think|>" not in off
    on = _render(tokenizer, USER, chat_template_kwargs={"enable_thinking": True})
    assert on == (tokenizer.bos_token + "<|turn>system\n<|think|>\n<turn|>\n<|turn>user\n"
                  "What is the weather in Paris?<turn|>\n<|turn>model\n")


def test_the_interleaved_template_gets_the_results_as_tool_responses(model_dir: Path) -> None:
    """The earlier template reads a call's results only as the calling message's
    ``tool_responses`` (as llama.cpp converts them): the results, and the answer after them,
    join the call's turn."""
    old = load_tokenizer(model_dir, (FIXTURES / "google-gemma-4-31B-it-interleaved.jinja")
                         .read_text())
    results = [*HISTORY[:2], {"role": "tool", "tool_call_id": "call_1",
                              "content": '{"sky": "sunny", "temp": 18}'},
               {"role": "tool", "tool_call_id": "call_9", "content": "windy"}]
    text = _render(old, results, tools=TOOLS)
    turn = ("<|turn>model\n<|channel>thought\nThe user wants the weather.<channel|>" + CALL
            + "<|tool_response>response:get_weather{sky:<|\"|>sunny<|\"|>,temp:18}"
            "<tool_response|><|tool_response>response:call_9{value:<|\"|>windy<|\"|>}"
            "<tool_response|>")
    assert text.endswith(turn + "<|channel>thought\n<channel|>") and "<|turn>tool" not in text
    answered = _render(old, [*results, {"role": "assistant", "content": "Sunny, 18."},
                             {"role": "user", "content": "Thanks."}], tools=TOOLS)
    assert (CALL + "<|tool_response>response:get_weather") in answered
    assert "<tool_response|>Sunny, 18.<turn|>\n<|turn>user\nThanks.<turn|>" in answered
    # The current template reads the tool messages themselves: nothing is moved.
    assert "response:get_weather{value:<|\"|>{\"sky\"" in _render(
        load_tokenizer(model_dir, TEMPLATE), results[:3], tools=TOOLS)


def test_answer_start_after_the_thought(tokenizer: Any) -> None:
    """For other plugins (a grammar starts after the thought): the answer starts after
    ``<channel|>`` when the prompt left a channel open, or when the model opens one first."""
    hook = PluginManager(plugins="reasoning").hook.freetoken_answer_start
    open_id, close_id = tokenizer.convert_tokens_to_ids(["<|channel>", "<channel|>"])
    closed = tokenizer.encode(_render(tokenizer, USER), add_special_tokens=False)
    opened = tokenizer.encode("<|turn>model\n<|channel>thought\n", add_special_tokens=False)
    for prompt, inside in ((closed, False), (opened, True)):
        view = RequestView("r", 0, None, SamplingParams(), prompt, (), True)
        assert hook(request=view, tokenizer=tokenizer) == AnswerStart(close_id, inside, open_id)


def test_spelled_out_history_in_gemmas_syntax(tiny_model_dir: Path) -> None:
    """``--tool-calls-parser gemma4`` on a template without tool support: earlier calls are
    written in Gemma's syntax; arguments it cannot write are a 400 naming the message."""
    chatml, options = load_tokenizer(tiny_model_dir), {"tool_calls_parser": "gemma4"}
    try:
        text = _render(chatml, HISTORY, options, tools=TOOLS)
        assert "<|im_start|>assistant\n" + CALL + "<|im_end|>" in text
        assert "To call a function, write <|tool_call>call:" in text
        bad = json.loads(json.dumps(HISTORY))
        bad[1]["tool_calls"][0]["function"]["arguments"] = json.dumps({"city": f"a{Q}b"})
        with pytest.raises(InvalidRequest) as info:
            _render(chatml, bad, options, tools=TOOLS)
        assert info.value.param == "messages[1].tool_calls"
        assert "cannot be written" in info.value.message
    finally:
        ToolCalls.freetoken_configure({})  # the module's options back to the default


def test_the_plugins_split_and_parse_in_pieces(tokenizer: Any) -> None:
    """Through the real hooks: reasoning splits the thought off and drops ``<turn|>`` /
    ``<|tool_response>``, tool_calls reads the call; streamed in 5-character pieces the
    same as whole."""
    manager = PluginManager("reasoning,tool_calls,structured_outputs")
    params = SamplingParams(tools=TOOLS)
    manager.validate(params, MODEL, "chat")
    types = p.ResponseTypes.build(manager.plugin_classes())
    text = THOUGHT + "Let me check." + CALL + "<|tool_response>"
    prompt = tokenizer.encode(_render(tokenizer, USER, tools=TOOLS), add_special_tokens=False)

    def run(stream: bool) -> tuple[str, str | None, list[tuple[str, str]], str | None]:
        pieces = [text[i:i + 5] for i in range(0, len(text), 5)] if stream else [text]
        state: dict[str, Any] = {}
        reasoning, content, calls, finish = "", None, [], None
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            message = types.delta(content=piece) if stream else types.message(piece)
            view = ChoiceView(0, piece, "stop" if last else None, message)
            manager.decorate_response(ResponseView("chat", stream, [view], None, params,
                                                   [prompt], tokenizer, lambda _: [], state))
            reasoning += getattr(message, "reasoning_content", None) or ""
            if view.text:
                content = (content or "") + view.text
            for call in msgspec.to_builtins(getattr(message, "tool_calls", None) or []):
                if "name" in call["function"]:
                    calls.append((call["function"]["name"], ""))
                calls[-1] = (calls[-1][0], calls[-1][1] + call["function"]["arguments"])
            finish = view.finish_reason or finish
        return reasoning, content, calls, finish

    whole = run(stream=False)
    assert whole == ("The user wants the weather.", "Let me check.",
                     [("get_weather", ARGUMENTS)], "tool_calls")
    assert run(stream=True) == whole


# -- end to end ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Server:
    tmp = tmp_path_factory.mktemp("script-plugin-gemma4")
    (tmp / "gemma4.jinja").write_text(TEMPLATE)
    srv = start_script_server(model_dir, tmp / "gemma4.jinja", tmp)
    yield srv
    stop_server(srv)


def _script(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _answer(server: Server, tokenizer: Any, text: str, **body: Any) -> dict[str, Any]:
    """Non-streamed and streamed answers to a scripted ``text``: the message, usage and
    finish reason of each, the streamed ones reassembled from the deltas."""
    request = {"messages": USER, "max_tokens": 100,
               "script_token_ids": _script(tokenizer, text), **body}
    whole = _ok(server, "/v1/chat/completions", request)
    events = _events(server, "/v1/chat/completions",
                     {**request, "stream_options": {"include_usage": True}})
    deltas = [c["delta"] for e in events for c in e["choices"]]
    streamed: dict[str, Any] = {}
    for key in ("content", "reasoning_content"):
        pieces = [d[key] for d in deltas if d.get(key)]
        if pieces:
            streamed[key] = "".join(pieces)
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        for call in delta.get("tool_calls") or []:
            if "id" in call:
                calls[call["index"]] = [call["function"]["name"], ""]
            calls[call["index"]][1] += call["function"].get("arguments", "")
    finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    return {"message": whole["choices"][0]["message"],
            "finish": whole["choices"][0]["finish_reason"], "usage": whole["usage"],
            "streamed": streamed, "streamed_calls": [tuple(calls[i]) for i in sorted(calls)],
            "streamed_finish": finish, "streamed_usage": events[-1]["usage"]}


THINKING = {"chat_template_kwargs": {"enable_thinking": True}}


def test_thought_and_answer_split(server: Server, tokenizer: Any) -> None:
    got = _answer(server, tokenizer, THOUGHT + "It is sunny.<turn|>", **THINKING)
    assert got["message"] == {"role": "assistant", "content": "It is sunny.",
                              "reasoning_content": "The user wants the weather."}
    assert got["streamed"] == {"content": "It is sunny.",
                               "reasoning_content": "The user wants the weather."}
    assert got["finish"] == "stop" and got["streamed_finish"] == ["stop"]
    num_thought = len(_script(tokenizer, THOUGHT))
    assert num_thought > 5
    for usage in (got["usage"], got["streamed_usage"]):
        assert usage["completion_tokens_details"]["reasoning_tokens"] == num_thought
    for skip in (True, False):  # the request's own skip_special_tokens changes nothing
        again = _answer(server, tokenizer, THOUGHT + "It is sunny.<turn|>",
                        skip_special_tokens=skip, **THINKING)
        assert again["message"] == got["message"]


def test_thinking_off_answers_in_content(server: Server, tokenizer: Any) -> None:
    """The prompt closed an empty thought channel: the answer is all content."""
    got = _answer(server, tokenizer, "It is sunny.<turn|>")
    assert got["message"] == {"role": "assistant", "content": "It is sunny."}
    assert got["streamed"] == {"content": "It is sunny."}
    assert got["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


def test_tool_call_and_the_agent_loop(server: Server, tokenizer: Any) -> None:
    got = _answer(server, tokenizer, THOUGHT + CALL + "<|tool_response>", tools=TOOLS,
                  **THINKING)
    message = got["message"]
    assert message["content"] is None
    assert message["reasoning_content"] == "The user wants the weather."
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": ARGUMENTS}
    assert got["finish"] == "tool_calls" and got["streamed_finish"] == ["tool_calls"]
    assert got["streamed_calls"] == [("get_weather", ARGUMENTS)]
    assert "content" not in got["streamed"]

    # The answer sent back as it came, with the result: the template writes the reasoning
    # and the call, and the model answers in the same turn.
    messages = [*USER, message, {"role": "tool", "tool_call_id": call["id"],
                                 "content": "sunny"}]
    tokens = _ok(server, "/tokenize", {"messages": messages, **THINKING})["tokens"]
    prompt = tokenizer.decode(tokens, skip_special_tokens=False)
    assert prompt.endswith("<|turn>model\n<|channel>thought\nThe user wants the weather.\n"
                           "<channel|>" + CALL + "<|tool_response>response:get_weather"
                           "{value:<|\"|>sunny<|\"|>}<tool_response|>")
    final = _answer(server, tokenizer, "It is sunny in Paris.<turn|>", messages=messages,
                    tools=TOOLS)
    assert final["message"] == {"role": "assistant", "content": "It is sunny in Paris."}
    assert final["finish"] == "stop"


def test_a_call_to_an_unknown_tool_is_content(server: Server, tokenizer: Any) -> None:
    unknown = CALL.replace("get_weather", "delete_all")
    got = _answer(server, tokenizer, "Sure." + unknown + "<|tool_response>", tools=TOOLS)
    assert got["message"] == {"role": "assistant", "content": "Sure." + unknown}
    assert got["finish"] == "stop"
