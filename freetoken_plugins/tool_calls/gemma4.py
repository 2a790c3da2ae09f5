r"""The ``gemma4`` tool-call family (Google's Gemma 4): ``<|tool_call>call:NAME{arguments}
<tool_call|>``, any number, text around them is content; after its calls the model writes
``<|tool_response>`` (an end-of-generation token), which belongs to the calls' markup.

The arguments are Gemma's own syntax, which the chat template's ``format_argument`` macro
writes and llama.cpp's gemma4 parser reads: an object ``{key:value,...}`` whose keys are
bare (or, as in the template's tool declarations, between ``<|"|>`` delimiters), strings
between ``<|"|>`` delimiters (no escapes: the text between them is the string), nested
objects and arrays ``[a,b]``, JSON numbers, ``true``, ``false`` and ``null``; whitespace
between tokens is allowed. ``ArgumentsReader`` converts them, a character at a time, to
the JSON text OpenAI's ``function.arguments`` holds (``{"city": "Paris", "days": [1, 2]}``:
``json.dumps``'s separators, strings escaped as JSON, numbers as written).

The semantics every family shares (``parsers.py``) hold, with the JSON of the arguments
being the converted text: the call commits at its arguments' ``{`` once its name is one of
the tools; before that, markup that turns out malformed (``<|tool_call>`` not followed by
``call:``, a name not among the tools, no ``{``) is content verbatim; an error in committed
arguments (a trailing comma, a bare word, an unclosed delimiter before ``}``…) ends the call
there and the rest is text after the call. The markers are special tokens: decode with
``skip_special_tokens=False`` (the family's ``needs_special_tokens``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from typing import Any

from freetoken_plugins.gemma4 import (
    CALL_PREFIX,
    STRING_DELIMITER,
    TEMPLATE_MARKER,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_RESPONSE_OPEN,
)
from freetoken_plugins.tool_calls.json_scan import WHITESPACE
from freetoken_plugins.tool_calls.parsers import ToolParser


class ArgumentsSyntaxError(ValueError):
    """The character just pushed cannot continue Gemma 4 arguments."""


_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?\Z")
_LITERALS = ("true", "false", "null")
_BARE_START = set("-0123456789tfn")
_BARE_CHARS = set("-+.0123456789eEtruefalsn")
_NOT_IN_KEY = set("{}[],:\"") | set(WHITESPACE)
# What comes next outside strings and bare tokens.
_TOP, _KEY_OR_CLOSE, _KEY, _COLON, _VALUE, _VALUE_OR_CLOSE, _COMMA_OR_CLOSE, _DONE = range(8)


def _escaped(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


class ArgumentsReader:
    """Gemma 4 arguments (an object) fed a character at a time → pieces of their JSON text.

    ``push(c)`` returns the JSON text ``c`` decided (often ``""``: a string's ``<|"`` may
    be its end, a number goes out whole); ``done`` once the object closed. Raises
    ``ArgumentsSyntaxError`` when ``c`` cannot continue the arguments. The pieces so far
    are always a prefix of the whole text."""

    def __init__(self) -> None:
        self.done = False
        self._stack: list[str] = []
        self._expect = _TOP
        self._separator = ""
        """``", "`` after a comma: written once the next member begins (none before ``}``)."""
        self._string: str | None = None
        """Inside a string: ``"value"`` or ``"key"``; ``None`` outside."""
        self._delimiter = 0
        """Characters of a ``<|"|>`` matched so far."""
        self._bare = ""
        """A bare key, number or literal being read."""
        self._in_bare_key = False

    def push(self, c: str) -> str:
        if self.done:
            raise ArgumentsSyntaxError("text after the arguments' closing brace")
        if self._delimiter or (c == STRING_DELIMITER[0] and self._string is not None):
            return self._delimiter_char(c)
        if self._string is not None:
            return self._string_char(c)
        if self._in_bare_key:
            return self._bare_key_char(c)
        if self._bare:
            if c in _BARE_CHARS:
                self._bare += c
                return ""
            return self._end_bare() + self._structure(c)
        return self._structure(c)

    # -- strings and keys --

    def _delimiter_char(self, c: str) -> str:
        if c == STRING_DELIMITER[self._delimiter]:
            self._delimiter += 1
            if self._delimiter < len(STRING_DELIMITER):
                return ""
            self._delimiter = 0
            return self._delimited()
        if self._string is None:
            raise ArgumentsSyntaxError(f"{STRING_DELIMITER} expected")
        matched, self._delimiter = STRING_DELIMITER[:self._delimiter], 0
        return _escaped(matched) + self.push(c)  # ``<`` may begin the delimiter again

    def _delimited(self) -> str:
        """A whole ``<|"|>``: a string opens or closes."""
        if self._string is None:
            if self._expect in (_KEY, _KEY_OR_CLOSE):
                self._string, self._bare = "key", ""
                return ""
            self._string = "value"
            return self._take_separator() + '"'
        if self._string == "key":
            self._string, self._expect = None, _COLON
            key, self._bare = self._bare, ""
            return self._take_separator() + json.dumps(key, ensure_ascii=False)
        self._string, self._expect = None, _COMMA_OR_CLOSE
        return '"'

    def _string_char(self, c: str) -> str:
        if self._string == "key":
            self._bare += c
            return ""
        return _escaped(c)

    def _bare_key_char(self, c: str) -> str:
        if c == ":":
            self._in_bare_key, self._expect = False, _VALUE
            key, self._bare = self._bare.rstrip(WHITESPACE), ""
            return self._take_separator() + json.dumps(key, ensure_ascii=False) + ": "
        if c in _NOT_IN_KEY and c not in " \t":
            raise ArgumentsSyntaxError(f"{c!r} in a key (a key ends at ':')")
        self._bare += c
        return ""

    # -- the rest --

    def _take_separator(self) -> str:
        separator, self._separator = self._separator, ""
        return separator

    def _end_bare(self) -> str:
        token, self._bare = self._bare, ""
        if token not in _LITERALS and not _NUMBER.match(token):
            raise ArgumentsSyntaxError(f"{token!r} is no number, true, false or null "
                                       f"(strings go between {STRING_DELIMITER})")
        self._expect = _COMMA_OR_CLOSE
        return self._take_separator() + token

    def _open(self, c: str) -> str:
        self._stack.append(c)
        self._expect = _KEY_OR_CLOSE if c == "{" else _VALUE_OR_CLOSE
        return self._take_separator() + c

    def _close(self, c: str) -> str:
        if not self._stack or {"{": "}", "[": "]"}[self._stack[-1]] != c:
            raise ArgumentsSyntaxError(f"unexpected {c!r}")
        self._stack.pop()
        self._expect = _COMMA_OR_CLOSE if self._stack else _DONE
        self.done = not self._stack
        return c

    def _structure(self, c: str) -> str:
        expect = self._expect
        if c in WHITESPACE and expect != _DONE:
            return ""
        if expect == _TOP:
            if c != "{":
                raise ArgumentsSyntaxError("the arguments are an object: '{' expected")
            return self._open(c)
        if expect in (_KEY, _KEY_OR_CLOSE):
            if c == "}" and expect == _KEY_OR_CLOSE:
                return self._close(c)
            if c == STRING_DELIMITER[0]:
                return self._delimiter_char(c)
            if c in _NOT_IN_KEY:
                raise ArgumentsSyntaxError(f"a key expected, not {c!r}")
            self._in_bare_key, self._bare = True, c
            return ""
        if expect == _COLON:
            if c != ":":
                raise ArgumentsSyntaxError("':' expected after a key")
            self._expect = _VALUE
            return ": "
        if expect in (_VALUE, _VALUE_OR_CLOSE):
            if c == "]" and expect == _VALUE_OR_CLOSE:
                return self._close(c)
            if c in "{[":
                return self._open(c)
            if c == STRING_DELIMITER[0]:
                return self._delimiter_char(c)
            if c not in _BARE_START:
                raise ArgumentsSyntaxError(f"a value expected, not {c!r} (strings go "
                                           f"between {STRING_DELIMITER})")
            self._bare = c
            return ""
        if expect == _COMMA_OR_CLOSE:
            if c == ",":
                self._separator = ", "
                self._expect = _KEY if self._stack[-1] == "{" else _VALUE
                return ""
            if c in "}]":
                return self._close(c)
            raise ArgumentsSyntaxError(f"',' or a closing bracket expected, not {c!r}")
        raise ArgumentsSyntaxError("text after the arguments' closing brace")


def to_json(arguments: str) -> str:
    """Whole Gemma 4 arguments → their JSON text (``ArgumentsSyntaxError`` when they are not
    exactly one object)."""
    reader, out = ArgumentsReader(), []
    for c in arguments.strip(WHITESPACE):
        out.append(reader.push(c))
    if not reader.done:
        raise ArgumentsSyntaxError("the arguments end before their closing brace")
    return "".join(out)


class _Number(str):
    """A JSON number's text, kept as written."""


def _gemma(value: Any) -> str:
    if isinstance(value, str) and not isinstance(value, _Number):
        if STRING_DELIMITER in value:
            raise ValueError(f"a string holding {STRING_DELIMITER} cannot be written in "
                             "Gemma 4's syntax")
        return STRING_DELIMITER + value + STRING_DELIMITER
    if isinstance(value, _Number):
        return str(value)
    if value is True or value is False or value is None:
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ",".join(_gemma(v) for v in value) + "]"
    assert isinstance(value, tuple)  # an object: its members, in order
    return "{" + ",".join(f"{_key(k)}:{_gemma(v)}" for k, v in value) + "}"


def _key(key: str) -> str:
    plain = key and key == key.strip(WHITESPACE) and not set(key) & _NOT_IN_KEY
    return key if plain and STRING_DELIMITER[0] not in key else _gemma(key)


def from_json(arguments: str) -> str:
    """JSON arguments (an object's text) → Gemma 4's syntax, members in their order, numbers
    as written (what the model would have written; the template sorts the keys)."""
    value = json.loads(arguments, object_pairs_hook=tuple, parse_float=_Number,
                       parse_int=_Number)
    if not isinstance(value, tuple):
        raise TypeError("the arguments are not a JSON object")
    return _gemma(value)


class Gemma4(ToolParser):
    """Gemma 4: ``<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>``."""

    name = "gemma4"
    template_markers = (TEMPLATE_MARKER,)
    needs_special_tokens = True
    NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")

    def __init__(self, tool_names: Collection[str]) -> None:
        super().__init__(tool_names)
        self._resume = self._start
        self._name = ""
        self._arguments_reader = ArgumentsReader()

    def _start(self, c: str) -> bool:
        return self._scan(c, TOOL_CALL_OPEN, self._call_prefix)

    def _call_prefix(self, c: str) -> bool:
        self._name = ""
        return self._match_held(c, CALL_PREFIX, self._name_chars)

    def _name_chars(self, c: str) -> bool:
        if c in self.NAME_CHARS:
            self._held += c
            self._name += c
            return True
        if c != "{" or self._name not in self.tool_names:
            return self._fail()
        self._held = ""
        self._arguments_reader = ArgumentsReader()
        self._deltas.append((self._num_calls, self._name, ""))
        self._num_calls += 1
        self._state = self._arguments
        return self._arguments(c)

    def _arguments(self, c: str) -> bool:
        try:
            piece = self._arguments_reader.push(c)
        except ArgumentsSyntaxError:
            self._state = self._trailing_whitespace  # the call ends; c is text after it
            return False
        if piece:
            self._deltas.append((self._num_calls - 1, None, piece))
        if self._arguments_reader.done:
            self._state = self._close_tag
        return True

    def _close_tag(self, c: str) -> bool:
        if c in WHITESPACE and not self._matched:
            return True
        return self._match_markup(c, TOOL_CALL_CLOSE, self._tool_response)

    def _tool_response(self, c: str) -> bool:
        """Directly after ``<tool_call|>``: the ``<|tool_response>`` the model ends with."""
        if c == TOOL_RESPONSE_OPEN[0] or self._matched:
            return self._match_markup(c, TOOL_RESPONSE_OPEN, self._trailing_whitespace)
        self._state = self._trailing_whitespace
        return False

    @classmethod
    def instructions(cls) -> str:
        return (f"To call a function, write {TOOL_CALL_OPEN}{CALL_PREFIX}, its name, its "
                f"arguments as {{key:value,...}} and {TOOL_CALL_CLOSE}, one per call; keys "
                f"are bare, strings go between {STRING_DELIMITER} and {STRING_DELIMITER}, "
                "numbers, true, false, null, {...} and [...] as in JSON:\n"
                + cls.render_calls(cls.EXAMPLE))

    @classmethod
    def render_calls(cls, calls: list[tuple[str, str]]) -> str:
        return "".join(f"{TOOL_CALL_OPEN}{CALL_PREFIX}{name}{from_json(args)}{TOOL_CALL_CLOSE}"
                       for name, args in calls)


OPENAI_TOOL_MESSAGES = "{#- OpenAI Chat Completions:"
"""In Gemma 4's current template: the comment of the loop that reads ``role: "tool"``
messages. The earlier (interleaved) template lacks it and reads an assistant message's
``tool_responses`` only (llama.cpp tells the two apart by this comment too)."""


def reads_tool_responses_only(template: str) -> bool:
    """Whether ``template`` is a Gemma 4 template that reads tool results only as the
    calling message's ``tool_responses``."""
    return TEMPLATE_MARKER in template and OPENAI_TOOL_MESSAGES not in template


def tool_responses_in_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For such a template, as llama.cpp's ``convert_tool_responses_gemma4`` does: each
    assistant message with ``tool_calls`` takes the ``tool`` messages after it as its
    ``tool_responses`` (``{"name": the answered call's function, "response": the content,
    decoded when it is JSON}``), and the assistant message after them, when it has content
    and no calls, as its ``content``: one model turn."""
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(messages):
        message = messages[i]
        i += 1
        out.append(message)
        if message["role"] != "assistant" or not message.get("tool_calls"):
            continue
        names = {c.get("id"): c["function"]["name"] for c in message["tool_calls"]}
        responses = []
        while i < len(messages) and messages[i]["role"] == "tool":
            result = messages[i]
            responses.append({"name": names.get(result.get("tool_call_id"),
                                                result.get("tool_call_id")),
                              "response": _response(result.get("content"))})
            i += 1
        if responses:
            message["tool_responses"] = responses
        if (i < len(messages) and messages[i]["role"] == "assistant"
                and not messages[i].get("tool_calls") and messages[i].get("content")):
            message["content"] = messages[i]["content"]
            i += 1
    return out


def _response(content: Any) -> Any:
    if isinstance(content, list):  # text parts
        content = "".join(part.get("text") or "" for part in content)
    if isinstance(content, str):
        try:
            return json.loads(content)
        except ValueError:
            return content
    return content
