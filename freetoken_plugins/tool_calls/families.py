r"""The built-in tool-call parser families, and how a family is found (built-ins and the
``freetoken.tool_parsers`` entry points). The semantics every family shares are in
``parsers.py``.

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
- ``harmony`` (OpenAI's gpt-oss; vLLM's ``openai`` parser): a message addressed
  ``to=functions.NAME`` (in its header, before or after the channel) is a call of NAME,
  its body the arguments, as written, up to ``<|call|>`` (or ``<|end|>``, ``<|return|>``,
  the next ``<|start|>`` / ``<|channel|>``): ``<|start|>assistant<|channel|>commentary
  to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>``. The
  call commits at its ``<|message|>``. Everything else is content, verbatim: with the
  reasoning plugin that is only the final and commentary text it kept, without it the raw
  harmony text. A message to another recipient, or to a function that is not one of the
  tools, is content, markup included. The markers are special tokens (the format is read
  by ``freetoken_plugins.harmony``).
- ``gemma4`` (Google's Gemma 4): ``<|tool_call>call:NAME{key:<|"|>text<|"|>,n:1}<tool_call|>``,
  any number, text around them is content, the ``<|tool_response>`` after them markup. The
  arguments are Gemma's own syntax, converted to JSON text (``tool_calls/gemma4.py``, the
  family's own module, is the reference). The markers are special tokens.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from importlib import metadata

from freetoken_plugins import harmony
from freetoken_plugins.tool_calls.gemma4 import Gemma4
from freetoken_plugins.tool_calls.json_scan import (
    WHITESPACE,
    JsonScanner,
    JsonSyntaxError,
)
from freetoken_plugins.tool_calls.parsers import Parsed, ToolParser

log = logging.getLogger("freetoken.tool_calls")

ENTRY_POINT_GROUP = "freetoken.tool_parsers"


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


class Harmony(ToolParser):
    """OpenAI's gpt-oss: ``…<|channel|>commentary to=functions.NAME <|constrain|>json
    <|message|>{arguments}<|call|>``."""

    name = "harmony"
    template_markers = ("<|channel|>", "to=functions.")
    needs_special_tokens = True
    FUNCTIONS = "functions."

    def __init__(self, tool_names: Collection[str]) -> None:
        super().__init__(tool_names)
        self._lexer = harmony.MarkerLexer(harmony.MARKERS.__contains__)
        self._at_start = True
        """Nothing read yet: the first header may begin with `` to=`` (held meanwhile)."""
        self._header: str | None = None
        """The header of a message being read (held: content unless it is a call)."""
        self._in_call = False

    def feed(self, text: str) -> Parsed:
        self._read(self._lexer.feed(text))
        return self._take()

    def finish(self) -> Parsed:
        self._read(self._lexer.feed("", final=True))
        self._emit(self._held + (self._header or ""))
        self._held, self._header, self._in_call = "", None, False
        return self._take()

    def _read(self, events: list[tuple[bool, str]]) -> None:
        for is_marker, piece in events:
            if is_marker:
                self._marker(piece)
            else:
                self._text(piece)

    def _text(self, text: str) -> None:
        if self._in_call:
            self._deltas.append((self._num_calls - 1, None, text))
        elif self._header is not None:
            self._header += text
        elif self._at_start:
            self._held += text
            if self._held.startswith(harmony.RECIPIENT_FIRST):
                self._header, self._held, self._at_start = self._held, "", False
            elif not harmony.RECIPIENT_FIRST.startswith(self._held):
                self._emit(self._held)
                self._held, self._at_start = "", False
        else:
            self._emit(text)

    def _marker(self, marker: str) -> None:
        if self._at_start:
            self._emit(self._held)
            self._held, self._at_start = "", False
        if self._in_call:
            if marker in harmony.ENDS:
                self._in_call = False
                return
            if marker not in harmony.OPENS:
                self._deltas.append((self._num_calls - 1, None, marker))
                return
            self._in_call = False  # the next message opens: read its marker below
        if self._header is not None:
            if marker == harmony.MESSAGE:
                self._resolve()
                return
            if marker in (harmony.CHANNEL, harmony.CONSTRAIN):
                self._header += marker
                return
            self._emit(self._header)  # not a call: the header was content
            self._header = None
        if marker in harmony.OPENS:
            self._header = marker
        else:
            self._emit(marker)

    def _resolve(self) -> None:
        """``<|message|>`` ends the header: a call of one of the tools, or content."""
        assert self._header is not None
        _, recipient = harmony.parse_header(self._header)
        name = (recipient[len(self.FUNCTIONS):]
                if recipient is not None and recipient.startswith(self.FUNCTIONS) else None)
        if name is None or name not in self.tool_names:
            self._emit(self._header + harmony.MESSAGE)
            self._header = None
            return
        self._header = None
        self._deltas.append((self._num_calls, name, ""))
        self._num_calls += 1
        self._in_call = True

    def _start(self, c: str) -> bool:  # feed and finish are its own: no character states
        raise AssertionError("Harmony reads markers, not characters")

    @classmethod
    def instructions(cls) -> str:
        return ("To call a function, write <|start|>assistant<|channel|>commentary "
                "to=functions.NAME <|constrain|>json<|message|>, its arguments as a JSON "
                "object, and <|call|>:\n" + cls.render_calls(cls.EXAMPLE))

    @classmethod
    def render_calls(cls, calls: list[tuple[str, str]]) -> str:
        return "".join(f"{harmony.START}assistant{harmony.CHANNEL}commentary "
                       f"to=functions.{name} {harmony.CONSTRAIN}json{harmony.MESSAGE}{args}"
                       f"{harmony.CALL}" for name, args in calls)


BUILTIN_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (Hermes, Llama3Json, Mistral, Json, Harmony, Gemma4)
}


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
