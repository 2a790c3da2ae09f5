"""gpt-oss answers (the harmony format) through the reasoning and tool_calls plugins.

The splitter, the token counter and the ``harmony`` tool-call family against expected
values and against themselves fed in pieces; then end to end on a real ``freetoken serve``
of a tiny model whose vocabulary has the harmony special tokens and whose chat template is a
small harmony template (it reads ``reasoning_effort``, ``tools``, and an assistant call's
``thinking``, which it writes as the analysis message before the call, as gpt-oss's does). The model writes
scripted answers: a test plugin (``tests/plugins/freetoken_script.py``, installed for that
server process only) makes each choice draw the tokens of ``script_token_ids``, special
tokens included, which no grammar could force. ``<|return|>`` and ``<|call|>`` are the
model's end-of-generation tokens, as in gpt-oss.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from server_fixtures import Server, post, start_script_server, stop_server
from server_fixtures import events as _events
from server_fixtures import ok as _ok
from tiny_models import make_tiny_model
from tokenizers import AddedToken

from freetoken_core.tokenizer import load_tokenizer
from freetoken_plugins import harmony
from freetoken_plugins.harmony import HarmonySplitter, count_reasoning_tokens, split
from freetoken_plugins.tool_calls.families import BUILTIN_PARSERS, Harmony, detect_parser
from freetoken_plugins.tool_calls.parsers import parse_text

PLUGIN_DIR = Path(__file__).parent / "plugins"
MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
           "<|return|>", "<|call|>")
IS_MARKER = (harmony.MARKERS | {"<|endoftext|>"}).__contains__

HARMONY_TEMPLATE = """\
{%- set effort = reasoning_effort if reasoning_effort is defined else "medium" -%}
<|start|>system<|message|>You are a tiny test model.
Reasoning: {{ effort }}

# Valid channels: analysis, commentary, final.<|end|>
{%- if tools -%}
<|start|>developer<|message|># Tools
namespace functions {
{%- for tool in tools %}
type {{ tool.function.name }} = (_: {{ tool.function.parameters | tojson }}) => any;
{%- endfor %}
} // namespace functions<|end|>
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == "assistant" and message.tool_calls -%}
{%- if message.thinking -%}
<|start|>assistant<|channel|>analysis<|message|>{{ message.thinking }}<|end|>
{%- endif -%}
{%- for call in message.tool_calls -%}
<|start|>assistant to=functions.{{ call.function.name }}<|channel|>commentary json\
<|message|>{{ call.function.arguments | tojson }}<|call|>
{%- endfor -%}
{%- elif message.role == "tool" -%}
<|start|>functions to=assistant<|channel|>commentary<|message|>{{ message.content }}<|end|>
{%- elif message.role == "assistant" -%}
<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>
{%- else -%}
<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}
"""

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]

ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.<|return|>"
CALL = ("<|start|>assistant<|channel|>commentary to=functions.get_weather "
        '<|constrain|>json<|message|>{"city": "Paris"}<|call|>')
CALL_RECIPIENT_FIRST = (' to=functions.get_weather<|channel|>commentary json<|message|>'
                        '{"city": "Paris"}<|call|>')


# -- the format, without a server --------------------------------------------------------


@pytest.mark.parametrize(("text", "tail", "expected"), [
    (ANALYSIS + FINAL, "", ("The user wants the weather.", "It is sunny in Paris.")),
    ("<|channel|>final<|message|>Only this.<|return|>", "", (None, "Only this.")),
    ("No header at all.", "", (None, "No header at all.")),
    (" tomato", "", (None, " tomato")),
    ("<|channel|>analysis<|message|>cut by max_tokens", "", ("cut by max_tokens", "")),
    ("<|channel|>analysis<|message|>a<|endoftext|>b<|end|>", "", ("ab", "")),
    ("<|channel|>commentary<|message|>Let me look.<|end|>", "", (None, "Let me look.")),
    (ANALYSIS + CALL, "", ("The user wants the weather.", CALL)),
    (CALL_RECIPIENT_FIRST, "", (None, CALL_RECIPIENT_FIRST)),
    ("<|channel|>analy", "", (None, "")),  # a header cut before <|message|>: dropped
    ("on.<|end|>" + FINAL, "<|start|>assistant<|channel|>analysis<|message|>Go",
     ("on.", "It is sunny in Paris.")),
    ("analysis<|message|>r<|end|>", "<|start|>assistant<|channel|>", ("r", "")),
    ("x", "<|start|>assistant<|channel|>analysis<|message|>y<|end|>", (None, "x")),
])
def test_split(text: str, tail: str, expected: tuple) -> None:
    assert split(text, IS_MARKER, tail) == expected


WORDS = [*MARKERS, "<|endoftext|>", "analysis", "final", "commentary", " to=functions.f",
         " to=", "assistant", " json", "a", " b", "<", "<|", "|>", "<|nope|>", "\n", "{}"]
TAILS = ["", "<|start|>assistant", "<|start|>assistant<|channel|>",
         "<|start|>assistant<|channel|>analysis<|message|>x"]


@pytest.mark.parametrize("seed", range(60))
def test_streamed_pieces_split_like_the_whole(seed: int) -> None:
    rng = random.Random(seed)
    text = "".join(rng.choice(WORDS) for _ in range(rng.randint(0, 24)))
    tail = rng.choice(TAILS)
    splitter = HarmonySplitter(IS_MARKER, tail)
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 10))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])] or [""]
    reasoning = content = ""
    for i, piece in enumerate(pieces):
        r, c = splitter.feed(piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    assert ((reasoning if splitter.has_reasoned else None), content) == split(
        text, IS_MARKER, tail)


IDS = {marker: 100 + i for i, marker in enumerate(MARKERS)}
S, E, M, C, K, R, CA = (IDS[m] for m in MARKERS)


def _decode(ids: Any) -> str:
    names = {i: m for m, i in IDS.items()}
    return "".join(names.get(i, {1: "analysis", 2: "final", 3: " to=functions.f",
                                 4: "assistant"}.get(i, "x")) for i in ids)


@pytest.mark.parametrize(("ids", "in_reasoning", "expected"), [
    ([C, 1, M, 7, 7, E, S, 4, C, 2, M, 7, R], False, 6),
    ([C, 2, M, 7, R], False, 0),
    ([7, 7, 7], False, 0),
    ([C, 1, M, 7, 7], False, 5),                       # cut inside the analysis
    ([C, 1, 3, M, 7, CA], False, 0),                   # a call from the analysis channel
    ([7, 7, E, S, 4, C, 2, M, 7, R], True, 3),         # the prompt left an analysis open
    ([C, 1, M, 7, S, 4, C, 2, M, 7, R], False, 4),     # no <|end|>: the next message ends it
])
def test_count_reasoning_tokens(ids: list[int], in_reasoning: bool, expected: int) -> None:
    assert count_reasoning_tokens(ids, IDS, _decode, in_reasoning) == expected


@pytest.mark.parametrize(("text", "content", "calls"), [
    (CALL, "", [("get_weather", '{"city": "Paris"}')]),
    (CALL_RECIPIENT_FIRST, "", [("get_weather", '{"city": "Paris"}')]),
    ("Let me check." + CALL + CALL, "Let me check.",
     [("get_weather", '{"city": "Paris"}')] * 2),
    (ANALYSIS + CALL, ANALYSIS, [("get_weather", '{"city": "Paris"}')]),  # no reasoning split
    (CALL.replace("get_weather", "delete_all"), CALL.replace("get_weather", "delete_all"), []),
    (CALL.replace("functions.", "browser."), CALL.replace("functions.", "browser."), []),
    (CALL[:-len("<|call|>")], "", [("get_weather", '{"city": "Paris"}')]),  # cut: kept
    (CALL[:CALL.index("<|message|>")], CALL[:CALL.index("<|message|>")], []),
    ("It is sunny.", "It is sunny.", []),
])
def test_harmony_tool_parser(text: str, content: str, calls: list) -> None:
    assert parse_text(Harmony, ["get_weather"], text) == (content, calls)
    parser, got_content, got_calls = Harmony(["get_weather"]), "", []
    for piece in [*text, None]:  # one character at a time, then finish
        parsed = parser.finish() if piece is None else parser.feed(piece)
        got_content += parsed.content
        for delta in parsed.calls:
            if delta.name is not None:
                got_calls.append((delta.name, ""))
            got_calls[delta.index] = (got_calls[delta.index][0],
                                      got_calls[delta.index][1] + delta.arguments)
    assert (got_content, got_calls) == (content, calls)


def _parse_in_pieces(text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]]]:
    parser, content, calls = Harmony(["f"]), "", []
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    for parsed in [*map(parser.feed, pieces), parser.finish()]:
        content += parsed.content
        for delta in parsed.calls:
            if delta.name is not None:
                calls.append((delta.name, ""))
            calls[delta.index] = (calls[delta.index][0], calls[delta.index][1] + delta.arguments)
    return content, calls


CALL_WORDS = [*WORDS, "<|start|>assistant<|channel|>commentary to=functions.f <|message|>",
              " to=functions.f<|channel|>commentary json<|message|>",
              "<|channel|>commentary to=functions.g<|message|>", '{"a": [1]}', "<|call|>"]


@pytest.mark.parametrize("seed", range(60))
def test_harmony_tool_parser_in_pieces_parses_like_the_whole(seed: int) -> None:
    rng = random.Random(seed)
    text = "".join(rng.choice(CALL_WORDS[-5:] if rng.random() < 0.4 else CALL_WORDS)
                   for _ in range(rng.randint(0, 24)))
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 10))))
    assert _parse_in_pieces(text, cuts) == parse_text(Harmony, ["f"], text)


def test_harmony_family_is_detected_from_the_template() -> None:
    assert detect_parser(HARMONY_TEMPLATE, BUILTIN_PARSERS) is Harmony
    assert Harmony.needs_special_tokens


# -- end to end --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with the harmony markers added to its vocabulary as special tokens
    (ids 642-648, beside the test tokenizer's non-special ``<think>`` and ``</think>``:
    harmony wins), and ``<|return|>`` / ``<|call|>`` as end-of-generation tokens."""
    out = make_tiny_model(tmp_path_factory.mktemp("tiny-harmony"), "llama", vocab_size=656)
    tokenizer = load_tokenizer(out)
    tokenizer.add_tokens([AddedToken(m, special=True, normalized=False) for m in MARKERS],
                         special_tokens=True)
    tokenizer.save_pretrained(out)
    config = json.loads((out / "generation_config.json").read_text())
    config["eos_token_id"] = [tokenizer.eos_token_id,
                              *tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"])]
    (out / "generation_config.json").write_text(json.dumps(config))
    (out / "harmony.jinja").write_text(HARMONY_TEMPLATE)
    return out


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Server:
    srv = start_script_server(model_dir, model_dir / "harmony.jinja",
                              tmp_path_factory.mktemp("script-plugin"))
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
        pieces = [d[key] for d in deltas if d.get(key)]  # the opening delta's content is ""
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
            "streamed_finish": finish, "streamed_usage": events[-1]["usage"], "deltas": deltas}


def test_analysis_and_final_split(server: Server, tokenizer: Any) -> None:
    got = _answer(server, tokenizer, ANALYSIS + FINAL)
    assert got["message"] == {"role": "assistant", "content": "It is sunny in Paris.",
                              "reasoning_content": "The user wants the weather."}
    assert got["finish"] == "stop" and got["streamed_finish"] == ["stop"]
    assert got["streamed"] == {"content": "It is sunny in Paris.",
                               "reasoning_content": "The user wants the weather."}
    assert not any("<|" in (d.get("content") or "") + (d.get("reasoning_content") or "")
                   for d in got["deltas"])
    num_analysis = len(_script(tokenizer, ANALYSIS))
    assert num_analysis > 5
    for usage in (got["usage"], got["streamed_usage"]):
        assert usage["completion_tokens_details"]["reasoning_tokens"] == num_analysis
        assert usage["completion_tokens"] == len(_script(tokenizer, ANALYSIS + FINAL))

    # The same tokens on /v1/completions: not split, and skip_special_tokens honoured.
    body = {"prompt": "Hi", "max_tokens": 100,
            "script_token_ids": _script(tokenizer, ANALYSIS + FINAL)}
    text = _ok(server, "/v1/completions", body)["choices"][0]["text"]
    assert text == "analysisThe user wants the weather.assistantfinalIt is sunny in Paris."
    raw = _ok(server, "/v1/completions", {**body, "skip_special_tokens": False})
    assert raw["choices"][0]["text"] == ANALYSIS + FINAL


def test_explicit_skip_special_tokens_splits_the_same(server: Server, tokenizer: Any) -> None:
    for skip in (True, False):
        got = _answer(server, tokenizer, ANALYSIS + FINAL, skip_special_tokens=skip)
        assert got["message"]["content"] == "It is sunny in Paris."
        assert got["message"]["reasoning_content"] == "The user wants the weather."


@pytest.mark.parametrize("text", ["<|channel|>final<|message|>Only the answer.<|return|>",
                                  "Only the answer.<|return|>"])
def test_answer_without_analysis(server: Server, tokenizer: Any, text: str) -> None:
    got = _answer(server, tokenizer, text)
    assert got["message"] == {"role": "assistant", "content": "Only the answer."}
    assert got["streamed"] == {"content": "Only the answer."}
    assert got["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


@pytest.mark.parametrize("call", [CALL, CALL_RECIPIENT_FIRST], ids=["channel", "role"])
def test_tool_call(server: Server, tokenizer: Any, call: str) -> None:
    text = call if call is CALL_RECIPIENT_FIRST else ANALYSIS + call
    got = _answer(server, tokenizer, text, tools=TOOLS)
    message = got["message"]
    assert message["content"] is None
    (tool_call,) = message["tool_calls"]
    assert tool_call["type"] == "function" and tool_call["id"].startswith("call_")
    assert tool_call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert got["finish"] == "tool_calls" and got["streamed_finish"] == ["tool_calls"]
    assert got["streamed_calls"] == [("get_weather", '{"city": "Paris"}')]
    assert "content" not in got["streamed"]
    if call is CALL:
        assert message["reasoning_content"] == "The user wants the weather."
        assert got["streamed"]["reasoning_content"] == "The user wants the weather."
    for usage in (got["usage"], got["streamed_usage"]):
        expected = len(_script(tokenizer, ANALYSIS)) if call is CALL else 0
        assert usage["completion_tokens_details"]["reasoning_tokens"] == expected


def test_tool_call_after_a_final_message(server: Server, tokenizer: Any) -> None:
    final = FINAL.replace("<|return|>", "<|end|>")
    got = _answer(server, tokenizer, ANALYSIS + final + CALL, tools=TOOLS)
    assert got["message"]["content"] == "It is sunny in Paris."
    assert [c["function"]["name"] for c in got["message"]["tool_calls"]] == ["get_weather"]
    assert got["streamed"]["content"] == "It is sunny in Paris."
    assert got["streamed_calls"] == [("get_weather", '{"city": "Paris"}')]


def test_the_call_history_renders(server: Server, tokenizer: Any) -> None:
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    got = _answer(server, tokenizer, FINAL.removeprefix("<|start|>assistant"),
                  messages=messages, tools=TOOLS)
    assert got["message"] == {"role": "assistant", "content": "It is sunny in Paris."}
    prompt = _prompt_text(server, {"messages": messages, "tools": TOOLS})
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
            '{"city": "Paris"}<|call|>') in prompt


def test_the_reasoning_of_a_call_goes_back_as_its_analysis(server: Server,
                                                           tokenizer: Any) -> None:
    """An agent loop: the answer (reasoning and a call) sent back as it came, with the
    call's result; the template reads the reasoning as the message's ``thinking``."""
    first = _ok(server, "/v1/chat/completions", {
        "messages": USER, "tools": TOOLS, "max_tokens": 100,
        "script_token_ids": _script(tokenizer, ANALYSIS + CALL)})["choices"][0]["message"]
    assert first["reasoning_content"] == "The user wants the weather."
    messages = [*USER, first, {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"],
                               "content": "sunny"}]
    analysis = ("<|start|>assistant<|channel|>analysis<|message|>The user wants the weather."
                "<|end|><|start|>assistant to=functions.get_weather")
    assert analysis in _prompt_text(server, {"messages": messages, "tools": TOOLS})
    tokens = _ok(server, "/tokenize", {"messages": messages})["tokens"]
    assert analysis in tokenizer.decode(tokens, skip_special_tokens=False)


def _prompt_text(server: Server, body: dict[str, Any]) -> str:
    """The rendered chat prompt, from its tokens' ``prompt_logprobs`` (all but the first)."""
    got = _ok(server, "/v1/chat/completions", {"max_tokens": 1, "prompt_logprobs": 0,
                                               "messages": USER, **body})
    return "".join(next(iter(entry.values()))["decoded_token"]
                   for entry in got["prompt_logprobs"][1:])


def test_reasoning_effort_reaches_the_template(server: Server) -> None:
    for effort in ("low", "medium", "high"):
        prompt = _prompt_text(server, {"reasoning_effort": effort})
        assert f"Reasoning: {effort}\n" in prompt
        assert prompt.endswith("<|start|>assistant")
    assert "Reasoning: medium\n" in _prompt_text(server, {})  # the template's own default


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/v1/chat/completions", {"reasoning_effort": "extreme"}, "reasoning_effort"),
    ("/v1/chat/completions", {"reasoning_effort": 3}, "reasoning_effort"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"reasoning_effort": "high"}},
     "chat_template_kwargs"),
    ("/v1/completions", {"reasoning_effort": "high"}, "reasoning_effort"),
])
def test_reasoning_effort_refusals(server: Server, route: str, body: dict, param: str) -> None:
    _ok(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 1,
                                         "reasoning_effort": "low"})
    prompt = {"prompt": "Hi"} if route == "/v1/completions" else {"messages": USER}
    r = post(server, route, {**prompt, "max_tokens": 1, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, r.text
    assert "unknown field" not in error["message"]
    if param == "chat_template_kwargs":
        assert "top level" in error["message"]


def test_reasoning_effort_on_a_template_that_does_not_read_it(plain_server: Server) -> None:
    """The tiny model's ChatML template has no reasoning_effort: a 400, not silence."""
    for stream in (False, True):
        r = post(plain_server, "/v1/chat/completions", {
            "messages": USER, "max_tokens": 1, "reasoning_effort": "high", "stream": stream})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "reasoning_effort"
        assert "does not read reasoning_effort" in error["message"]
