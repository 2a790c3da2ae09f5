"""The one incremental JSON scanner of the tool-call parsers, and the reader of a call object.

``JsonScanner`` validates one JSON value (RFC 8259, strict: no control characters inside
strings, no trailing commas) fed one character at a time, and reports where keys and values
begin and end, with their nesting depth. It keeps no text: offsets count the characters fed.

``CallReader`` uses it to read one call object ``{"name": ..., "arguments": {...}}``, a
character at a time, and decides when the call commits (see ``parsers.py``, whose module
docstring is the reference for the semantics).
"""

from __future__ import annotations

import json
from collections.abc import Collection

WHITESPACE = " \t\n\r"

KEY_START, KEY_END, VALUE_START, VALUE_END = "key_start", "key_end", "value_start", "value_end"
"""Event kinds. An event is ``(kind, depth, offset)``: ``depth`` counts the containers around
the key or value (a top-level value has depth 0, its members depth 1); ``offset`` is the
index of the first character for ``*_START``, one past the last character for ``*_END``."""

Event = tuple[str, int, int]


class JsonSyntaxError(ValueError):
    """The character just fed cannot continue a JSON value."""


# What the next non-whitespace character may be, outside strings, numbers and literals.
_VALUE, _VALUE_OR_CLOSE, _KEY, _KEY_OR_CLOSE, _COLON, _COMMA_OR_CLOSE, _END = range(7)

# The number grammar as a DFA: state -> {character class -> next state}.
_NUMBER = {
    "-": {"0": "0", "d": "int"},
    "0": {".": ".", "e": "e"},
    "int": {"0": "int", "d": "int", ".": ".", "e": "e"},
    ".": {"0": "frac", "d": "frac"},
    "frac": {"0": "frac", "d": "frac", "e": "e"},
    "e": {"0": "exp", "d": "exp", "+": "sign", "-": "sign"},
    "sign": {"0": "exp", "d": "exp"},
    "exp": {"0": "exp", "d": "exp"},
}
_NUMBER_ENDS = {"0", "int", "frac", "exp"}
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
_ESCAPES = set('"\\/bfnrtu')
_HEX = set("0123456789abcdefABCDEF")


def _number_class(c: str) -> str:
    if c == "0":
        return "0"
    if "1" <= c <= "9":
        return "d"
    return "e" if c in "eE" else c


class JsonScanner:
    """Validates one JSON value fed a character at a time (``push``); ``done`` once it is
    complete. A value that is a bare number is only known to end at the next character, so
    the callers here scan objects and arrays, which end on their closing character."""

    def __init__(self) -> None:
        self.pos = 0
        self.done = False
        self._stack: list[str] = []
        self._expect = _VALUE
        self._in_string = False
        self._is_key = False
        self._escape = 0  # 0: none; 1: after a backslash; 2..5: hex digits of \\u still due
        self._literal = ""  # the rest of true/false/null still due
        self._number: str | None = None

    def push(self, c: str) -> list[Event]:
        """Consumes ``c``; returns the events it caused. Raises ``JsonSyntaxError`` (and
        consumes nothing) when ``c`` cannot continue the value."""
        events: list[Event] = []
        pos = self.pos
        if self._in_string:
            self._string_char(c, events)
        elif self._literal:
            if c != self._literal[0]:
                raise JsonSyntaxError(c)
            self._literal = self._literal[1:]
            if not self._literal:
                self._end_value(pos + 1, events)
        elif self._number is not None and _number_class(c) in _NUMBER[self._number]:
            self._number = _NUMBER[self._number][_number_class(c)]
        else:
            if self._number is not None:
                if self._number not in _NUMBER_ENDS:
                    raise JsonSyntaxError(c)
                self._number = None
                self._end_value(pos, events)
            self._structural(c, events)
        self.pos = pos + 1
        return events

    def _string_char(self, c: str, events: list[Event]) -> None:
        if self._escape == 1:
            if c not in _ESCAPES:
                raise JsonSyntaxError(c)
            self._escape = 5 if c == "u" else 0
        elif self._escape:
            if c not in _HEX:
                raise JsonSyntaxError(c)
            self._escape = 0 if self._escape == 2 else self._escape - 1
        elif c == "\\":
            self._escape = 1
        elif c == '"':
            self._in_string = False
            if self._is_key:
                events.append((KEY_END, len(self._stack), self.pos + 1))
                self._expect = _COLON
            else:
                self._end_value(self.pos + 1, events)
        elif c < " ":
            raise JsonSyntaxError(c)

    def _structural(self, c: str, events: list[Event]) -> None:
        if c in WHITESPACE and self._expect != _END:
            return
        expect, pos, depth = self._expect, self.pos, len(self._stack)
        if expect in (_VALUE, _VALUE_OR_CLOSE):
            if c == "]" and expect == _VALUE_OR_CLOSE:
                self._close(events)
                return
            if c in "{[":
                events.append((VALUE_START, depth, pos))
                self._stack.append(c)
                self._expect = _KEY_OR_CLOSE if c == "{" else _VALUE_OR_CLOSE
            elif c == '"':
                events.append((VALUE_START, depth, pos))
                self._in_string, self._is_key = True, False
            elif c == "-" or "0" <= c <= "9":
                events.append((VALUE_START, depth, pos))
                self._number = "-" if c == "-" else _number_class(c).replace("d", "int")
            elif c in _LITERALS:
                events.append((VALUE_START, depth, pos))
                self._literal = _LITERALS[c]
            else:
                raise JsonSyntaxError(c)
        elif expect in (_KEY, _KEY_OR_CLOSE):
            if c == '"':
                events.append((KEY_START, depth, pos))
                self._in_string, self._is_key = True, True
            elif c == "}" and expect == _KEY_OR_CLOSE:
                self._close(events)
            else:
                raise JsonSyntaxError(c)
        elif expect == _COLON and c == ":":
            self._expect = _VALUE
        elif expect == _COMMA_OR_CLOSE and c == ",":
            self._expect = _KEY if self._stack[-1] == "{" else _VALUE
        elif expect == _COMMA_OR_CLOSE and c == ("}" if self._stack[-1] == "{" else "]"):
            self._close(events)
        else:
            raise JsonSyntaxError(c)

    def _close(self, events: list[Event]) -> None:
        self._stack.pop()
        self._end_value(self.pos + 1, events)

    def _end_value(self, end: int, events: list[Event]) -> None:
        events.append((VALUE_END, len(self._stack), end))
        if self._stack:
            self._expect = _COMMA_OR_CLOSE
        else:
            self._expect, self.done = _END, True


ARGUMENT_KEYS = ("arguments", "parameters")

HOLD, COMMIT, ARGS, SKIP, FAIL = "hold", "commit", "args", "skip", "fail"
"""What ``CallReader.push`` says of the character it was given: held back (the call is not
decided), the call commits with it (``name`` and ``take_arguments()`` make the first delta),
it is the next character of the committed call's arguments, it is markup of the committed
call (dropped), or it fails the object (not consumed; before commit the held text is not a
call, after commit the call ends there)."""


class CallReader:
    """Reads one call object, starting at its ``{``, a character at a time.

    Members at depth 1: the first ``"name"`` (a string, one of ``tool_names``) and the first
    ``"arguments"`` or ``"parameters"`` (an object, or a string holding an object's JSON
    text); other members are skipped. ``done`` once the object closed."""

    def __init__(self, tool_names: Collection[str]) -> None:
        self.tool_names = tool_names
        self.name: str | None = None
        self.committed = False
        self.done = False
        self._scanner = JsonScanner()
        self._chars: list[str] = []
        self._key: str | None = None
        self._key_start = self._value_start = 0
        self._args_start: int | None = None
        self._args_end: int | None = None
        self._args_text: str | None = None  # the decoded text of arguments given as a string

    def push(self, c: str) -> str:
        pos = self._scanner.pos
        try:
            events = self._scanner.push(c)
        except JsonSyntaxError:
            return FAIL
        self._chars.append(c)
        for kind, depth, at in events:
            if depth == 0 and kind == VALUE_END:
                self.done = True
            elif depth != 1:
                continue
            elif kind == KEY_START:
                self._key_start = at
            elif kind == KEY_END:
                self._key = json.loads(self._text(self._key_start, at))
            elif kind == VALUE_START:
                self._value_start = at
                if self._key in ARGUMENT_KEYS and self._args_start is None:
                    if c not in '{"':
                        return FAIL
                    self._args_start = at
            elif self._value_start == self._args_start and self._args_end is None:
                self._args_end = at
                if c == '"' and not self._decode_string_arguments():
                    return FAIL
            elif self._key == "name" and self.name is None:
                name = json.loads(self._text(self._value_start, at))
                if not isinstance(name, str) or name not in self.tool_names:
                    return FAIL
                self.name = name
        if self.committed:
            in_args = (self._args_text is None and self._args_start is not None
                       and pos >= self._args_start
                       and (self._args_end is None or pos < self._args_end))
            return ARGS if in_args else SKIP
        if self.name is not None and (self.done or self._args_ready()):
            self.committed = True
            return COMMIT
        return FAIL if self.done else HOLD

    def take_arguments(self) -> str:
        """The arguments text so far, for the first delta (``"{}"`` when the object closed
        without arguments)."""
        if self._args_text is not None:
            return self._args_text
        if self._args_start is None:
            return "{}"
        return self._text(self._args_start, self._args_end or len(self._chars))

    def _args_ready(self) -> bool:
        if self._args_start is None:
            return False
        if self._chars[self._args_start] == "{":
            return True
        return self._args_text is not None

    def _decode_string_arguments(self) -> bool:
        assert self._args_start is not None and self._args_end is not None
        text = json.loads(self._text(self._args_start, self._args_end)).strip()
        try:
            is_object = isinstance(json.loads(text), dict)
        except ValueError:
            return False
        self._args_text = text if is_object else None
        return is_object

    def _text(self, start: int, end: int) -> str:
        return "".join(self._chars[start:end])
