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
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from importlib import metadata

from freetoken_plugins.tool_calls.json_scan import (
    WHITESPACE,
    JsonScanner,
    JsonSyntaxError,
)
from freetoken_plugins.tool_calls.parsers import ToolParser

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


BUILTIN_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (Hermes, Llama3Json, Mistral, Json)
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
