"""The tool_calls plugin: OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` on
``POST /v1/chat/completions``.

A request, read top to bottom:

1. ``validate``: the tools (function tools, each with a JSON-schema ``parameters``), the
   choice (``none``, ``auto``, ``required`` or ``{"type": "function", "function": {"name":
   …}}``), the limits (``--tool-calls-max-tools``). OpenAI's older ``functions`` /
   ``function_call`` are a 400 that says to use ``tools``.
2. ``implies``: ``required`` and a named function are *guaranteed* by the
   structured_outputs plugin: the answer must match a JSON schema (a named function: its
   ``parameters``; ``required``: an array of ``{"name", "parameters"}`` objects, one of the
   tools each, at most one item when ``parallel_tool_calls`` is false), written compactly
   (``disable_any_whitespace``: a small model cannot wander off in whitespace). ``auto`` constrains
   nothing and parses what the model writes.
3. ``freetoken_chat_template``: the tools reach the prompt through the model's chat
   template, or the generic tool prompt when the template has no tool support
   (``prompting.py``); assistant ``tool_calls`` and ``tool`` messages in the history are
   checked and rendered. With ``tool_choice: "none"`` the tools are left out of the prompt.
4. ``freetoken_decorate_response``: each choice's text goes through an incremental parser
   (``parsers.py``; the family is the template's, or ``--tool-calls-parser``) that splits
   it into ``content`` (only the text outside calls) and ``message.tool_calls`` (``id``,
   ``type: "function"``, ``function.name``, ``function.arguments`` as JSON text); the finish
   reason of a choice that called is ``tool_calls``. Streamed, the first delta of a call
   carries ``index``, ``id``, ``type`` and ``function.name``, later ones ``index`` and
   pieces of ``function.arguments``; markup of a call being parsed never reaches
   ``content``. A malformed call is returned as content. With the reasoning plugin, the
   parser sees the answer after ``</think>`` (it runs after the reasoning split); on a
   harmony model (gpt-oss) it sees the final and commentary text and each message
   addressed to a recipient, raw, which the ``harmony`` family reads; on Gemma 4 the
   answer outside the thought channels, its ``<|tool_call>`` markup kept.

Options: ``--tool-calls-parser`` (``auto``: from the chat template's markers; or a family
name: ``hermes``, ``llama3_json``, ``mistral``, ``json``, ``harmony``, ``gemma4``, or one a
package adds through the ``freetoken.tool_parsers`` entry-point group),
``--tool-calls-max-tools`` (128).
"""

from __future__ import annotations

import argparse
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from freetoken_core import hookimpl
from freetoken_core.errors import InvalidRequest
from freetoken_core.processors import (
    ChatView,
    Implied,
    ModelInfo,
    Plugin,
    RequestFields,
    ResponseFields,
    ResponseView,
)
from freetoken_plugins.structured_outputs.constraints import close_objects
from freetoken_plugins.tool_calls import gemma4, prompting
from freetoken_plugins.tool_calls.definitions import hoist_definitions
from freetoken_plugins.tool_calls.families import available_parsers, detect_parser
from freetoken_plugins.tool_calls.parsers import CallDelta, Parsed, ToolParser
from freetoken_plugins.tool_calls.shapes import (
    Function,
    FunctionDelta,
    HistoryCall,
    NamedChoice,
    Tool,
    ToolCall,
)

STATE_KEY = "tool_calls"
"""The plugin's name: its key in ``params.fields`` and ``plugin_state``."""
DEFAULT_MAX_TOOLS = 128
GRAMMAR_FIELD = "structured_outputs"
"""The structured_outputs plugin's field that carries the grammar of a forced call."""
REQUIRED_PARSER = "json"
"""The family that reads the answer of ``tool_choice: "required"`` (a JSON array)."""

@dataclass
class _Options:
    parser: str = "auto"
    max_tools: int = DEFAULT_MAX_TOOLS
    families: dict[str, type[ToolParser]] = field(default_factory=dict)
    """The installed parser families, read once (entry points are slow to list)."""

    def parsers(self) -> dict[str, type[ToolParser]]:
        if not self.families:
            self.families = available_parsers()
        return self.families


_options = _Options()


def tool_dicts(fields: ToolCalls.Fields) -> list[dict[str, Any]]:
    """The tools as plain JSON values (``{"type": "function", "function": {…}}``)."""
    return msgspec.to_builtins(fields.tools or [])


def choice_of(fields: ToolCalls.Fields) -> str:
    """``none``, ``auto``, ``required`` or ``named`` (``auto`` when tools came without a
    choice, ``none`` when no tools came)."""
    choice = fields.tool_choice
    if isinstance(choice, NamedChoice):
        return "named"
    if choice is None:
        return "auto" if fields.tools else "none"
    return choice


NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {},
                                 "additionalProperties": False}
"""The arguments of a function without ``parameters``: none (OpenAI: "omitting parameters
defines a function with an empty parameter list"), so a forced call's arguments are ``{}``."""


def parameters_schema(function: Function) -> dict[str, Any]:
    """The schema a forced call's arguments match: ``NO_PARAMETERS`` without
    ``parameters``; with ``strict: true`` every object in it closed (``close_objects``)."""
    if function.parameters is None:
        return NO_PARAMETERS
    return close_objects(function.parameters) if function.strict else function.parameters


def forced_schema(fields: ToolCalls.Fields) -> dict[str, Any] | None:
    """The JSON schema the answer must match (``required`` / named), else ``None``."""
    choice = choice_of(fields)
    tools = {t.function.name: t.function for t in fields.tools or []}
    if choice == "named":
        assert isinstance(fields.tool_choice, NamedChoice)
        return parameters_schema(tools[fields.tool_choice.function.name])
    if choice != "required":
        return None
    # Each tool's local references ("#/$defs/X") must resolve from the array's root.
    parameters, definitions = hoist_definitions([parameters_schema(f) for f in tools.values()])
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [name]},
                             "parameters": arguments},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, arguments in zip(tools, parameters)]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items},
                              **definitions}
    if fields.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


class NamedCall(ToolParser):
    """The answer under a named ``tool_choice``: the arguments object itself (the grammar
    guarantees it). Whitespace around it is not part of the arguments."""

    name = "named"
    template_markers = ()

    def __init__(self, function: str) -> None:
        self.function = function
        self.started = False
        self.held = ""

    def feed(self, text: str) -> Parsed:
        text = self.held + text
        if not self.started:
            text = text.lstrip()
            if not text:
                self.held = ""
                return Parsed()
        body = text.rstrip()
        self.held = text[len(body):]
        if not body:
            return Parsed()
        first = not self.started
        self.started = True
        return Parsed(calls=[CallDelta(0, self.function if first else None, body)])

    def finish(self) -> Parsed:
        self.held = ""
        return Parsed()


@dataclass
class _Choice:
    parser: ToolParser
    ids: list[str] = field(default_factory=list)
    """The id of each call of this choice, in order."""


@dataclass
class _RequestState:
    mode: str
    parser_cls: type[ToolParser]
    tool_names: list[str]
    function: str | None
    choices: dict[int, _Choice] = field(default_factory=dict)

    def choice(self, index: int) -> _Choice:
        state = self.choices.get(index)
        if state is None:
            if self.mode == "named":
                assert self.function is not None
                parser: ToolParser = NamedCall(self.function)
            else:
                parser = self.parser_cls(self.tool_names)
            state = self.choices[index] = _Choice(parser)
        return state


def _parser_class(tokenizer: Any, mode: str) -> type[ToolParser]:
    parsers = _options.parsers()
    if mode == "required":
        return parsers[REQUIRED_PARSER]
    if _options.parser != "auto":
        return parsers[_options.parser]
    return detect_parser(getattr(tokenizer, "chat_template", None), parsers)


def _request_state(response: ResponseView, fields: ToolCalls.Fields) -> _RequestState:
    state = response.plugin_state.get(STATE_KEY)
    if state is None:
        mode = choice_of(fields)
        function = (fields.tool_choice.function.name
                    if isinstance(fields.tool_choice, NamedChoice) else None)
        state = _RequestState(mode, _parser_class(response.tokenizer, mode),
                              [t.function.name for t in fields.tools or []], function)
        response.plugin_state[STATE_KEY] = state
    return state


def _new_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _merged(choice: _Choice, deltas: list[CallDelta], stream: bool) -> list[ToolCall]:
    """The calls of ``deltas`` in the response shape: one entry per call (pieces joined);
    in a stream with ``index`` and only the first delta's ``id``/``type``/``name``."""
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        call = calls.get(delta.index)
        if call is None:
            first = delta.name is not None
            if first:
                choice.ids.append(_new_id())
            call = calls[delta.index] = ToolCall(
                index=delta.index if stream else msgspec.UNSET,
                id=choice.ids[delta.index] if first or not stream else msgspec.UNSET,
                type="function" if first or not stream else msgspec.UNSET,
                function=FunctionDelta(name=delta.name if first else msgspec.UNSET,
                                       arguments=""))
        assert isinstance(call.function, FunctionDelta)
        call.function.arguments += delta.arguments
    return [calls[i] for i in sorted(calls)]


class ToolCalls(Plugin):
    """tools / tool_choice / parallel_tool_calls: function calling, parsed per model family."""

    routes = frozenset({"chat"})
    request_rules = (
        {"if": {"required": ["tool_choice"],
                "properties": {"tool_choice": {"not": {"enum": ["none", None]}}}},
         "then": {"required": ["tools"], "properties": {"tools": {"minItems": 1}}},
         "description": "tool_choice (other than none) needs tools"},
        {"properties": {"functions": {"type": "null"}, "function_call": {"type": "null"}},
         "description": "functions and function_call are refused: use tools and "
                        "tool_choice"},
    )

    class Fields(RequestFields):
        tools: list[Tool] | None = None
        """Function tools: {"type": "function", "function": {"name", "description",
        "parameters", "strict"}}."""
        tool_choice: Literal["none", "auto", "required"] | NamedChoice | None = None
        """none, auto (the default with tools), required, or {"type": "function",
        "function": {"name": ...}}."""
        parallel_tool_calls: bool | None = None
        """false: at most one call (guaranteed under required)."""
        functions: Any = None
        """OpenAI's deprecated form: a 400 (use tools)."""
        function_call: Any = None
        """OpenAI's deprecated form: a 400 (use tool_choice)."""

    class ChatMessageFields(RequestFields):
        tool_calls: list[HistoryCall] | None = None
        """An assistant message's calls: {"id", "type": "function", "function": {"name",
        "arguments"}} with arguments as JSON text."""
        tool_call_id: str | None = None
        """On a role "tool" message: the id of the call it answers."""

    class MessageFields(ResponseFields):
        tool_calls: list[ToolCall] | msgspec.UnsetType = msgspec.UNSET

    @classmethod
    def validate(cls, fields: Fields, model: ModelInfo, params: Any) -> Fields:
        for old, new in (("functions", "tools"), ("function_call", "tool_choice")):
            if getattr(fields, old) is not None:
                raise InvalidRequest(old, f"{old} is deprecated by OpenAI and not served: "
                                          f"use {new}")
        tools = fields.tools or []
        if len(tools) > _options.max_tools:
            raise InvalidRequest("tools", f"at most {_options.max_tools} tools per request "
                                          f"(--tool-calls-max-tools)")
        seen: set[str] = set()
        for i, tool in enumerate(tools):
            if tool.function.name in seen:
                raise InvalidRequest(f"tools[{i}].function.name",
                                     f"two tools are named {tool.function.name!r}")
            seen.add(tool.function.name)
        choice = fields.tool_choice
        if choice not in (None, "none") and not tools:
            raise InvalidRequest("tool_choice", "tool_choice needs tools")
        if isinstance(choice, NamedChoice) and choice.function.name not in seen:
            raise InvalidRequest("tool_choice.function.name",
                                 f"no tool is named {choice.function.name!r}")
        return fields

    @classmethod
    def implies(cls, fields: Fields, params: Any) -> Implied | None:
        schema = forced_schema(fields)
        if schema is None:
            return None
        return Implied("tool_choice", {GRAMMAR_FIELD: {"json": schema,
                                                       "disable_any_whitespace": True}})

    # -- the prompt ----------------------------------------------------------------

    @staticmethod
    @hookimpl
    def freetoken_chat_template(chat: ChatView) -> None:
        prompting.check_history(chat.messages)
        fields = None if chat.params is None else chat.params.fields.get(STATE_KEY)
        mode = "none" if fields is None else choice_of(fields)
        tools = [] if fields is None or mode == "none" else tool_dicts(fields)
        parser = _parser_class(chat.tokenizer, mode)
        if parser.needs_special_tokens and chat.params is not None and mode != "none":
            chat.params.skip_special_tokens = False  # the markup must reach the parser
        if prompting.template_reads_tools(chat.template):
            prompting.for_template(chat.messages)
            if gemma4.reads_tool_responses_only(chat.template):  # Gemma 4's earlier template
                chat.messages[:] = gemma4.tool_responses_in_turns(chat.messages)
            if tools:
                chat.variables["tools"] = tools
            return
        chat.messages[:] = prompting.spelled_out(chat.messages, parser)
        if not tools:
            return
        if mode == "named":
            assert fields is not None and isinstance(fields.tool_choice, NamedChoice)
            instructions = prompting.NAMED_INSTRUCTIONS.format(
                name=fields.tool_choice.function.name)
        elif mode == "required":
            instructions = prompting.REQUIRED_INSTRUCTIONS
        else:
            instructions = parser.instructions()
        chat.messages[:] = prompting.add_system_text(
            chat.messages, prompting.generic_prompt(tools, instructions))

    # -- the answer ----------------------------------------------------------------

    @staticmethod
    @hookimpl(trylast=True)
    def freetoken_decorate_response(response: ResponseView) -> None:
        """After the other plugins (the reasoning split first): parse each choice."""
        if response.route != "chat":
            return
        fields = response.params.fields.get(STATE_KEY)
        if fields is None or choice_of(fields) == "none":
            return
        state = _request_state(response, fields)
        for view in response.choices:
            choice = state.choice(view.index)
            final = not response.is_chunk or view.finish_reason is not None
            if response.is_chunk and not view.text and not final:
                continue
            parsed = choice.parser.feed(view.text or "")
            if final:
                rest = choice.parser.finish()
                parsed = Parsed(parsed.content + rest.content, parsed.calls + rest.calls)
            if state.mode == "required":
                # The grammar allows nothing but the array of calls: text the parser did not
                # take is the start of a call that max_tokens cut, not an answer.
                parsed.content = ""
            calls = _merged(choice, parsed.calls, response.is_chunk)
            if calls:
                view.message.tool_calls = calls
            if response.is_chunk:
                view.text = parsed.content or None
            else:
                view.text = parsed.content or (None if calls else "")
            if final and choice.ids and view.finish_reason == "stop":
                view.finish_reason = "tool_calls"

    # -- options -------------------------------------------------------------------

    @staticmethod
    @hookimpl
    def freetoken_add_cli_options(parser: argparse._ArgumentGroup) -> None:
        parser.add_argument("--tool-calls-parser", default="auto", metavar="FAMILY",
                            help="how tool calls are written: auto (from the chat "
                                 "template), hermes, llama3_json, mistral, json, harmony, "
                                 "gemma4, or a family a package adds (default: auto)")
        parser.add_argument("--tool-calls-max-tools", type=int, default=DEFAULT_MAX_TOOLS,
                            metavar="N",
                            help=f"most tools per request (default: {DEFAULT_MAX_TOOLS})")

    @staticmethod
    @hookimpl
    def freetoken_configure(options: dict[str, Any]) -> None:
        name = options.get("tool_calls_parser") or "auto"
        families = available_parsers()
        if name != "auto" and name not in families:
            raise ValueError(f"--tool-calls-parser {name}: no such family; installed: "
                             f"{', '.join(sorted(families))}")
        _options.families = families
        max_tools = options.get("tool_calls_max_tools")
        max_tools = DEFAULT_MAX_TOOLS if max_tools is None else int(max_tools)
        if max_tools < 1:
            raise ValueError("--tool-calls-max-tools must be at least 1")
        _options.parser, _options.max_tools = name, max_tools

