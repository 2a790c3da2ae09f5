r"""Incremental tool-call parsers: the base every model family shares (the families are in
``families.py``). This docstring is the reference.

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

The families are in ``families.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from functools import partial
from itertools import groupby
from typing import ClassVar

from freetoken_plugins.tool_calls.json_scan import (
    ARGS,
    COMMIT,
    FAIL,
    HOLD,
    WHITESPACE,
    CallReader,
)


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
