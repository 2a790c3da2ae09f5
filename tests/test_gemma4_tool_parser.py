"""The ``gemma4`` tool-call family (``freetoken_plugins/tool_calls/gemma4.py``) on Gemma 4
outputs, with the checks ``tests/test_tool_parsers.py`` runs on every family: each record
whole, split in two at every character boundary, one character at a time, and cut at every
length. Then the argument converter on its own (Gemma's syntax ↔ JSON) and the family's
detection from the real chat templates (``tests/fixtures/gemma4/``).

Source of the recorded outputs: [llama.cpp] ggml-org/llama.cpp, tests/test-chat.cpp, "Google
Gemma 4 (tool calling with Gemma4 dict format)"; llama.cpp's expected arguments are the same
JSON values (its text drops the spaces after ``:`` and ``,`` where ours has
``json.dumps``'s).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from test_tool_parsers import Record, assert_never_taken_back, collect, stream

from freetoken_plugins.tool_calls.families import BUILTIN_PARSERS, detect_parser
from freetoken_plugins.tool_calls.gemma4 import (
    ArgumentsSyntaxError,
    Gemma4,
    from_json,
    to_json,
)
from freetoken_plugins.tool_calls.parsers import parse_text

FIXTURES = Path(__file__).parent / "fixtures" / "gemma4"
TOOLS = ["get_time", "get_weather", "empty_args", "special_function", "amount", "toggle",
         "set_nullable", "todo_list", "set_config"]
Q = '<|"|>'
LONDON = f"<|tool_call>call:get_time{{city:{Q}London{Q}}}<tool_call|>"
PARIS = f"<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}<tool_call|>"


def _one(name: str, arguments: str, expected: str, rid: str) -> Record:
    return Record(rid, f"<|tool_call>call:{name}{arguments}<tool_call|>", "",
                  [(name, expected)])


RECORDS = [  # [llama.cpp]
    Record("string", LONDON, "", [("get_time", '{"city": "London"}')]),
    _one("get_time", f"{{city:{Q}San Francisco{Q}}}", '{"city": "San Francisco"}', "space"),
    _one("empty_args", "{}", "{}", "empty_args"),
    Record("content_then_call", "Hello, world!\nWhat's up?" + PARIS.replace("weather", "time"),
           "Hello, world!\nWhat's up?", [("get_time", '{"city": "Paris"}')]),
    Record("parallel", LONDON + PARIS, "", [("get_time", '{"city": "London"}'),
                                            ("get_weather", '{"city": "Paris"}')]),
    _one("special_function", "{arg1:42}", '{"arg1": 42}', "integer"),
    _one("special_function", "{arg1:-7}", '{"arg1": -7}', "negative"),
    _one("amount", "{orig:3.14}", '{"orig": 3.14}', "decimal"),
    _one("amount", "{orig:1.5e10}", '{"orig": 1.5e10}', "exponent"),
    _one("toggle", "{enabled:true}", '{"enabled": true}', "true"),
    _one("toggle", "{enabled:false}", '{"enabled": false}', "false"),
    _one("set_nullable", "{value:null}", '{"value": null}', "null"),
    _one("todo_list", f"{{todos:[{Q}buy milk{Q},{Q}walk dog{Q}]}}",
         '{"todos": ["buy milk", "walk dog"]}', "array"),
    _one("set_config", f"{{config:{{theme:{Q}dark{Q},count:3}}}}",
         '{"config": {"theme": "dark", "count": 3}}', "object"),
    _one("todo_list", "{todos:[]}", '{"todos": []}', "empty_array"),
    _one("set_config", "{config:{}}", '{"config": {}}', "empty_object"),
] + [  # FreeToken's own
    Record("tool_response_after", LONDON + PARIS + "<|tool_response>", "",
           [("get_time", '{"city": "London"}'), ("get_weather", '{"city": "Paris"}')]),
    Record("text_around", "Let me check.\n" + LONDON + "\n\nDone.", "Let me check.\n\nDone.",
           [("get_time", '{"city": "London"}')]),
    Record("text_after_only", LONDON + "\n\nDone.", "Done.", [("get_time", '{"city": "London"}')]),
    _one("set_config", f"{{{Q}theme{Q}:{Q}dark{Q},{Q}a b{Q}:1}}",
         '{"theme": "dark", "a b": 1}', "delimited_keys"),
    _one("set_config", f"{{ theme : {Q}dark{Q} ,\n list : [ 1 , 2 ] , deep : {{ x : null }} }}",
         '{"theme": "dark", "list": [1, 2], "deep": {"x": null}}', "whitespace"),
    _one("set_config", f'{{note:{Q}He said "hi" \\ {{x}} [y]\n\tok{Q}}}',
         '{"note": "He said \\"hi\\" \\\\ {x} [y]\\n\\tok"}', "json_escapes"),
    _one("set_config", f"{{note:{Q}a<|b <|\"x<|\"|{Q}}}", '{"note": "a<|b <|\\"x<|\\"|"}',
         "delimiter_prefixes_in_a_string"),
    _one("get_weather", f"{{city:{Q}東京 – Zürich 🌦{Q},days:[[1],[{Q}{Q}]]}}",
         '{"city": "東京 – Zürich 🌦", "days": [[1], [""]]}', "unicode_and_nesting"),
    Record("reasoning_not_split", "<|channel>thought\nhm<channel|>" + LONDON,
           "<|channel>thought\nhm<channel|>", [("get_time", '{"city": "London"}')]),
    Record("unknown_tool_then_call", f"<|tool_call>call:rm_rf{{path:{Q}/{Q}}}<tool_call|>" + LONDON,
           f"<|tool_call>call:rm_rf{{path:{Q}/{Q}}}<tool_call|>",
           [("get_time", '{"city": "London"}')]),
    Record("no_call_prefix", "<|tool_call>get_time{}<tool_call|>",
           "<|tool_call>get_time{}<tool_call|>", []),
    Record("no_brace", "<|tool_call>call:get_time(city)<tool_call|>" + LONDON,
           "<|tool_call>call:get_time(city)<tool_call|>", [("get_time", '{"city": "London"}')]),
    # Committed arguments that break end the call there (as in every family).
    Record("bare_word", "<|tool_call>call:get_time{city:Paris}<tool_call|>",
           "Paris}<tool_call|>", [("get_time", '{"city": ')]),
    Record("trailing_comma", "<|tool_call>call:get_time{a:1,}<tool_call|>",
           "}<tool_call|>", [("get_time", '{"a": 1')]),
    Record("json_quotes", '<|tool_call>call:get_time{"city":"x"}<tool_call|>',
           '"city":"x"}<tool_call|>', [("get_time", "{")]),
    Record("no_call", "The weather is fine, <|tool_ no call.",
           "The weather is fine, <|tool_ no call.", []),
]
CASES = [pytest.param(r, id=r.id) for r in RECORDS]


@pytest.mark.parametrize("record", CASES)
def test_whole_text(record: Record) -> None:
    assert parse_text(Gemma4, TOOLS, record.text) == (record.content, record.calls)
    for _, args in record.calls:
        if args.endswith("}"):  # complete arguments are a JSON object
            assert isinstance(json.loads(args), dict)


@pytest.mark.parametrize("record", CASES)
def test_split_at_every_boundary(record: Record) -> None:
    expected = (record.content, record.calls)
    for i in range(len(record.text) + 1):
        pieces = stream(Gemma4, TOOLS, [record.text[:i], record.text[i:]])
        assert collect(pieces) == expected, i
        assert_never_taken_back(pieces, *expected)


@pytest.mark.parametrize("record", CASES)
def test_one_character_at_a_time(record: Record) -> None:
    pieces = stream(Gemma4, TOOLS, list(record.text))
    assert collect(pieces) == (record.content, record.calls)
    assert_never_taken_back(pieces, record.content, record.calls)


@pytest.mark.parametrize("record", CASES)
def test_truncated_at_every_length(record: Record) -> None:
    for n in range(len(record.text) + 1):
        parser = Gemma4(TOOLS)
        before_finish = parser.feed(record.text[:n])
        assert record.content.startswith(before_finish.content)
        _, calls = collect([before_finish, parser.finish()])
        assert len(calls) <= len(record.calls)
        for (name, args), (full_name, full_args) in zip(calls, record.calls):
            assert name == full_name and full_args.startswith(args)


def test_arguments_stream_as_they_come() -> None:
    """A call commits at its arguments' ``{`` and its string values go out as they are
    read, not at the end of the call."""
    parser = Gemma4(TOOLS)
    first = parser.feed(f"<|tool_call>call:get_time{{city:{Q}Lon")
    assert [(d.name, d.arguments) for d in first.calls] == [("get_time", '{"city": "Lon')]
    rest = parser.feed(f"don{Q}}}<tool_call|>")
    assert [(d.name, d.arguments) for d in rest.calls] == [(None, 'don"}')]


# -- the argument converter ------------------------------------------------------------


def _random_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return "".join(rng.choice('ab {}[],:"\\\n\t<|>é東🌦') for _ in range(rng.randrange(6)))
    if kind == 1:
        return rng.choice([0, -3, 12345678901234567890, 1.5, -2.5e-07, 1e100])
    if kind == 2:
        return rng.choice([True, False])
    if kind == 3:
        return None
    if kind in (4, 5):
        return {rng.choice(["a", "key_2", "x y", "ü", "k:v", "{", ""]) + str(i):
                _random_value(rng, depth + 1) for i in range(rng.randrange(4))}
    return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]


@pytest.mark.parametrize("seed", range(40))
def test_json_round_trips_through_gemmas_syntax(seed: int) -> None:
    """Any JSON object written in Gemma's syntax (``from_json``, as the model would) reads
    back (``to_json``) as the same text ``json.dumps`` writes; keys that cannot be bare go
    between delimiters."""
    rng = random.Random(seed)
    value = {f"k{i}": _random_value(rng) for i in range(rng.randrange(5))}
    text = json.dumps(value, ensure_ascii=False)
    gemma = from_json(text)
    assert to_json(gemma) == text
    assert parse_text(Gemma4, ["f"], Gemma4.render_calls([("f", text)])) == ("", [("f", text)])


@pytest.mark.parametrize("bad", [
    "", "[1]", "{a:1", "{a:1,}", "{a:Paris}", "{a:1 b:2}", "{:1}", "{a:[1,]}", "{a:01}",
    "{a:1.}", "{a:tru}", "{a:nul}", '{a:"x"}', f"{{a:{Q}x}}", "{a:1}}", "{a\nb:1}",
    f"{{{Q}a{Q} 1}}", "{a:{b:1]}", "{a:<|x|>}",
])
def test_malformed_arguments_are_errors(bad: str) -> None:
    with pytest.raises(ArgumentsSyntaxError):
        to_json(bad)


def test_from_json_refuses_what_gemma_cannot_write() -> None:
    with pytest.raises(TypeError):
        from_json("[1]")
    with pytest.raises(ValueError, match="cannot be written"):
        from_json(json.dumps({"a": f"x{Q}y"}))


# -- the family --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["google-gemma-4-31B-it.jinja",
                                  "google-gemma-4-31B-it-interleaved.jinja"])
def test_detected_from_the_real_templates(name: str) -> None:
    template = (FIXTURES / name).read_text()
    assert detect_parser(template, BUILTIN_PARSERS) is Gemma4
    assert BUILTIN_PARSERS["gemma4"] is Gemma4 and Gemma4.needs_special_tokens
