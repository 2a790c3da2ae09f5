"""The chat format of Google's Gemma 4 models (E2B, E4B, 26B-A4B, 31B), read from an answer
decoded with its special tokens: shared by the reasoning plugin (which splits the thought
channel out) and the tool_calls plugin's ``gemma4`` family (which reads the calls,
``freetoken_plugins/tool_calls/gemma4.py``). Not a plugin itself.

An answer, as the model writes it after the prompt's ``<|turn>model\\n``::

    <|channel>thought\\nThe user wants the weather.<channel|>Let me check.<|tool_call>call:
    get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_response>

- ``<|channel>thought`` (then optional whitespace) opens the thought channel: everything up
  to ``<channel|>`` is reasoning. A ``<|channel>`` not followed by ``thought`` is dropped and
  what follows it is content; so is a ``<channel|>`` outside a channel (llama.cpp's parser
  consumes both the same way). Several thought blocks are joined as they come.
- With ``enable_thinking`` false the chat template ends the prompt with an empty
  ``<|channel>thought\\n<channel|>``, so the answer starts in content; a prompt whose last
  ``<|channel>`` is not closed leaves the answer inside that channel (``prompt_tail``).
- The tool-call markup ``<|tool_call>``, ``<tool_call|>`` and ``<|"|>`` (``TOOL_MARKUP``) is
  kept verbatim in whichever part it occurs, for the tool parser. Every other special token
  (the end-of-generation ``<turn|>`` and ``<|tool_response>``, ``<|turn>``, …) is markup and
  dropped, as the harmony split drops gpt-oss's.

Markers are recognised in the text as whole strings of the vocabulary's special tokens; a
piece of text that may be the start of one is held back until the next piece decides it,
so text fed in pieces splits exactly as the whole.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Sequence
from functools import lru_cache

CHANNEL_OPEN, CHANNEL_CLOSE, THOUGHT = "<|channel>", "<channel|>", "thought"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE, STRING_DELIMITER = "<|tool_call>", "<tool_call|>", '<|"|>'
TOOL_RESPONSE_OPEN = "<|tool_response>"
"""An end-of-generation token: the model writes it after its calls (the tool answers)."""
CALL_PREFIX = "call:"
TOOL_MARKUP = frozenset({TOOL_CALL_OPEN, TOOL_CALL_CLOSE, STRING_DELIMITER})
MARKERS = frozenset({CHANNEL_OPEN, CHANNEL_CLOSE, TOOL_RESPONSE_OPEN, "<|turn>", "<turn|>",
                     *TOOL_MARKUP})
"""The format's own special tokens (a vocabulary's other special tokens are added to them)."""
TEMPLATE_MARKER = TOOL_CALL_OPEN + CALL_PREFIX
"""In a chat template: the template writes Gemma 4 tool calls (llama.cpp detects it so)."""
WHITESPACE = " \t\n\r"


@lru_cache(maxsize=8)
def _patterns(markers: frozenset[str]) -> tuple[re.Pattern[str], frozenset[str], int]:
    """The markers as one regex (longest first), their proper prefixes, the longest one."""
    ordered = sorted(markers, key=lambda m: (-len(m), m))
    pattern = re.compile("|".join(re.escape(m) for m in ordered))
    prefixes = frozenset(m[:n] for m in markers for n in range(1, len(m)))
    return pattern, prefixes, max(map(len, markers))


class MarkupLexer:
    """Text fed in pieces → ``(is_marker, text)`` events: each occurrence of one of
    ``markers`` is one event, the text between them another. A piece's end that may begin a
    marker (``<|chan``) is held until the next piece (``final``: nothing held)."""

    def __init__(self, markers: Collection[str]) -> None:
        if not markers or "" in markers:
            raise ValueError("the lexer needs non-empty markers")
        self._pattern, self._prefixes, self._longest = _patterns(frozenset(markers))
        self.held = ""

    def feed(self, text: str, final: bool = False) -> list[tuple[bool, str]]:
        text, self.held = self.held + text, ""
        if not final:
            keep = self._partial_length(text)
            text, self.held = text[:len(text) - keep], text[len(text) - keep:]
        events: list[tuple[bool, str]] = []
        at = 0
        for match in self._pattern.finditer(text):
            if match.start() > at:
                events.append((False, text[at:match.start()]))
            events.append((True, match.group()))
            at = match.end()
        if at < len(text):
            events.append((False, text[at:]))
        return events

    def _partial_length(self, text: str) -> int:
        """Length of the longest end of ``text`` that is a proper start of a marker (a
        marker that is itself the start of a longer one included)."""
        for n in range(min(self._longest - 1, len(text)), 0, -1):
            if text[-n:] in self._prefixes:
                return n
        return 0


_CONTENT, _HEADER, _THOUGHT = range(3)


class Gemma4Splitter:
    """Splits one choice's answer, fed in pieces, into ``(reasoning, content)`` pieces (the
    rules: the module docstring). ``markers``: every special token the text may hold
    (``MARKERS`` included); ``prompt_tail``: the prompt's text from its last
    ``<|channel>`` when no ``<channel|>`` followed it (the answer starts inside that
    channel). ``has_reasoned``: a thought channel was opened (in the answer or the tail)."""

    def __init__(self, markers: Collection[str], prompt_tail: str = "") -> None:
        self._lexer = MarkupLexer(frozenset(markers) | MARKERS)
        self.state = _CONTENT
        self.header = ""
        """After ``<|channel>``: the text read so far (is it ``thought``?)."""
        self.skip_space = False
        """Right after ``thought``: whitespace before the reasoning is markup."""
        self.has_reasoned = False
        self._reasoning: list[str] = []
        self._content: list[str] = []
        if prompt_tail:
            self.feed(prompt_tail)
            self._reasoning, self._content = [], []
            self.has_reasoned = self.in_reasoning

    @property
    def in_reasoning(self) -> bool:
        return self.state == _THOUGHT

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        for is_marker, piece in self._lexer.feed(text, final):
            if is_marker:
                self._marker(piece)
            else:
                self._text(piece)
        if final and self.state == _HEADER:
            self._not_a_thought()
        reasoning, content = "".join(self._reasoning), "".join(self._content)
        self._reasoning, self._content = [], []
        return reasoning, content

    def _text(self, text: str) -> None:
        if self.state == _HEADER:
            self.header += text
            if self.header.startswith(THOUGHT):
                text, self.header = self.header[len(THOUGHT):], ""
                self.state, self.skip_space, self.has_reasoned = _THOUGHT, True, True
            elif THOUGHT.startswith(self.header):
                return
            else:
                self._not_a_thought()
                return
        if self.state == _THOUGHT:
            if self.skip_space:
                text = text.lstrip(WHITESPACE)
                self.skip_space = not text
            self._reasoning.append(text)
        else:
            self._content.append(text)

    def _not_a_thought(self) -> None:
        """``<|channel>`` and not ``thought`` after it: the marker is dropped, the text
        after it is content."""
        self.state, text, self.header = _CONTENT, self.header, ""
        self._content.append(text)

    def _marker(self, marker: str) -> None:
        if self.state == _HEADER:
            self._not_a_thought()
        if marker in TOOL_MARKUP:
            self.skip_space = False
            (self._reasoning if self.state == _THOUGHT else self._content).append(marker)
        elif marker == CHANNEL_OPEN and self.state == _CONTENT:
            self.state = _HEADER
        elif marker == CHANNEL_CLOSE and self.state == _THOUGHT:
            self.state = _CONTENT
        # any other special token is markup, in neither part


def split(text: str, markers: Collection[str] = MARKERS,
          prompt_tail: str = "") -> tuple[str | None, str]:
    """``(reasoning_content, content)`` of a whole answer; ``None`` when no thought channel
    was opened."""
    splitter = Gemma4Splitter(markers, prompt_tail)
    reasoning, content = splitter.feed(text, final=True)
    return (reasoning if splitter.has_reasoned else None), content


def prompt_tail(prompt_token_ids: Sequence[int], open_id: int, close_id: int,
                decode: Callable[[Sequence[int]], str]) -> str:
    """The prompt's text (special tokens included) from its last ``<|channel>`` when no
    ``<channel|>`` came after it, else ``""`` (the answer starts in content)."""
    ids = list(prompt_token_ids)
    last_open = max((i for i, t in enumerate(ids) if t == open_id), default=-1)
    last_close = max((i for i, t in enumerate(ids) if t == close_id), default=-1)
    return decode(ids[last_open:]) if last_open > last_close else ""


def count_reasoning_tokens(token_ids: Sequence[int], open_id: int, close_id: int,
                           decode: Callable[[Sequence[int]], str],
                           in_reasoning: bool = False) -> int:
    """The tokens of the answer's thought channels, each from its ``<|channel>`` to its
    ``<channel|>`` (to the answer's end when it has none). A channel is a thought channel
    when the text of the tokens after its ``<|channel>`` (up to its end) starts with
    ``thought``; ``decode`` spells them out (special tokens included). ``in_reasoning``:
    the prompt left a thought channel open (its tokens count from the answer's first)."""
    ids = list(token_ids)
    total, at = 0, 0
    if in_reasoning:
        end = ids.index(close_id) + 1 if close_id in ids else len(ids)
        total, at = end, end
    while open_id in ids[at:]:
        start = ids.index(open_id, at)
        end = ids.index(close_id, start) if close_id in ids[start:] else len(ids)
        if decode(ids[start + 1:end]).startswith(THOUGHT):
            total += min(end + 1, len(ids)) - start
            at = end
        else:  # dropped: what follows is content, where another channel may open
            at = start + 1
    return total


class Gemma4Format:
    """The thought channels of one request's prompts, for the reasoning plugin: a splitter
    per choice and the reasoning-token count. ``markers``: the vocabulary's special tokens."""

    def __init__(self, decode: Callable[[Sequence[int]], str], open_id: int, close_id: int,
                 markers: Collection[str], prompts: list[list[int]]) -> None:
        self.decode, self.open_id, self.close_id = decode, open_id, close_id
        self.markers = frozenset(markers) | MARKERS
        self.tails = [prompt_tail(ids, open_id, close_id, decode) for ids in prompts]
        """Per prompt: where its answer starts (``prompt_tail``)."""

    def splitter(self, prompt_index: int) -> Gemma4Splitter:
        return Gemma4Splitter(self.markers, self.tails[prompt_index])

    def reasoning_tokens(self, token_ids: list[int], prompt_index: int) -> int:
        in_reasoning = self.splitter(prompt_index).in_reasoning
        return count_reasoning_tokens(token_ids, self.open_id, self.close_id, self.decode,
                                      in_reasoning)
