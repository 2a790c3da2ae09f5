r"""Incremental tool-call parsers, one class per model family. This docstring is the reference.

A parser reads one choice's generated text, fed in pieces split anywhere (down to single
characters), and splits it into content and calls. ``feed`` returns what the new piece
decided; ``finish`` flushes what was held back. The whole text at once (``parse_text``) is
``feed(text)`` then ``finish()``: the parser decides character by character, so a streamed
answer and a whole one give the same content and the same calls, and nothing emitted is
ever taken back.

A call (``CallDelta``): ``index`` counts this choice's calls from 0; ``name`` is set on its
first delta only; the ``arguments`` pieces of a call concatenate to the raw JSON text of its
arguments value exactly as the model wrote it (an object, starting at its ``{``).

- **Commit.** A call commits (its first delta, with ``name``, is emitted) once its name
  string is complete, the name is one of ``tool_names``, and its arguments value has
  started. The arguments key is ``"arguments"`` or ``"parameters"``, in every family. When
  the arguments come before the name, the call commits when the name is known, with the
  arguments so far. Other members of the call object (``"type"``, ``"id"``...) are skipped.
  An object that closes with a valid name and no arguments key is a call with ``"{}"``.
- **Arguments given as a string** holding an object's JSON text (``"arguments": "{\"a\":
  1}"``) are accepted: the call commits when that string closes (and the name is known),
  and its arguments are the decoded text, stripped of surrounding whitespace, in one piece.
  A string that does not hold a JSON object is a malformed call.
- **Hold back.** Before a call commits, text that may still turn out to be a call (a start
  marker and what follows it) is held back, as is a piece of text that could be the start
  of a start marker (``<tool_`` at the end of a piece). If the would-be call turns out
  malformed (not JSON, not an object, no name, a name not in ``tool_names``, arguments not
  an object), the held text goes to content verbatim, markup included, and reading goes on
  from the character that decided it: in hermes and mistral that character may start the
  next call; in llama3_json and json everything from there on is content.
- **After commit.** The arguments are emitted as they arrive. The call ends when its
  arguments value closes; the rest of the call's markup (the rest of the object, the closing
  tag, the array's ``,``/``]``, llama3's ``;``) is consumed. Unexpected text in that markup
  (and a JSON error inside committed arguments, which ends the call there) is read as text
  after the call: content, or the start of another call.
- **Truncation.** Text that ends inside a committed call leaves the call as emitted (the
  caller reports ``finish_reason: "length"``); text held for a call that never committed is
  flushed as content by ``finish``.
- **Whitespace.** Whitespace (space, tab, newline, carriage return) directly before a
  call's start markup, and whitespace inside the markup (``<tool_call>\n{`` ...
  ``}\n</tool_call>``, around ``;`` ``,`` ``[`` ``]``), belongs to the call. Whitespace
  directly after a call is content only when content came before the call and text (not
  another call, not the end) follows: ``A\n<call>\n\nB`` gives ``A\n\nB``,
  ``<call>\n\nB`` gives ``B``, and whitespace between calls is no content. Content's
  trailing whitespace is held until the next character (or ``finish``) decides it. Without
  a call, content is the text verbatim.
- Content never contains markup of a call that committed.

Families (``BUILTIN_PARSERS``; third parties add one with an entry point of the
``freetoken.tool_parsers`` group, ``name = "pkg.module:Class"``):

- ``hermes`` (Hermes 2 Pro, Qwen2.5, Qwen3): ``<tool_call>`` JSON object ``</tool_call>``,
  any number, text around them is content. A final call whose ``</tool_call>`` is missing
  but whose object is complete is still a call.
- ``llama3_json`` (Llama 3.1/3.2/3.3 JSON tool calling): after optional whitespace and an
  optional ``<|python_tag|>``, one or more call objects separated by ``;``. Output that does
  not start that way is all content; so is anything after the last call.
- ``mistral``: text before ``[TOOL_CALLS]`` is content. After it, either a JSON array of
  call objects (tokenizers before v11) or ``name[ARGS]{arguments}`` (v11 and later; the
  ``[ARGS]`` may be missing), each call after its own ``[TOOL_CALLS]``. ``[TOOL_CALLS]`` and
  ``[ARGS]`` are special tokens: decode with ``skip_special_tokens=False``.
- ``json`` (generic; also what ``tool_choice: "required"`` produces): after optional
  whitespace, a call object or a JSON array of them; otherwise all content. It may be fenced
  as Markdown code: an opening ```` ``` ```` plus an optional language word (```` ```json ````)
  before the JSON, and a closing ```` ``` ```` after it, both markup.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from functools import partial
from importlib import metadata
from itertools import groupby
from typing import ClassVar

from freetoken_plugins.tool_calls.json_scan import (
    ARGS,
    COMMIT,
    FAIL,
    HOLD,
    WHITESPACE,
    CallReader,
    JsonScanner,
    JsonSyntaxError,
)

log = logging.getLogger("freetoken.tool_calls")

ENTRY_POINT_GROUP = "freetoken.tool_parsers"


@dataclass(frozen=True)
class CallDelta:
    index: int
    """The call's position among this choice's calls, from 0."""
    name: str | None
    """Set on the call's first delta only."""
    arguments: str
    """The next piece of the call's arguments text."""


@dataclass
class Parsed:
    content: str = ""
    """Text outside calls, decided so far."""
    calls: list[CallDelta] = field(default_factory=list)


State = Callable[[str], bool]
"""A parser state: reads one character; False when it did not consume it (the state changed
and the character is read again)."""


class ToolParser:
    """Incremental parser of one choice's generated text (the semantics: module docstring).

    Subclasses are state machines over characters: ``_start`` is the first state; a state
    returns whether it consumed the character. The shared states here read call objects
    (``_expect_object``/``_in_call``), arrays of them, and plain content."""

    name: ClassVar[str]
    template_markers: ClassVar[tuple[str, ...]] = ()
    """Substrings of a chat template that select this family in auto mode."""
    needs_special_tokens: ClassVar[bool] = False
    """Its markup is a special token that ``skip_special_tokens`` would remove."""
    EXAMPLE: ClassVar[list[tuple[str, str]]] = [("get_weather", '{"city": "Paris"}')]

    def __init__(self, tool_names: Collection[str]) -> None:
        self.tool_names = frozenset(tool_names)
        self._state: State = self._start
        self._resume: State = self._content_only
        """Where reading goes on after a malformed call."""
        self._after_call: State = self._trailing_whitespace
        self._after_array: State = self._trailing_whitespace
        self._held = ""
        """Text that becomes content unless a call commits."""
        self._gap = ""
        """Whitespace after a call: content only if content came before and text follows."""
        self._has_content = False
        self._matched = 0
        """Characters of the markup being matched (in ``_held`` only before a commit)."""
        self._reader: CallReader | None = None
        self._num_calls = 0
        self._content: list[str] = []
        self._deltas: list[tuple[int, str | None, str]] = []
        self._todo = ""
        self._at = 0

    def feed(self, text: str) -> Parsed:
        self._todo, self._at = text, 0
        while self._at < len(self._todo):
            if self._state(self._todo[self._at]):
                self._at += 1
        return self._take()

    def finish(self) -> Parsed:
        self._emit(self._held)
        self._held = self._gap = ""
        self._state = self._content_only
        return self._take()

    @classmethod
    def instructions(cls) -> str:
        """How to write a call in this family, with one example (for a generic tool prompt;
        the caller adds the tool list)."""
        raise NotImplementedError

    @classmethod
    def render_calls(cls, calls: list[tuple[str, str]]) -> str:
        """The text the model would have written for ``(name, arguments JSON)`` calls."""
        raise NotImplementedError

    def _start(self, c: str) -> bool:
        raise NotImplementedError

    # -- output --

    def _take(self) -> Parsed:
        calls = []
        for index, group in groupby(self._deltas, key=lambda d: d[0]):
            pieces = list(group)
            calls.append(CallDelta(index, pieces[0][1], "".join(p[2] for p in pieces)))
        parsed = Parsed("".join(self._content), calls)
        self._content, self._deltas = [], []
        return parsed

    def _emit(self, text: str) -> None:
        if text:
            self._content.append(text)
            self._has_content = True

    def _reread(self, text: str) -> bool:
        """Puts ``text`` back before the current character; returns False (not consumed)."""
        self._todo, self._at = text + self._todo[self._at:], 0
        return False

    def _fail(self) -> bool:
        """The held text is not a call: it goes to content; the current character is read
        again in the resume state."""
        self._emit(self._held)
        self._held, self._matched, self._reader = "", 0, None
        self._state = self._resume
        return False

    # -- shared states --

    def _content_only(self, c: str) -> bool:
        self._emit(self._held + c)
        self._held = ""
        return True

    def _scan(self, c: str, marker: str, found: State) -> bool:
        """Free text, looking for ``marker`` (held while it may be its start, with the
        whitespace before it)."""
        if c == marker[self._matched]:
            self._held += c
            self._matched += 1
            if self._matched == len(marker):
                self._matched, self._state = 0, found
            return True
        if self._matched:
            # Not the marker after all: its first character is content, the rest is re-read.
            prefix, self._matched = self._held[-self._matched:], 0
            self._emit(self._held[: -len(prefix)] + prefix[0])
            self._held = ""
            return self._reread(prefix[1:])
        if c in WHITESPACE:
            self._held += c
        else:
            self._emit(self._held + c)
            self._held = ""
        return True

    def _match_markup(self, c: str, marker: str, then: State) -> bool:
        """Markup of a committed call (dropped); on a mismatch, what was matched is re-read
        as text after the call."""
        if c == marker[self._matched]:
            self._matched += 1
            if self._matched == len(marker):
                self._matched, self._state = 0, then
            return True
        prefix, self._matched = marker[: self._matched], 0
        self._state = self._resume
        return self._reread(prefix)

    def _match_held(self, c: str, marker: str, then: State) -> bool:
        """Markup of a call not committed yet (held); a mismatch fails the call."""
        if c != marker[self._matched]:
            return self._fail()
        self._held += c
        self._matched += 1
        if self._matched == len(marker):
            self._matched, self._state = 0, then
        else:
            self._state = partial(self._match_held, marker=marker, then=then)
        return True

    def _trailing_whitespace(self, c: str) -> bool:
        """Directly after a call: whitespace is held apart; the next character is read in
        the resume state, the whitespace before it as if it had come before any call when
        content came before (so it separates that content from what follows), else dropped.
        """
        if c in WHITESPACE:
            self._gap += c
            return True
        self._held = self._gap if self._has_content else ""
        self._gap = ""
        self._state = self._resume
        return False

    def _expect_object(self, c: str) -> bool:
        """Held whitespace, then the ``{`` of a call object."""
        if c in WHITESPACE:
            self._held += c
            return True
        if c != "{":
            return self._fail()
        self._reader = CallReader(self.tool_names)
        self._state = self._in_call
        return self._in_call(c)

    def _in_call(self, c: str) -> bool:
        reader = self._reader
        assert reader is not None
        status = reader.push(c)
        if status == FAIL:
            if not reader.committed:
                return self._fail()
            self._reader, self._state = None, self._after_call
            return False
        if status == HOLD:
            self._held += c
        elif status == COMMIT:
            self._held = ""
            self._deltas.append((self._num_calls, reader.name, reader.take_arguments()))
            self._num_calls += 1
        elif status == ARGS:
            self._deltas.append((self._num_calls - 1, None, c))
        if reader.done:
            self._reader, self._state = None, self._after_call
        return True

    def _array_open(self, c: str) -> bool:
        """After the ``[`` of an array of calls (held): its first call object."""
        self._after_call = self._array_after
        return self._expect_object(c)

    def _array_after(self, c: str) -> bool:
        """After a call in an array: ``,`` and the next call (held), or ``]``; anything else
        is read in the resume state."""
        if c in WHITESPACE:
            return True
        if c == ",":
            self._held = c
            self._state = self._array_open
        elif c == "]":
            self._state = self._after_array
        else:
            self._state = self._resume
            return False
        return True


class Hermes(ToolParser):
    """Hermes 2 Pro / Qwen2.5 / Qwen3: ``<tool_call>\\n{...}\\n</tool_call>``."""

    name = "hermes"
    template_markers = ("<tool_call>",)
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, tool_names: Collection[str]) -> None:
        super().__init__(tool_names)
        self._resume = self._start
        self._after_call = self._close_tag

    def _start(self, c: str) -> bool:
        return self._scan(c, self.START, self._expect_object)

    def _close_tag(self, c: str) -> bool:
        if c in WHITESPACE and not self._matched:
            return True
        return self._match_markup(c, self.END, self._trailing_whitespace)

    @classmethod
    def instructions(cls) -> str:
        return ("To call a function, write a JSON object with its name and arguments inside "
                "<tool_call></tool_call> tags, one pair of tags per call:\n"
                + cls.render_calls(cls.EXAMPLE))

    @classmethod
    def render_calls(cls, calls: list[tuple[str, str]]) -> str:
        return "\n".join(f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {args}}}'
                         "\n</tool_call>" for name, args in calls)


class Llama3Json(ToolParser):
    """Llama 3.1/3.2/3.3 JSON tool calling: ``<|python_tag|>{"name": ..., "parameters":
    {...}}; {...}``. The markers are texts of the Llama 3.1/3.3 template (``<|python_tag|>``)
    and of every Llama 3.x template with tools (``Environment: ipython``)."""

    name = "llama3_json"
    template_markers = ("<|python_tag|>", "Environment: ipython")
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self, tool_names: Collection[str]) -> None:
        super().__init__(tool_names)
        self._after_call = self._separator

    def _start(self, c: str) -> bool:
        if c == self.PYTHON_TAG[0]:
            return self._match_held(c, self.PYTHON_TAG, self._expect_object)
        return self._expect_object(c)

    def _separator(self, c: str) -> bool:
        """After a call: whitespace (markup), then ``;`` and the next call (held)."""
        if c in WHITESPACE:
            return True
        if c != ";":
            self._state = self._resume
            return False
        self._held = c
        self._state = self._expect_object
        return True

    @classmethod
    def instructions(cls) -> str:
        return ('To call a function, answer with only a JSON object {"name": function name, '
                '"parameters": object of argument names and values}; separate several calls '
                "with ;\n" + cls.render_calls(cls.EXAMPLE))

    @classmethod
    def render_calls(cls, calls: list[tuple[str, str]]) -> str:
        return "; ".join(f'{{"name": {json.dumps(name)}, "parameters": {args}}}'
                         for name, args in calls)


class Mistral(ToolParser):
    """Mistral: ``[TOOL_CALLS][{...}, ...]`` (before v11) or ``[TOOL_CALLS]name[ARGS]{...}``
    per call (v11 and later)."""

    name = "mistral"
    template_markers = ("[TOOL_CALLS]", "[AVAILABLE_TOOLS]")
    needs_special_tokens = True
    START, ARGS_TAG = "[TOOL_CALLS]", "[ARGS]"

    def __init__(self, tool_names: Collection[str]) -> None:
        super().__init__(tool_names)
        self._resume = self._start
        self._name = ""
        self._scanner = JsonScanner()

    def _start(self, c: str) -> bool:
        return self._scan(c, self.START, self._after_marker)

    def _after_marker(self, c: str) -> bool:
        if c in WHITESPACE:
            self._held += c
            return True
        if c == "[":
            self._held += c
            self._state = self._array_open
            return True
        if c == "{":
            self._after_call = self._trailing_whitespace
            return self._expect_object(c)
        self._name = ""
        self._state = self._name_chars
        return self._name_chars(c)

    def _name_chars(self, c: str) -> bool:
        if c.isalnum() or c in "_-.":
            self._held += c
            self._name += c
            return True
        if c == "[" and self._name:
            return self._match_held(c, self.ARGS_TAG, self._open_arguments)
        return self._open_arguments(c)

    def _open_arguments(self, c: str) -> bool:
        if c != "{" or self._name not in self.tool_names:
            return self._fail()
        self._held = ""
        self._scanner = JsonScanner()
        self._state = self._arguments
        self._num_calls += 1
        self._deltas.append((self._num_calls - 1, self._name, ""))
        return self._arguments(c)

    def _arguments(self, c: str) -> bool:
        try:
            self._scanner.push(c)
        except JsonSyntaxError:
            self._state = self._trailing_whitespace
            return False
        self._deltas.append((self._num_calls - 1, None, c))
        if self._scanner.done:
            self._state = self._trailing_whitespace
        return True

    @classmethod
    def instructions(cls) -> str:
        return ("To call a function, write [TOOL_CALLS], its name, [ARGS] and its arguments "
                "as a JSON object; start each call with [TOOL_CALLS]:\n"
                + cls.render_calls(cls.EXAMPLE))

    @classmethod
    def render_calls(cls, calls: list[tuple[str, str]]) -> str:
        return "".join(f"{cls.START}{name}{cls.ARGS_TAG}{args}" for name, args in calls)


class Json(ToolParser):
    """Generic JSON: a call object or an array of them, optionally in a Markdown fence."""

    name = "json"
    FENCE = "```"

    def __init__(self, tool_names: Collection[str]) -> None:
        super().__init__(tool_names)
        self._is_fenced = False

    def _start(self, c: str) -> bool:
        if c == self.FENCE[0] and not self._is_fenced:
            self._is_fenced = True
            return self._match_held(c, self.FENCE, self._language)
        if c == "[":
            self._held += c
            self._state = self._array_open
            return True
        return self._expect_object(c)

    def _language(self, c: str) -> bool:
        """After the opening fence: an optional language word (held)."""
        if c.isalpha():
            self._held += c
            return True
        self._after_call = self._after_array = self._closing_fence
        self._state = self._start
        return False

    def _closing_fence(self, c: str) -> bool:
        if c in WHITESPACE and not self._matched:
            return True
        return self._match_markup(c, self.FENCE, self._trailing_whitespace)

    @classmethod
    def instructions(cls) -> str:
        return ("To call functions, answer with only a JSON array of calls, each an object "
                'with the function\'s "name" and its "arguments" object:\n'
                + cls.render_calls(cls.EXAMPLE))

    @classmethod
    def render_calls(cls, calls: list[tuple[str, str]]) -> str:
        return "[" + ", ".join(f'{{"name": {json.dumps(name)}, "arguments": {args}}}'
                               for name, args in calls) + "]"


BUILTIN_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (Hermes, Llama3Json, Mistral, Json)
}


def parse_text(parser: type[ToolParser], tool_names: Collection[str],
               text: str) -> tuple[str, list[tuple[str, str]]]:
    """The whole text at once: ``(content, [(name, arguments), ...])``, which is
    ``feed(text)`` then ``finish()``, merged."""
    instance = parser(tool_names)
    first, last = instance.feed(text), instance.finish()
    calls: list[tuple[str, str]] = []
    for delta in first.calls + last.calls:
        if delta.name is not None:
            calls.append((delta.name, delta.arguments))
        else:
            calls[delta.index] = (calls[delta.index][0], calls[delta.index][1] + delta.arguments)
    return first.content + last.content, calls


def available_parsers() -> dict[str, type[ToolParser]]:
    """The built-in families and those of installed entry points of ``ENTRY_POINT_GROUP``
    (``name = "pkg.module:Class"``). One that fails to load, or is no ``ToolParser``, is
    skipped with a warning; a name of a built-in raises ``ValueError``."""
    parsers = dict(BUILTIN_PARSERS)
    for entry_point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry_point.name in BUILTIN_PARSERS:
            raise ValueError(f"tool parser {entry_point.name!r} of {entry_point.value!r} "
                             "clashes with the built-in family of that name")
        try:
            parser = entry_point.load()
        except Exception:  # a broken third-party package must not stop the server
            log.warning("tool parser %r (%s) failed to load; skipped", entry_point.name,
                        entry_point.value, exc_info=True)
            continue
        if not (isinstance(parser, type) and issubclass(parser, ToolParser)):
            log.warning("tool parser %r (%s) is not a ToolParser class; skipped",
                        entry_point.name, entry_point.value)
            continue
        parsers[entry_point.name] = parser
    return parsers


def detect_parser(chat_template: str | None,
                  parsers: dict[str, type[ToolParser]]) -> type[ToolParser]:
    """The first family whose ``template_markers`` occur in ``chat_template``; else hermes
    (the format of the generic tool prompt)."""
    for parser in parsers.values():
        if chat_template and any(m in chat_template for m in parser.template_markers):
            return parser
    return parsers["hermes"]
