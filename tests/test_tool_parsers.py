"""The tool-call parsers (``freetoken_plugins/tool_calls/parsers.py``) on recorded outputs.

Every record is checked whole, split in two at every character boundary, fed one character
at a time, and cut at every length (truncation). Sources of the recorded outputs:

- [vllm-hermes] vllm-project/vllm, tests/entrypoints/openai/tool_parsers/
  test_hermes_tool_parser.py (QwQ-32B and Qwen3-32B outputs, the QwQ token stream).
- [qwen-docs] Qwen2.5 function calling guide, "The output texts should be like"
  (qwen.readthedocs.io/en/v2.5/framework/function_call.html).
- [vllm-llama3] vllm-project/vllm, tests/entrypoints/openai/tool_parsers/
  test_llama3_json_tool_parser.py.
- [meta-llama] meta-llama/llama-models, models/llama3_3/prompt_format.md (and
  llama_models/llama3_1/prompt_format.md), "JSON based tool calling", model response.
- [vllm-mistral] vllm-project/vllm, tests/tool_use/test_mistral_tool_parser.py
  (Mistral-7B-Instruct-v0.3 before v11; Mistral-Small-3.2-24B-Instruct-2506, v11).
- [vllm-required] vllm-project/vllm, tests/tool_use/test_tool_choice_required.py (the
  ``tool_choice: "required"`` JSON arrays).

Where FreeToken's semantics differ from vLLM's on the same text, the record says so.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from importlib import metadata
from importlib.metadata import EntryPoint

import pytest

from freetoken_plugins.tool_calls.families import (
    BUILTIN_PARSERS,
    ENTRY_POINT_GROUP,
    Hermes,
    Json,
    Llama3Json,
    Mistral,
    available_parsers,
    detect_parser,
)
from freetoken_plugins.tool_calls.json_scan import JsonScanner, JsonSyntaxError
from freetoken_plugins.tool_calls.parsers import Parsed, ToolParser, parse_text

Calls = list[tuple[str, str]]


@dataclass(frozen=True)
class Record:
    id: str
    text: str
    content: str
    calls: Calls


HERMES_TOOLS = ["get_current_temperature", "get_temperature_date", "final_answer",
                "internet_search"]
QWQ_TAIL = (  # [vllm-hermes] NO_STREAM_FUNCTION_OUTPUT, its last paragraph of reasoning
    "总结下来，给出一个范例参数，同时说明这些参数的选择依据，并建议进一步详细设计时进行"
    "热力循环分析和结构强度校核。\n</think>\n\n<tool_call>\n"
    '{"name": "internet_search", "arguments": {"question": "5MW燃气轮机设计参数 空气流量 '
    '压气机压比 转速 燃烧室出口温度 压气机级数 支点布局"}}\n</tool_call>\n\n '
)
QWQ_ARGS = ('{"question": "5MW燃气轮机设计参数 空气流量 压气机压比 转速 燃烧室出口温度 '
            '压气机级数 支点布局"}')
QWEN_PARALLEL = (  # [qwen-docs]
    '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": '
    '"San Francisco, CA, USA"}}\n</tool_call>\n<tool_call>\n{"name": "get_temperature_date", '
    '"arguments": {"location": "San Francisco, CA, USA", "date": "2024-10-01"}}\n</tool_call>'
)
QWEN_PARALLEL_CALLS = [
    ("get_current_temperature", '{"location": "San Francisco, CA, USA"}'),
    ("get_temperature_date", '{"location": "San Francisco, CA, USA", "date": "2024-10-01"}'),
]
HERMES = [
    Record("qwen25_parallel", QWEN_PARALLEL, "", QWEN_PARALLEL_CALLS),
    Record("qwq_reasoning_then_call", QWQ_TAIL,
           QWQ_TAIL[: QWQ_TAIL.index("\n\n<tool_call>")], [("internet_search", QWQ_ARGS)]),
    Record("qwen3_bug_19056",  # [vllm-hermes]
           '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}\n</tool_call>',
           "", [("final_answer", '{"trigger": true}')]),
    Record("qwen3_no_newlines",  # [vllm-hermes] test_hermes_parser_streaming
           '<tool_call>{"name": "get_current_temperature","arguments": {"location":'
           '"San Francisco, California, United States", "unit": "celsius"}}</tool_call>',
           "", [("get_current_temperature",
                 '{"location":"San Francisco, California, United States", "unit": "celsius"}')]),
    Record("qwen3_until_eos",  # [vllm-hermes] no </tool_call>: still a call
           '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}',
           "", [("final_answer", '{"trigger": true}')]),
    Record("qwen3_object_unclosed",  # [vllm-hermes] vLLM: no call; here the arguments closed,
           # so the call committed and the text ended in its markup (a truncated call)
           '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}',
           "", [("final_answer", '{"trigger": true}')]),
    Record("qwen3_no_call",  # [vllm-hermes]
           "This is some prior text that has nothing to do with tool calling.",
           "This is some prior text that has nothing to do with tool calling.", []),
    Record("text_around_calls",  # the [qwen-docs] calls with text before and after
           "Let me look both up.\n" + QWEN_PARALLEL + "\n\nI'll report back.",
           "Let me look both up.\n\nI'll report back.", QWEN_PARALLEL_CALLS),
    Record("unknown_name_then_call",  # an unknown name stays content; the next call parses
           '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>\n'
           '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}\n</tool_call>',
           '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
           [("final_answer", '{"trigger": true}')]),
]
# [vllm-hermes] STREAM_FUNCTION_OUTPUT_SIMPLIFICATION: QwQ-32B's tokens, "" where a token
# ends inside a character.
QWQ_TOKENS = [
    "<tool_call>", "\n", '{"', "name", '":', ' "', "internet", "_search", '",', ' "',
    "arguments", '":', ' {"', "question", '":', ' "', "5", "MW", "燃气", "轮", "机", "设计",
    "参数", "", "", " 空", "气", "流量", "", "", " 压", "气", "机", "压", "比", "", "",
    " 转", "速", "", "", " 燃", "烧", "室", "出口", "温度", "", "", " 压", "气", "机",
    "级", "数", "", " 支", "点", "布局", '"}', "}\n", "</tool_call>", "",
]

LLAMA3_TOOLS = ["trending_songs", "searchTool", "getOpenIncidentsTool", "complexTool",
                "simpleTool", "parserTool", "invalidTool"]
LLAMA3_THREE = ('{"name": "searchTool", "parameters": {"query": "test1"}}; '
                '{"name": "getOpenIncidentsTool", "parameters": {}}; '
                '{"name": "searchTool", "parameters": {"query": "test2"}}')
LLAMA3_THREE_CALLS = [("searchTool", '{"query": "test1"}'), ("getOpenIncidentsTool", "{}"),
                      ("searchTool", '{"query": "test2"}')]
LLAMA3 = [
    Record("meta_python_tag",  # [meta-llama]; the "type" member is skipped
           '<|python_tag|>{\n    "type": "function",\n    "name": "trending_songs",\n'
           '    "parameters": {\n        "n": "10",\n        "genre": "all"\n    }\n}',
           "", [("trending_songs", '{\n        "n": "10",\n        "genre": "all"\n    }')]),
    Record("with_arguments",  # [vllm-llama3] and the rest of this list
           '{"name": "searchTool", "parameters": {"query": "test query", "limit": 10}}',
           "", [("searchTool", '{"query": "test query", "limit": 10}')]),
    Record("arguments_key", '{"name": "searchTool", "arguments": {"query": "test"}}',
           "", [("searchTool", '{"query": "test"}')]),
    Record("multiple", LLAMA3_THREE, "", LLAMA3_THREE_CALLS),
    Record("multiple_whitespace", LLAMA3_THREE.replace("}; ", "} ; "), "", LLAMA3_THREE_CALLS),
    Record("deeply_nested",
           '{"name": "complexTool", "parameters": {"level1": {"level2": {"level3": '
           '{"level4": {"value": "deep"}}}}}}',
           "", [("complexTool",
                 '{"level1": {"level2": {"level3": {"level4": {"value": "deep"}}}}}')]),
    Record("multiple_deep",
           '{"name": "simpleTool", "parameters": {"value": "test"}}; {"name": "complexTool", '
           '"parameters": {"config": {"database": {"connection": {"pool": {"size": 10}}}}}}',
           "", [("simpleTool", '{"value": "test"}'),
                ("complexTool", '{"config": {"database": {"connection": {"pool": {"size": 10}}}}}')]),
    Record("brackets_in_strings",
           '{"name": "searchTool", "parameters": {"query": "test {value} [complex]",'
           '"nested": {"inner": "more {brackets}"}}}',
           "", [("searchTool",
                 '{"query": "test {value} [complex]","nested": {"inner": "more {brackets}"}}')]),
    Record("escaped_quotes",
           '{"name": "parserTool", "parameters": {"text": "He said \\"Hello {world}\\""}}',
           "", [("parserTool", '{"text": "He said \\"Hello {world}\\""}')]),
    # vLLM: no call. Here the call committed when its arguments began, and the JSON error
    # ended it: a call with arguments "{", the rest is text after the call.
    Record("invalid_json", '{"name": "invalidTool", "parameters": {invalid json}',
           "invalid json}", [("invalidTool", "{")]),
    Record("text_before",  # vLLM finds the call inside the text; here output must start with it
           'Here is the result: {"name": "getOpenIncidentsTool", "parameters": {}} '
           "Would you like to know more?",
           'Here is the result: {"name": "getOpenIncidentsTool", "parameters": {}} '
           "Would you like to know more?", []),
    Record("text_after", LLAMA3_THREE + " Would you like to know more?",
           "Would you like to know more?", LLAMA3_THREE_CALLS),
    Record("no_json", "This is just some text without any tool calls",
           "This is just some text without any tool calls", []),
]

MISTRAL_TOOLS = ["add", "get_current_weather", "get_age", "add_this_and_that", "multiply",
                 "bash"]
SF = '{"city": "San Francisco", "state": "CA", "unit": "celsius"}'
MISTRAL = [  # [vllm-mistral]
    Record("pre_v11_add", '[TOOL_CALLS][{"name": "add", "arguments":{"a": 3.5, "b": 4}}]',
           "", [("add", '{"a": 3.5, "b": 4}')]),
    Record("pre_v11_weather",
           '[TOOL_CALLS] [{"name": "get_current_weather", "arguments":' + SF + "}]",
           "", [("get_current_weather", SF)]),
    Record("pre_v11_arguments_first",
           '[TOOL_CALLS] [{"arguments":' + SF + ', "name": "get_current_weather"}]',
           "", [("get_current_weather", SF)]),
    Record("pre_v11_name_in_arguments",
           '[TOOL_CALLS] [{"arguments":{"name": "John Doe"}, "name": "get_age"}]',
           "", [("get_age", '{"name": "John Doe"}')]),
    Record("pre_v11_spaces",
           '[TOOL_CALLS]  [ {"name":"add" , "arguments" : {"a": 3, "b": 4} } ]',
           "", [("add", '{"a": 3, "b": 4}')]),
    Record("pre_v11_multiple",  # as recorded, the second object lacks its closing brace
           '[TOOL_CALLS][{"name": "add", "arguments": {"a": 3.5, "b": 4}}, '
           '{"name": "get_current_weather", "arguments":' + SF + "]",
           "", [("add", '{"a": 3.5, "b": 4}'), ("get_current_weather", SF)]),
    Record("pre_v11_content_before",
           'Hello[TOOL_CALLS] [{"name": "add", "arguments":{"a": 1, "b": 2}}]',
           "Hello", [("add", '{"a": 1, "b": 2}')]),
    Record("pre_v11_trailing_data",
           '[TOOL_CALLS] [{"name": "get_current_weather", "arguments":{"city": "Dallas", '
           '"state": "TX", "unit": "fahrenheit"}}]\nextra trailing data',
           "extra trailing data",
           [("get_current_weather", '{"city": "Dallas", "state": "TX", "unit": "fahrenheit"}')]),
    Record("pre_v11_not_json", "[TOOL_CALLS] not json at all",
           "[TOOL_CALLS] not json at all", []),
    Record("v11_add", '[TOOL_CALLS]add_this_and_that[ARGS]{"a": 3.5, "b": 4}',
           "", [("add_this_and_that", '{"a": 3.5, "b": 4}')]),
    Record("v11_weather", "[TOOL_CALLS]get_current_weather[ARGS]" + SF,
           "", [("get_current_weather", SF)]),
    Record("v11_multiple",
           '[TOOL_CALLS]add[ARGS]{"a": 3.5, "b": 4}[TOOL_CALLS]multiply[ARGS]{"a": 3, "b": 6}',
           "", [("add", '{"a": 3.5, "b": 4}'), ("multiply", '{"a": 3, "b": 6}')]),
    Record("v11_without_args_tag",
           '[TOOL_CALLS]add{"a": 3.5, "b": 4}[TOOL_CALLS]multiply{"a": 3, "b": 6}',
           "", [("add", '{"a": 3.5, "b": 4}'), ("multiply", '{"a": 3, "b": 6}')]),
    Record("v11_content_before", 'hi[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}',
           "hi", [("add", '{"a": 1, "b": 2}')]),
    Record("v11_complex_truncated",
           'hi{hi[TOOL_CALLS]bash{"command": "print(\\"hello world!\\")\\nre.compile(r\'{}\')',
           "hi{hi", [("bash", '{"command": "print(\\"hello world!\\")\\nre.compile(r\'{}\')')]),
    Record("v11_complex",
           'hi{hi[TOOL_CALLS]bash{"command": "print(\\"hello world!\\")\\nre.compile(r\'{}\')"}',
           "hi{hi", [("bash", '{"command": "print(\\"hello world!\\")\\nre.compile(r\'{}\')"}')]),
    Record("no_tools", "This is a test", "This is a test", []),
]

JSON_TOOLS = ["get_current_weather", "get_forecast"]
REQUIRED_OUTPUTS = [  # [vllm-required] VALID_TOOL_OUTPUTS, written with json.dumps
    [{"name": "get_current_weather", "parameters": {"city": "Vienna"}}],
    [{"name": "get_current_weather", "parameters": {"city": "Vienna"}},
     {"name": "get_current_weather", "parameters": {"city": "Berlin"}}],
    [{"name": "get_forecast", "parameters": {"city": "Vienna", "days": 7}}],
    [{"name": "get_forecast", "parameters": {"city": "Vienna", "days": 7}},
     {"name": "get_current_weather", "parameters": {"city": "Vienna"}},
     {"name": "get_forecast", "parameters": {"city": "Berlin", "days": 7}},
     {"name": "get_current_weather", "parameters": {"city": "Berlin"}}],
] + [  # [vllm-required] braces, quotes and backslashes in strings
    [{"name": "get_current_weather", "parameters": {"city": city}}]
    for city in ["a { b", "a } b", "a }} b", 'a " } b', r"a \ } b"]
] + [  # non-ASCII, escaped and raw (below)
    [{"name": "get_forecast", "parameters": {"city": "Zürich – 東京 🌦", "days": 1}}],
]


def _required(number: int, output: list[dict], ensure_ascii: bool = True) -> Record:
    text = json.dumps(output, ensure_ascii=ensure_ascii)
    calls = [(c["name"], json.dumps(c["parameters"], ensure_ascii=ensure_ascii))
             for c in output]
    return Record(f"required_{number}{'' if ensure_ascii else '_raw'}", text, "", calls)


JSON = [_required(i, o) for i, o in enumerate(REQUIRED_OUTPUTS)] + [
    _required(len(REQUIRED_OUTPUTS) - 1, REQUIRED_OUTPUTS[-1], ensure_ascii=False),
    Record("required_trailing_data",  # [vllm-required]
           json.dumps(REQUIRED_OUTPUTS[0]) + "\nDONE", "DONE",
           [("get_current_weather", '{"city": "Vienna"}')]),
    Record("single_object", '{"name": "get_current_weather", "arguments": {"city": "Vienna"}}',
           "", [("get_current_weather", '{"city": "Vienna"}')]),
    Record("fenced",
           '```json\n[{"name": "get_forecast", "parameters": {"city": "Vienna", "days": 7}}]\n```',
           "", [("get_forecast", '{"city": "Vienna", "days": 7}')]),
    Record("not_a_call", '{"city": "Vienna"}', '{"city": "Vienna"}', []),
    Record("prose", "Es ist sonnig in Wien.", "Es ist sonnig in Wien.", []),
]

FAMILIES = [(Hermes, HERMES_TOOLS, HERMES), (Llama3Json, LLAMA3_TOOLS, LLAMA3),
            (Mistral, MISTRAL_TOOLS, MISTRAL), (Json, JSON_TOOLS, JSON)]
CASES = [pytest.param(cls, tools, r, id=f"{cls.name}-{r.id}")
         for cls, tools, records in FAMILIES for r in records]


def collect(pieces: list[Parsed]) -> tuple[str, Calls]:
    """Content and calls of a stream of ``Parsed``, checking the delta contract: a call's
    first delta has its name and the next index; later ones continue the latest call."""
    calls: list[list[str]] = []
    for parsed in pieces:
        for delta in parsed.calls:
            if delta.name is not None:
                assert delta.index == len(calls)
                calls.append([delta.name, delta.arguments])
            else:
                assert delta.index == len(calls) - 1
                calls[-1][1] += delta.arguments
    return "".join(p.content for p in pieces), [(n, a) for n, a in calls]


def stream(cls: type[ToolParser], tools: list[str], chunks: list[str]) -> list[Parsed]:
    parser = cls(tools)
    return [parser.feed(chunk) for chunk in chunks] + [parser.finish()]


def assert_never_taken_back(pieces: list[Parsed], content: str, calls: Calls) -> None:
    """Content emitted is a prefix of the final content (held text is never emitted and
    then retracted, so no piece carries markup of a call that later committed); arguments
    emitted are a prefix of the final arguments."""
    for n in range(1, len(pieces) + 1):
        content_so_far, calls_so_far = collect(pieces[:n])
        assert content.startswith(content_so_far)
        assert len(calls_so_far) <= len(calls)
        for (name, args), (full_name, full_args) in zip(calls_so_far, calls):
            assert name == full_name and full_args.startswith(args)


@pytest.mark.parametrize("cls, tools, record", CASES)
def test_whole_text(cls, tools, record) -> None:
    assert parse_text(cls, tools, record.text) == (record.content, record.calls)
    for _, args in record.calls:
        if args.endswith("}"):  # complete arguments are a JSON object
            assert isinstance(json.loads(args), dict)


@pytest.mark.parametrize("cls, tools, record", CASES)
def test_split_at_every_boundary(cls, tools, record) -> None:
    expected = (record.content, record.calls)
    for i in range(len(record.text) + 1):
        pieces = stream(cls, tools, [record.text[:i], record.text[i:]])
        assert collect(pieces) == expected, i
        assert_never_taken_back(pieces, *expected)


@pytest.mark.parametrize("cls, tools, record", CASES)
def test_one_character_at_a_time(cls, tools, record) -> None:
    pieces = stream(cls, tools, list(record.text))
    assert collect(pieces) == (record.content, record.calls)
    assert_never_taken_back(pieces, record.content, record.calls)


@pytest.mark.parametrize("cls, tools, record", CASES)
def test_truncated_at_every_length(cls, tools, record) -> None:
    """Text cut anywhere: the content decided before the cut is the whole text's; calls
    are the whole text's calls, the last one possibly with a prefix of its arguments."""
    for n in range(len(record.text) + 1):
        parser = cls(tools)
        before_finish = parser.feed(record.text[:n])
        assert record.content.startswith(before_finish.content)
        _, calls = collect([before_finish, parser.finish()])
        assert len(calls) <= len(record.calls)
        for (name, args), (full_name, full_args) in zip(calls, record.calls):
            assert name == full_name and full_args.startswith(args)


def test_recorded_token_stream() -> None:
    """[vllm-hermes] QwQ-32B's own tokens of a call."""
    pieces = stream(Hermes, HERMES_TOOLS, QWQ_TOKENS)
    assert collect(pieces) == ("", [("internet_search", QWQ_ARGS)])
    first = next(p.calls[0] for p in pieces if p.calls)
    assert first.name == "internet_search" and first.arguments.startswith("{")
    assert all(not p.content for p in pieces)


@pytest.mark.parametrize("text, content, calls", [
    ("<tool_call>\n{\"name\": \"final_answer\", \"arguments\": {\"trig",
     "", [("final_answer", '{"trig')]),  # mid-arguments: a truncated call
    ('Sure.\n<tool_call>\n{"name": "final_an',
     'Sure.\n<tool_call>\n{"name": "final_an', []),  # mid-name: held text is content
    ('<tool_call>\n{"name": "final_answer", "arguments": {}}\n</tool_',
     "", [("final_answer", "{}")]),  # mid-markup: the call is complete
    ("Hello <tool_", "Hello <tool_", []),  # a start marker's prefix never became a call
    ('<tool_call>\n{"arguments": {"trigger": true}, "name": "final',
     '<tool_call>\n{"arguments": {"trigger": true}, "name": "final', []),
])
def test_hermes_truncated(text, content, calls) -> None:
    assert parse_text(Hermes, HERMES_TOOLS, text) == (content, calls)


VALID = '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}\n</tool_call>'


@pytest.mark.parametrize("malformed", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    '<tool_call>\n{"name": final_answer, "arguments": {}}\n</tool_call>',  # not JSON
    '<tool_call>\n["final_answer", {}]\n</tool_call>',  # not an object
    '<tool_call>\n{"arguments": {"trigger": true}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": 7, "arguments": {}}\n</tool_call>',  # name not a string
    '<tool_call>\n{"name": "final_answer", "arguments": [true]}\n</tool_call>',  # not object
    '<tool_call>\n{"name": "final_answer", "arguments": "true"}\n</tool_call>',
    "<tool_call> is the tag I would use",
    "<tool_call>\n<tool_call",
])
def test_hermes_malformed_is_content_and_parsing_goes_on(malformed) -> None:
    text = f"{malformed}\n{VALID}\nDone."
    assert parse_text(Hermes, HERMES_TOOLS, text) == (
        f"{malformed}\nDone.", [("final_answer", '{"trigger": true}')])
    for i in range(len(text) + 1):
        pieces = stream(Hermes, HERMES_TOOLS, [text[:i], text[i:]])
        assert collect(pieces) == parse_text(Hermes, HERMES_TOOLS, text)


def test_committed_arguments_that_break_end_the_call() -> None:
    """A JSON error after commit ends the call there; the rest is text after the call."""
    text = '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": tru}}\n</tool_call>'
    assert parse_text(Hermes, HERMES_TOOLS, text) == (
        "}}\n</tool_call>", [("final_answer", '{"trigger": tru')])


UNKNOWN_THEN_CALL = '{"name": "nope", "parameters": {}}; {"name": "searchTool", "parameters": {}}'
NOPE = ', {"name": "nope", "arguments": {}}]'


@pytest.mark.parametrize("cls, tools, text, content, calls", [
    (Llama3Json, LLAMA3_TOOLS, '{"name": "searchTool", "parameters": {"q": 1}}; hello',
     "; hello", [("searchTool", '{"q": 1}')]),
    (Llama3Json, LLAMA3_TOOLS, UNKNOWN_THEN_CALL, UNKNOWN_THEN_CALL, []),  # then all content
    (Mistral, MISTRAL_TOOLS, '[TOOL_CALLS]nope[ARGS]{"a": 1}[TOOL_CALLS]add[ARGS]{"a": 1}',
     '[TOOL_CALLS]nope[ARGS]{"a": 1}', [("add", '{"a": 1}')]),
    (Mistral, MISTRAL_TOOLS, '[TOOL_CALLS][{"name": "add", "arguments": {}}' + NOPE,
     NOPE, [("add", "{}")]),
    (Mistral, MISTRAL_TOOLS, "[TOOL_CALLS]add[ARG", "[TOOL_CALLS]add[ARG", []),
    (Json, JSON_TOOLS, '[{"name": "get_forecast", "parameters": {"days": 1}}, {"name": "x"}]',
     ', {"name": "x"}]', [("get_forecast", '{"days": 1}')]),
    (Json, JSON_TOOLS, "[]", "[]", []),
    (Json, JSON_TOOLS, "```json\nnot json\n```", "```json\nnot json\n```", []),
    (Json, JSON_TOOLS, ' \n{"name": "get_forecast"}', "", [("get_forecast", "{}")]),
    # truncated: mid-name (held text is content), mid-arguments (a truncated call)
    (Llama3Json, LLAMA3_TOOLS, '<|python_tag|>{"name": "searchT',
     '<|python_tag|>{"name": "searchT', []),
    (Mistral, MISTRAL_TOOLS, "Hm.[TOOL_CALLS]get_current_wea", "Hm.[TOOL_CALLS]get_current_wea",
     []),
    (Mistral, MISTRAL_TOOLS, '[TOOL_CALLS]add[ARGS]{"a": 3', "", [("add", '{"a": 3')]),
    (Json, JSON_TOOLS, '[{"name": "get_forecast", "parameters": {"city": "Wi', "",
     [("get_forecast", '{"city": "Wi')]),
    (Json, JSON_TOOLS, '```json\n[{"name": "get_fore', '```json\n[{"name": "get_fore', []),
])
def test_malformed_and_edge_cases(cls, tools, text, content, calls) -> None:
    assert parse_text(cls, tools, text) == (content, calls)
    assert collect(stream(cls, tools, list(text))) == (content, calls)


@pytest.mark.parametrize("text, content, calls", [
    ('Note:\n<tool_call>\n{"name": "final_answer", "arguments": {}}\n</tool_call>',
     "Note:", [("final_answer", "{}")]),
    ('<tool_call>\n{"name": "final_answer", "arguments": {}}\n</tool_call>\n\nAfter.',
     "After.", [("final_answer", "{}")]),
    (f"{VALID}\n \t\n{VALID}\n", "", [("final_answer", '{"trigger": true}')] * 2),
    ("Hello\n", "Hello\n", []),
    ("  \n", "  \n", []),
])
def test_whitespace_around_calls(text, content, calls) -> None:
    assert parse_text(Hermes, HERMES_TOOLS, text) == (content, calls)


@pytest.mark.parametrize("cls, text", [
    (Hermes, '<tool_call>\n{"name": "final_answer", "arguments": "{\\"trigger\\": true}"}'),
    (Llama3Json, '{"name": "final_answer", "parameters": " {\\"trigger\\": true} "}'),
    (Mistral, '[TOOL_CALLS][{"arguments": "{\\"trigger\\": true}", "name": "final_answer"}]'),
    (Json, '[{"name": "final_answer", "arguments": "{\\"trigger\\": true}"}]'),
])
def test_arguments_given_as_a_string_holding_an_object(cls, text) -> None:
    assert parse_text(cls, ["final_answer"], text) == ("", [("final_answer",
                                                              '{"trigger": true}')])
    pieces = stream(cls, ["final_answer"], list(text))
    assert [len(p.calls) for p in pieces if p.calls] == [1]  # in one piece


ROUND_TRIP = [
    ("get_weather", '{"city": "Zürich", "days": [1, 2], "note": "a } \\" ] b"}'),
    ("lookup", "{}"),
    ("get_weather", '{"city": "東京", "nested": {"deep": {"ok": true, "n": -1.5e-3}}}'),
]


@pytest.mark.parametrize("cls", BUILTIN_PARSERS.values())
@pytest.mark.parametrize("calls", [ROUND_TRIP[:1], ROUND_TRIP])
def test_render_calls_round_trips(cls, calls) -> None:
    text = cls.render_calls(calls)
    assert parse_text(cls, ["get_weather", "lookup"], text) == ("", calls)


@pytest.mark.parametrize("cls", BUILTIN_PARSERS.values())
def test_instructions_show_an_example_the_parser_reads(cls) -> None:
    example = cls.render_calls(cls.EXAMPLE)
    assert example in cls.instructions()
    assert parse_text(cls, [n for n, _ in cls.EXAMPLE], example) == ("", cls.EXAMPLE)


def test_families_and_flags() -> None:
    assert list(BUILTIN_PARSERS) == ["hermes", "llama3_json", "mistral", "json", "harmony",
                                     "gemma4"]
    assert [c.needs_special_tokens for c in BUILTIN_PARSERS.values()] == [
        False, False, True, False, True, True]


QWEN25_TEMPLATE = ('{{- "\\n</tools>\\n\\nFor each function call, return a json object with '
                   "function name and arguments within <tool_call></tool_call> XML tags:"
                   '\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
                   '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}')
LLAMA31_TEMPLATE = ('{%- if builtin_tools is defined or tools is not none %}\n'
                    '    {{- "Environment: ipython\\n" }}\n{%- endif %}')
MISTRAL_TEMPLATE = "{{- '[AVAILABLE_TOOLS] [' }}{%- for tool in tools %}"


@pytest.mark.parametrize("template, family", [
    (QWEN25_TEMPLATE, "hermes"), (LLAMA31_TEMPLATE, "llama3_json"),
    (MISTRAL_TEMPLATE, "mistral"), ("{{ messages }}", "hermes"), (None, "hermes"),
])
def test_detect_parser(template, family) -> None:
    assert detect_parser(template, BUILTIN_PARSERS) is BUILTIN_PARSERS[family]


def _entry_points(*points: tuple[str, str]):
    def entry_points(group: str) -> list[EntryPoint]:
        assert group == ENTRY_POINT_GROUP
        return [EntryPoint(name, value, group) for name, value in points]
    return entry_points


class Echo(Hermes):
    name = "echo"
    template_markers = ("{# echo #}",)


def test_available_parsers_adds_entry_points_and_skips_broken_ones(monkeypatch, caplog) -> None:
    monkeypatch.setattr(metadata, "entry_points", _entry_points(
        ("echo", f"{__name__}:Echo"),
        ("broken", "no_such_module_for_freetoken:Parser"),
        ("not_a_parser", "json:dumps"),
    ))
    found = available_parsers()
    assert list(found) == [*BUILTIN_PARSERS, "echo"]
    assert found["echo"] is Echo
    assert detect_parser("{# echo #}", found) is Echo
    assert "broken" in caplog.text and "not_a_parser" in caplog.text


def test_available_parsers_refuses_a_clash_with_a_built_in(monkeypatch) -> None:
    monkeypatch.setattr(metadata, "entry_points", _entry_points(("hermes", f"{__name__}:Echo")))
    with pytest.raises(ValueError, match="hermes"):
        available_parsers()


def _scanner_accepts(text: str) -> bool:
    scanner = JsonScanner()
    try:
        for c in text.strip(" \t\n\r"):
            if scanner.done:
                return False
            scanner.push(c)
    except JsonSyntaxError:
        return False
    return scanner.done


def _json_accepts(text: str) -> bool:
    def no_constants(name: str) -> None:
        raise ValueError(name)
    try:
        json.loads(text, parse_constant=no_constants)
    except ValueError:
        return False
    return True


DOCUMENTS = [
    '{"a": [1, -0.5, 2e10, 3E-2, 0, true, false, null], "b": {"c": "\\u00e9\\n\\"\\\\/"}}',
    '[{"name": "x", "arguments": {}}, {"k": [[], {}, ""]}]',
    '{"s": "{[\\"]}", "n": -12.75e+3, "e": "ü東🌦"}',
    '{ "spaced" : [ 1 , 2 ] , "x" : { } }',
]


def test_scanner_agrees_with_json_loads() -> None:
    """Objects and arrays, and random mutations of them: the scanner accepts exactly what
    ``json.loads`` (strict, no NaN) accepts."""
    rng = random.Random(20261201)
    alphabet = list('{}[]",:.-+eE0123456789 \\\nutrfalsn\x01xé')
    for document in DOCUMENTS:
        assert _scanner_accepts(document)
        for _ in range(400):
            chars = list(document)
            for _ in range(rng.randint(1, 3)):
                at = rng.randrange(len(chars))
                op = rng.random()
                if op < 0.4:
                    del chars[at]
                elif op < 0.7:
                    chars.insert(at, rng.choice(alphabet))
                else:
                    chars[at] = rng.choice(alphabet)
            text = "".join(chars)
            if text.strip(" \t\n\r")[:1] in ("{", "["):
                assert _scanner_accepts(text) == _json_accepts(text), text
