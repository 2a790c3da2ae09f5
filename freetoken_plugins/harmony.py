"""The harmony format of OpenAI's gpt-oss models, read from an answer decoded with its special
tokens: shared by the reasoning plugin (which splits the channels) and the tool_calls
plugin's ``harmony`` family (which reads the calls). Not a plugin itself.

An answer is a run of messages; each is a header, ``<|message|>``, a body and an end::

    <|channel|>analysis<|message|>Let me think.<|end|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>

- The prompt ends with ``<|start|>assistant``, so the first header is what the model writes
  after the role: ``<|channel|>…``, or `` to=functions.NAME<|channel|>…`` (the recipient
  may come before the channel, as chat templates render earlier calls). Later messages
  open with ``<|start|>``, or with ``<|channel|>`` straight after an end.
- The header's *channel* is the word after ``<|channel|>``; its *recipient* the ``to=X``
  in it (before or after the channel); ``<|constrain|>json`` is the body's format.
- A body ends at ``<|end|>``, ``<|return|>`` (the answer's end) or ``<|call|>`` (a call's
  end), or where the next message opens (``<|start|>``, ``<|channel|>``).

Markers are recognised in the text as ``<|name|>`` strings the caller accepts (the
vocabulary's special tokens); a piece of text that may be the start of one is held back
until the next piece decides it, so text fed in pieces splits exactly as the whole.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
MARKERS = frozenset({START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL})
REQUIRED_TOKENS = (CHANNEL, MESSAGE, END, START)
"""A vocabulary speaks harmony when it has these as whole tokens."""
ENDS = frozenset({END, RETURN, CALL})
OPENS = frozenset({START, CHANNEL})
"""Markers that open a message even inside another message's body (its end was left out)."""
RECIPIENT_FIRST = " to="
"""How a first header that names its recipient before the channel begins."""

REASONING, CONTENT, RAW = "reasoning", "content", "raw"
"""Where a message's body goes: the analysis channel is reasoning; a message addressed to
a recipient (a call) is passed on raw, markup included, for a tool parser; any other
message (final, commentary to the user, no channel) is content."""

_MARKER = re.compile(r"<\|[A-Za-z0-9_]{1,62}\|>")
_PARTIAL = re.compile(r"<(?:\|[A-Za-z0-9_]{0,62}\|?)?\Z")
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"(?:^|[\s>])to=([^\s<]+)")


def parse_header(header: str) -> tuple[str | None, str | None]:
    """``(channel, recipient)`` of a message header (markers included); ``None`` for what
    it does not name."""
    channel = _CHANNEL.search(header)
    recipient = _RECIPIENT.search(header)
    return (channel.group(1) if channel else None), (recipient.group(1) if recipient else None)


class MarkerLexer:
    """Text fed in pieces → ``(is_marker, text)`` events: each ``<|name|>`` that
    ``is_marker`` accepts is one event, the text between them another. A piece's end that
    may begin a marker (``<|cha``) is held until the next piece (``final``: nothing held)."""

    def __init__(self, is_marker: Callable[[str], bool]) -> None:
        self.is_marker = is_marker
        self.held = ""

    def feed(self, text: str, final: bool = False) -> list[tuple[bool, str]]:
        text, self.held = self.held + text, ""
        events: list[tuple[bool, str]] = []
        at = 0
        for match in _MARKER.finditer(text):
            if not self.is_marker(match.group()):
                continue
            if match.start() > at:
                events.append((False, text[at:match.start()]))
            events.append((True, match.group()))
            at = match.end()
        rest = text[at:]
        partial = None if final else _PARTIAL.search(rest)
        if partial is not None:
            rest, self.held = rest[:partial.start()], rest[partial.start():]
        if rest:
            events.append((False, rest))
        return events


_ANSWER_START, _BETWEEN, _HEADER, _BODY = range(4)


class HarmonySplitter:
    """Splits one choice's answer, fed in pieces, into ``(reasoning, content)`` pieces.

    - An analysis message's body is reasoning; a final or commentary message's body (and
      text written without any header) is content; the headers, ends and every other
      marker are neither. Bodies of several messages are joined as they come.
    - A message with a recipient (``to=functions.get_weather``) goes to content raw, from
      its first marker to its end marker, for a tool parser to read.
    - ``prompt_tail`` (the prompt's text from its last ``<|start|>``, markers included)
      says where the answer starts: after ``<|start|>assistant`` (the usual), inside a
      header the prompt opened, or inside a body (a continued message).
    - ``has_reasoned``: an analysis message was opened (in the answer or the prompt's tail).
    - A header cut off before its ``<|message|>`` is dropped.
    """

    def __init__(self, is_marker: Callable[[str], bool], prompt_tail: str = "") -> None:
        self._lexer = MarkerLexer(is_marker)
        self.state = _ANSWER_START
        self.kind = CONTENT
        """Where the body being read goes (``REASONING``, ``CONTENT`` or ``RAW``)."""
        self.header = ""
        """The header being read, markers included."""
        self.pending = ""
        """At the answer's start: text that may still begin ``RECIPIENT_FIRST``."""
        self.has_reasoned = False
        self._out: list[tuple[str, str]] = []
        if prompt_tail:
            self.feed(prompt_tail, final=True)
            if self.state == _BETWEEN or (self.state == _HEADER and CHANNEL not in self.header
                                          and "to=" not in self.header):
                self.state, self.header = _ANSWER_START, ""  # only the role: the answer's turn
            self.has_reasoned = self.in_reasoning

    @property
    def in_reasoning(self) -> bool:
        """Inside an analysis message's body."""
        return self.state == _BODY and self.kind == REASONING

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        for is_marker, piece in self._lexer.feed(text, final):
            if is_marker:
                self._marker(piece)
            else:
                self._text(piece)
        if final and self.pending:
            self._put(CONTENT, self.pending)
            self.pending = ""
        out, self._out = self._out, []
        reasoning = "".join(t for kind, t in out if kind == REASONING)
        return reasoning, "".join(t for kind, t in out if kind != REASONING)

    def _put(self, kind: str, text: str) -> None:
        if text:
            self._out.append((kind, text))

    def _open(self, marker: str) -> None:
        self.state, self.header = _HEADER, marker

    def _resolve(self) -> None:
        """``<|message|>`` ends the header: where does the body go."""
        channel, recipient = parse_header(self.header)
        if recipient is not None:
            self.kind = RAW
            self._put(RAW, self.header + MESSAGE)
        elif channel == "analysis":
            self.kind = REASONING
            self.has_reasoned = True
        else:
            self.kind = CONTENT
        self.state, self.header = _BODY, ""

    def _text(self, text: str) -> None:
        if self.state == _BODY:
            self._put(self.kind, text)
        elif self.state == _HEADER:
            self.header += text
        elif self.state == _ANSWER_START:
            self.pending += text
            if self.pending.startswith(RECIPIENT_FIRST):
                self._open(self.pending)
                self.pending = ""
            elif not RECIPIENT_FIRST.startswith(self.pending):
                self._headerless()
        else:
            self.state, self.kind = _BODY, CONTENT
            self._put(CONTENT, text)

    def _headerless(self) -> None:
        """Text without a header: content, up to the next end or message."""
        self.state, self.kind = _BODY, CONTENT
        self._put(CONTENT, self.pending)
        self.pending = ""

    def _marker(self, marker: str) -> None:
        if self.state == _BODY:
            if marker in ENDS:
                if self.kind == RAW:
                    self._put(RAW, marker)
                self.state = _BETWEEN
            elif marker in OPENS:
                self._open(marker)
            elif self.kind == RAW:
                self._put(RAW, marker)
            return  # any other marker in a body is markup, not text
        if self.state == _HEADER:
            if marker == MESSAGE:
                self._resolve()
            elif marker in (CHANNEL, CONSTRAIN):
                self.header += marker
            elif marker == START:
                self._open(marker)  # a header without a body is dropped
            elif marker in ENDS:
                self.state, self.header = _BETWEEN, ""
            return
        if self.pending:  # " t" and then a marker: that was text
            self._headerless()
            self._marker(marker)
        elif marker in (START, CHANNEL, CONSTRAIN):
            self._open(marker)
        elif marker == MESSAGE:
            self.header = ""
            self._resolve()


def split(text: str, is_marker: Callable[[str], bool],
          prompt_tail: str = "") -> tuple[str | None, str]:
    """``(reasoning_content, content)`` of a whole answer; ``None`` when no analysis
    message was opened."""
    splitter = HarmonySplitter(is_marker, prompt_tail)
    reasoning, content = splitter.feed(text, final=True)
    return (reasoning if splitter.has_reasoned else None), content


def count_reasoning_tokens(token_ids: Sequence[int], marker_ids: dict[str, int],
                           decode: Callable[[Sequence[int]], str],
                           in_reasoning: bool = False) -> int:
    """The tokens of the answer's analysis messages, each from the first token of its
    header to its end marker (to the answer's end when it has none). ``marker_ids`` maps
    the harmony markers the vocabulary has to their ids; ``decode`` spells a header out
    (special tokens included); ``in_reasoning``: the prompt left an analysis body open."""
    start, message = marker_ids.get(START), marker_ids.get(MESSAGE)
    opens = {marker_ids[m] for m in OPENS if m in marker_ids}
    ends = {marker_ids[m] for m in ENDS if m in marker_ids}
    total, first = 0, 0
    in_body, analysis = in_reasoning, in_reasoning
    for i, token in enumerate(token_ids):
        if in_body:
            if token in ends or token in opens:
                last = i + 1 if token in ends else i
                total += last - first if analysis else 0
                in_body, first = False, last
        elif token == message:
            channel, recipient = parse_header(decode(token_ids[first:i]))
            in_body, analysis = True, channel == "analysis" and recipient is None
        elif token in ends:
            first = i + 1  # a header without a body
        elif token == start:
            first = i
    if in_body and analysis:
        total += len(token_ids) - first
    return total


class HarmonyFormat:
    """The harmony channels of one request's prompts, for the reasoning plugin: a splitter
    per choice and the reasoning-token count. ``decode`` spells ids out with their special
    tokens; ``is_marker`` accepts the vocabulary's special tokens; ``marker_ids`` maps the
    harmony markers the vocabulary has to their ids."""

    def __init__(self, decode: Callable[[Sequence[int]], str], is_marker: Callable[[str], bool],
                 marker_ids: dict[str, int], prompts: list[list[int]]) -> None:
        self.decode, self.is_marker, self.marker_ids = decode, is_marker, marker_ids
        start = marker_ids[START]
        self.tails = [decode(ids[_last_index(ids, start):]) if start in ids else ""
                      for ids in prompts]
        """Per prompt: its text from its last ``<|start|>`` (where the answer starts)."""

    def splitter(self, prompt_index: int) -> HarmonySplitter:
        return HarmonySplitter(self.is_marker, self.tails[prompt_index])

    def reasoning_tokens(self, token_ids: list[int], prompt_index: int) -> int:
        in_reasoning = self.splitter(prompt_index).in_reasoning
        return count_reasoning_tokens(token_ids, self.marker_ids, self.decode, in_reasoning)


def _last_index(ids: Sequence[int], token: int) -> int:
    return len(ids) - 1 - list(reversed(ids)).index(token)
