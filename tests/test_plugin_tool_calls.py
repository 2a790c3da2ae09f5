"""The tool_calls plugin: validation, the prompt (the model's template or the generic
prompt), forced calls through the structured_outputs grammar, parsing of free answers, and
the response and stream shapes, through a real ``freetoken serve`` and the official
``openai`` client on the tiny model.

The tiny model's template is ChatML without tool support, so the server uses the generic
prompt and the hermes family. Its random weights do not write calls on their own: a free
(``auto``) answer is made to write one by constraining it to a fixed text with
``structured_outputs.choice`` (``auto`` implies no grammar, so the two combine), which
runs the real parser on real streamed output. Forced calls (``required``, a named
function) bound every string of their schemas and push whitespace down with
``logit_bias``, so that the random weights finish the document within ``max_tokens``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest
from server_fixtures import Server, ok, post

from freetoken_core import InvalidRequest, SamplingParams
from freetoken_core.plugins import PluginManager
from freetoken_core.processors import ChoiceView, ModelInfo, ResponseView
from freetoken_core.server import protocol as p
from freetoken_core.server.serving import parse_body, render_chat
from freetoken_core.tokenizer import load_tokenizer
from freetoken_plugins.tool_calls import prompting
from freetoken_plugins.tool_calls.plugin import NamedCall, ToolCalls, forced_schema

jsonschema = pytest.importorskip("jsonschema")

OPEN = 640  # the tiny tokenizer's <think>
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                           "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"], "additionalProperties": False,
        },
    },
}
SEARCH: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "pattern": "^[a-z ]{1,12}$"},
                           "limit": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["query", "limit"], "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, SEARCH]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
MODEL = ModelInfo(vocab_size=642, eos_token_ids=frozenset({2}), max_model_len=2048)


def schema_of(name: str) -> dict[str, Any]:
    return next(t for t in TOOLS if t["function"]["name"] == name)["function"]["parameters"]


def fields(**kwargs: Any) -> ToolCalls.Fields:
    return msgspec.convert(kwargs, ToolCalls.Fields)


# -- validation and the forced schema -------------------------------------------------------


@pytest.fixture(scope="module")
def plugins() -> PluginManager:
    return PluginManager("tool_calls,structured_outputs,reasoning")


def validated(plugins: PluginManager, **extra: Any) -> SamplingParams:
    params = SamplingParams(**extra)
    plugins.validate(params, MODEL, "chat")
    return params


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"functions": [WEATHER["function"]]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"tools": TOOLS, "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
])
def test_refusals_name_their_field(plugins: PluginManager, extra: dict, param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        validated(plugins, **extra)
    assert info.value.param == param, info.value.message


def test_tool_count_is_bounded(plugins: PluginManager) -> None:
    many = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    with pytest.raises(InvalidRequest, match="tool-calls-max-tools") as info:
        validated(plugins, tools=many)
    assert info.value.param == "tools"
    validated(plugins, tools=many[:128])


def test_forced_choices_imply_the_grammar(plugins: PluginManager) -> None:
    named = validated(plugins, tools=TOOLS, tool_choice={"type": "function",
                                                         "function": {"name": "search"}})
    assert named.fields["structured_outputs"].structured_outputs == {
        "json": schema_of("search"), "disable_any_whitespace": True}
    required = validated(plugins, tools=TOOLS, tool_choice="required")
    schema = required.fields["structured_outputs"].structured_outputs["json"]
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    one = validated(plugins, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert one.fields["structured_outputs"].structured_outputs["json"]["maxItems"] == 1
    auto = validated(plugins, tools=TOOLS)
    assert "structured_outputs" not in auto.fields and "tool_calls" in auto.fields
    assert forced_schema(fields(tools=TOOLS, tool_choice="none")) is None
    # A function without parameters takes none: its forced arguments are {}.
    bare = [{"type": "function", "function": {"name": "now"}}]
    schema = forced_schema(fields(tools=bare, tool_choice={"type": "function",
                                                           "function": {"name": "now"}}))
    jsonschema.validate({}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"a": 1}, schema)
    # A text format is no constraint: it combines with a forced call.
    validated(plugins, tools=TOOLS, tool_choice="required", response_format={"type": "text"})


def test_a_forced_call_needs_the_grammar_plugin() -> None:
    with pytest.raises(InvalidRequest, match="structured_outputs") as info:
        validated(PluginManager("tool_calls"), tools=TOOLS, tool_choice="required")
    assert info.value.param == "tool_choice"
    validated(PluginManager("tool_calls"), tools=TOOLS)  # auto needs no grammar


def test_parser_option_picks_the_family(tiny_model_dir: Path) -> None:
    from freetoken_plugins.tool_calls import plugin

    tokenizer = load_tokenizer(tiny_model_dir)
    with pytest.raises(ValueError, match="no such family"):
        ToolCalls.freetoken_configure({"tool_calls_parser": "nope"})
    try:
        ToolCalls.freetoken_configure({"tool_calls_parser": "llama3_json"})
        assert plugin._parser_class(tokenizer, "auto").name == "llama3_json"
        assert plugin._parser_class(tokenizer, "required").name == "json"
        with pytest.raises(ValueError, match="at least 1"):
            ToolCalls.freetoken_configure({"tool_calls_max_tools": 0})
    finally:
        ToolCalls.freetoken_configure({})
    # auto: the template's markers; ChatML without tool support reads as hermes.
    assert plugin._parser_class(tokenizer, "auto").name == "hermes"


def test_required_schema_accepts_exactly_the_tools_calls() -> None:
    schema = forced_schema(fields(tools=TOOLS, tool_choice="required"))
    jsonschema.validate([{"name": "search", "parameters": {"query": "a", "limit": 2}},
                         {"name": "get_weather", "parameters": {"city": "x", "unit": "c"}}],
                        schema)
    for bad in ([], [{"name": "search", "parameters": {"city": "x", "unit": "c"}}],
                [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def _with_address(name: str, address: dict[str, Any], key: str = "$defs") -> dict[str, Any]:
    """A tool as pydantic writes a nested model: the subschema under ``key``, a ``$ref``."""
    return {"type": "function", "function": {"name": name, "parameters": {
        key: {"Address": address}, "type": "object",
        "properties": {"home": {"$ref": f"#/{key}/Address"}}, "required": ["home"]}}}


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ZIP = {"type": "object", "properties": {"zip": {"type": "integer"}}, "required": ["zip"]}


def test_required_schema_resolves_each_tools_definitions() -> None:
    """Regression (issue 31, pydantic tools with a nested model under ``required``: "invalid
    JSON schema: Pointer '/$defs/Address' does not exist"): the definitions move to the
    array's root; a name two tools define differently is renamed, not refused. Through the
    server: ``test_required_calls_with_definitions``."""
    tools = [_with_address("a", CITY), _with_address("b", CITY),
             _with_address("c", ZIP), _with_address("d", ZIP, key="definitions")]
    schema = forced_schema(fields(tools=tools, tool_choice="required"))
    assert set(schema["$defs"]) == {"Address", "Address_2"}
    assert schema["definitions"] == {"Address": ZIP}
    jsonschema.validate([{"name": "a", "parameters": {"home": {"city": "x"}}},
                         {"name": "c", "parameters": {"home": {"zip": 1}}},
                         {"name": "d", "parameters": {"home": {"zip": 2}}}], schema)
    for bad in ([{"name": "a", "parameters": {"home": {"zip": 1}}}],
                [{"name": "c", "parameters": {"home": {"city": "x"}}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_named_answer_is_the_arguments_without_surrounding_whitespace() -> None:
    whole = ' \n{"a": 1, "b": "x y"}\n '
    for cut in range(len(whole) + 1):
        parser = NamedCall("f")
        deltas = [*parser.feed(whole[:cut]).calls, *parser.feed(whole[cut:]).calls,
                  *parser.finish().calls]
        assert [d.name for d in deltas][:1] == ["f"]
        assert all(d.name is None for d in deltas[1:]) and {d.index for d in deltas} == {0}
        assert "".join(d.arguments for d in deltas) == whole.strip()


# -- the prompt ------------------------------------------------------------------------------

HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ '\\n' }}"
    "{{ t | tojson }}{% endfor %}{{ '\\n' }}</tools><|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}\n<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}"
    "{%- if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HISTORY: list[dict[str, Any]] = [
    *USER,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "paris", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
]


def render(plugins: PluginManager, tokenizer: Any, messages: list[dict[str, Any]],
           **extra: Any) -> str:
    body = msgspec.json.encode({"messages": messages, **extra})
    request, rest, extras = parse_body(body, p.ChatCompletionRequest)
    params = validated(plugins, **rest)
    return render_chat(tokenizer, request.messages, add_generation_prompt=True,
                       plugins=plugins, params=params, extras=extras)


def test_template_with_tool_support_gets_the_tools_and_history(plugins: PluginManager,
                                                                 tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.chat_template = HERMES_TEMPLATE
    assert prompting.template_reads_tools(HERMES_TEMPLATE)
    text = render(plugins, tokenizer, HISTORY, tools=TOOLS)
    tools_json = text.split("<tools>")[1].split("</tools>")[0]
    assert [json.loads(line) for line in tools_json.strip().splitlines()] == TOOLS
    assert "You may call" not in text
    # The template received the arguments as an object, as Hugging Face templates expect.
    assert '"arguments": {"city": "paris", "unit": "c"}' in text
    assert "18 degrees<|im_end|>" not in text and "18 degrees [call_1]" in text
    none = render(plugins, tokenizer, USER, tools=TOOLS, tool_choice="none")
    assert "<tools>" not in none  # tool_choice none leaves the tools out


def test_template_without_tool_support_gets_the_generic_prompt(plugins: PluginManager,
                                                                tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    assert not prompting.template_reads_tools(tokenizer.chat_template)
    text = render(plugins, tokenizer, HISTORY, tools=TOOLS)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou may call") and "<tool_call>" in system
    assert json.dumps(SEARCH, ensure_ascii=False) in system
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "paris", "unit": "c"}}\n</tool_call><|im_end|>') in text
    assert ("<|im_start|>user\n<tool_response>\n18 degrees\n</tool_response>\n"
            "<tool_response>\nsunny\n</tool_response><|im_end|>") in text
    named = render(plugins, tokenizer, USER, tools=TOOLS,
                   tool_choice={"type": "function", "function": {"name": "search"}})
    assert "Call the function search" in named
    required = render(plugins, tokenizer, [{"role": "system", "content": "Be brief."}, *USER],
                      tools=TOOLS, tool_choice="required")
    assert required.startswith("<|im_start|>system\nBe brief.\n\nYou may call")
    assert "JSON array" in required
    # History renders without tools in the request too.
    assert "<tool_response>" in render(plugins, tokenizer, HISTORY)


@pytest.mark.parametrize(("messages", "param"), [
    ([{"role": "user", "content": "x", "tool_calls": HISTORY[1]["tool_calls"]}],
     "messages[0].tool_calls"),
    ([*USER, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}],
     "messages[1].tool_calls[0].function.arguments"),
    ([*USER, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}]}],
     "messages[1].tool_calls[0].function.arguments"),
    ([*USER, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                   "function": {"name": "f"}}]}],
     "messages[1].tool_calls[0].function.arguments"),
    ([*USER, {"role": "tool", "content": "18"}], "messages[1].tool_call_id"),
    ([{"role": "user", "content": "x", "tool_call_id": "c"}], "messages[0].tool_call_id"),
    ([{"role": "user", "content": "x", "tool_call_id": 3}], "messages[0].tool_call_id"),
    ([{"role": "user", "content": "x", "refusal": None}], "messages[0].refusal"),
])
def test_bad_history_is_a_400_naming_the_message_field(plugins: PluginManager,
                                                        tiny_model_dir: Path,
                                                        messages: list, param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        render(plugins, load_tokenizer(tiny_model_dir), messages, tools=TOOLS)
    assert info.value.param == param, info.value.message


# -- responses, through the real hooks --------------------------------------------------------


def test_free_answer_with_reasoning_then_calls(plugins: PluginManager) -> None:
    """The reasoning split runs first; the parser sees only the answer after ``</think>``."""
    params = validated(plugins, tools=TOOLS)
    types = p.ResponseTypes.build(plugins.plugin_classes())
    text = ('<think>the user wants weather</think>Checking.\n<tool_call>\n{"name": '
            '"get_weather", "arguments": {"city": "paris", "unit": "c"}}\n</tool_call>')

    class Tok:  # the reasoning plugin looks its tags up in the vocabulary
        chat_template = ""
        unk_token_id = 0

        @staticmethod
        def convert_tokens_to_ids(token: str) -> int:
            return {"<think>": 640, "</think>": 641}.get(token, 0)

    def run(stream: bool) -> tuple[str, str, list[dict], str | None]:
        pieces = [text[i:i + 7] for i in range(0, len(text), 7)]
        state: dict[str, Any] = {}
        reasoning, content, calls, finish = "", "", [], None
        for i, piece in enumerate(pieces if stream else [text]):
            last = not stream or i == len(pieces) - 1
            message = types.delta(content=piece) if stream else types.message(piece)
            view = ChoiceView(0, piece, "stop" if last else None, message)
            plugins.decorate_response(ResponseView("chat", stream, [view], None, params, [[1]],
                                                   Tok(), lambda _: [], state))
            reasoning += getattr(message, "reasoning_content", None) or ""
            content += view.text or ""
            calls.extend(msgspec.to_builtins(getattr(message, "tool_calls", []) or []))
            finish = view.finish_reason or finish
        return reasoning, content, calls, finish

    reasoning, content, calls, finish = run(stream=False)
    assert (reasoning, content, finish) == ("the user wants weather", "Checking.", "tool_calls")
    assert [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("function", "get_weather", '{"city": "paris", "unit": "c"}')]
    assert calls[0]["id"].startswith("call_") and "index" not in calls[0]
    s_reasoning, s_content, deltas, s_finish = run(stream=True)
    assert (s_reasoning, s_content, s_finish) == (reasoning, content, finish)
    assert deltas[0]["index"] == 0 and deltas[0]["function"]["name"] == "get_weather"
    assert all(set(d) == {"index", "function"} for d in deltas[1:])
    assert "".join(d["function"]["arguments"] for d in deltas) == calls[0]["function"][
        "arguments"]


# -- the server, through the openai client ---------------------------------------------------


@pytest.fixture(scope="module")
def server(plain_server: Server) -> Server:
    return plain_server  # conftest.py: one server for the modules that need no flags


@pytest.fixture(scope="module")
def bias(tiny_model_dir: Path) -> dict[str, float]:
    """Whitespace-only tokens and ``<think>`` pushed down (see the module docstring)."""
    tokenizer = load_tokenizer(tiny_model_dir)
    ids = [i for i in range(len(tokenizer))
           if tokenizer.decode([i]) and not tokenizer.decode([i]).strip()]
    return {**{str(i): -100.0 for i in ids}, str(OPEN): -100.0}


def collect_stream(stream: Any) -> tuple[str | None, list[tuple[str, str]], str | None]:
    """(content, [(name, arguments)], finish_reason) of choice 0 of a chat stream, checking
    the delta shapes on the way."""
    content, calls, finish = None, {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content = (content or "") + delta.content
            for call in delta.tool_calls or []:
                if call.index not in calls:
                    assert call.id and call.type == "function" and call.function.name
                    calls[call.index] = [call.function.name, ""]
                else:
                    assert call.id is None and call.function.name is None
                calls[call.index][1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def test_named_function_is_guaranteed(server: Server, bias: dict[str, float]) -> None:
    client = server.client
    for seed in range(3):
        kwargs = {"model": server.model, "messages": USER, "tools": TOOLS, "temperature": 1.0,
                      "seed": seed, "max_tokens": 96, "logit_bias": bias,
                      "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
        chat = client.chat.completions.create(**kwargs)
        choice = chat.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), schema_of("get_weather"))
        streamed = collect_stream(client.chat.completions.create(**kwargs, stream=True))
        assert streamed == (None, [("get_weather", call.function.arguments)], "tool_calls")


def test_required_calls_match_their_tools(server: Server, bias: dict[str, float]) -> None:
    """Every call is one of the tools with valid arguments. The random weights may go on
    adding parallel calls until ``max_tokens`` cuts one (``length``): the calls before it
    are still valid. With ``parallel_tool_calls: false`` there is exactly one."""
    client = server.client
    finishes = []
    for seed, parallel in [(0, True), (1, True), (2, False), (3, False)]:
        kwargs = {"model": server.model, "messages": USER, "tools": TOOLS, "temperature": 1.0,
                      "seed": seed, "max_tokens": 320, "logit_bias": bias, "tool_choice": "required",
                      "parallel_tool_calls": parallel}
        chat = client.chat.completions.create(**kwargs, n=2)
        for choice in chat.choices:
            finishes.append(choice.finish_reason)
            assert choice.message.content is None
            calls = choice.message.tool_calls
            assert calls and (parallel or len(calls) == 1)
            if choice.finish_reason == "length":
                calls = calls[:-1]
            else:
                assert choice.finish_reason == "tool_calls", choice
            for call in calls:
                jsonschema.validate(json.loads(call.function.arguments),
                                    schema_of(call.function.name))
        single = client.chat.completions.create(**kwargs)
        calls = [(c.function.name, c.function.arguments)
                 for c in single.choices[0].message.tool_calls]
        streamed = collect_stream(client.chat.completions.create(**kwargs, stream=True))
        assert streamed == (None, calls, single.choices[0].finish_reason)
    assert finishes.count("tool_calls") >= 6, finishes


FORCED = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
          '"paris", "unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "search", '
          '"arguments": {"query": "rain"}}\n</tool_call>')


def test_free_answer_is_parsed(server: Server) -> None:
    """``auto``: the answer (fixed by a choice constraint) is split into content and calls,
    streamed and not; a malformed call comes back as content."""
    client = server.client
    kwargs = {"model": server.model, "messages": USER, "tools": TOOLS, "temperature": 0,
                  "max_tokens": 200, "extra_body": {"structured_outputs": {"choice": [FORCED]}}}
    chat = client.chat.completions.create(**kwargs)
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    got = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert got == [("get_weather", '{"city": "paris", "unit": "c"}'),
                   ("search", '{"query": "rain"}')]
    assert len({c.id for c in choice.message.tool_calls}) == 2
    assert collect_stream(client.chat.completions.create(**kwargs, stream=True)) == (
        "Let me check.", got, "tool_calls")

    unknown = FORCED.replace('"search"', '"delete_all"')
    chat = client.chat.completions.create(
        **{**kwargs, "extra_body": {"structured_outputs": {"choice": [unknown]}}})
    choice = chat.choices[0]
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    assert '"delete_all"' in choice.message.content
    plain = client.chat.completions.create(
        **{**kwargs, "extra_body": {"structured_outputs": {"choice": ["no calls here"]}}})
    assert plain.choices[0].message.content == "no calls here"
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].finish_reason == "stop"


def test_cut_call_keeps_length(server: Server) -> None:
    chat = ok(server, "/v1/chat/completions", {
        "messages": USER, "tools": TOOLS, "temperature": 0, "max_tokens": 12,
        "structured_outputs": {"choice": [FORCED]}})
    choice = chat["choices"][0]
    assert choice["finish_reason"] == "length"
    assert "<tool_call" not in (choice["message"]["content"] or "")


def test_follow_up_with_the_call_and_its_result_answers(server: Server,
                                                         bias: dict[str, float]) -> None:
    client = server.client
    first = client.chat.completions.create(
        model=server.model, messages=USER, tools=TOOLS, temperature=0, max_tokens=96,
        logit_bias=bias, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    messages = [*USER, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    answer = client.chat.completions.create(model=server.model, messages=messages, tools=TOOLS,
                                            temperature=0, max_tokens=8)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    tokens = ok(server, "/tokenize", {"messages": messages})["tokens"]
    text = server.http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert f'"name": "get_weather", "arguments": {call.function.arguments}' in text
    assert "<tool_response>\n18 degrees, sunny\n</tool_response>" in text


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/v1/completions", {"prompt": "x", "tools": TOOLS}, "tools"),
    ("/v1/completions", {"prompt": "x", "messages": USER}, "messages"),
    ("/v1/chat/completions", {"messages": USER, "tools": "x"}, "tools"),
    ("/v1/chat/completions", {"messages": USER, "tools": TOOLS,
                              "tool_choice": {"type": "function", "function": {"name": "z"}}},
     "tool_choice.function.name"),
    ("/v1/chat/completions", {"messages": [*USER, {"role": "tool", "content": "x"}]},
     "messages[1].tool_call_id"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "zzz": 1}]},
     "messages[0].zzz"),
    ("/v1/chat/completions", {"messages": USER, "tools": TOOLS, "tool_choice": "required",
                              "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x", "tool_call_id": 5}]},
     "messages[0].tool_call_id"),
])
def test_server_refusals(server: Server, route: str, body: dict, param: str) -> None:
    r = post(server, route, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_openapi_documents_the_fields(server: Server) -> None:
    schema = server.http.get("/schema/openapi.json").json()["components"]["schemas"]
    request = schema["ChatCompletionRequest"]["properties"]
    assert {"tools", "tool_choice", "parallel_tool_calls"} <= set(request)
    assert "tools" not in schema["CompletionRequest"]["properties"]
    assert {"tool_calls", "tool_call_id"} <= set(schema["ChatMessage"]["properties"])
    assert "tool_calls" in schema["ResponseMessage"]["properties"]


def test_openai_client_refusal_is_a_bad_request(server: Server) -> None:
    with pytest.raises(openai.BadRequestError):
        server.client.chat.completions.create(model=server.model, messages=USER,
                                              tool_choice="required")


def test_required_calls_with_definitions(server: Server, bias: dict[str, float]) -> None:
    """Tools whose arguments reference their own ``$defs`` (two of them defining
    ``Address`` differently) under ``required``: a 200 whose calls match their own tool."""
    tools = [_with_address("a", CITY), _with_address("c", ZIP)]
    own = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    chat = server.client.chat.completions.create(
        model=server.model, messages=USER, tools=tools, tool_choice="required",
        parallel_tool_calls=False, temperature=1.0, seed=0, max_tokens=160, logit_bias=bias)
    (choice,) = chat.choices
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), own[call.function.name])
