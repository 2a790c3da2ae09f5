"""Tools and tool history into the chat template: the model's own, or a generic prompt.

A chat template that reads a ``tools`` variable (Hermes, Qwen, Llama 3.1+, Mistral …) gets
the tool list there, and renders the assistant's earlier calls and the tool results itself,
in Hugging Face's convention: an assistant message carries ``tool_calls`` with
``function.arguments`` as an object (the client sends it as JSON text), a result is a
``role: "tool"`` message with its ``tool_call_id``.

A template without tool support (SmolLM2's ChatML) gets the generic tool prompt instead,
added to the first system message (or as a new one): the tool list as JSON lines inside
``<tools></tools>`` and the instructions for the call format the parser reads. History is
spelled out as text: an assistant's calls as the parser family writes them
(``ToolParser.render_calls``), and each run of tool results as one user message of
``<tool_response>`` blocks (as Qwen's template does).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.meta

from freetoken_core.errors import InvalidRequest
from freetoken_plugins.tool_calls.parsers import ToolParser

GENERIC_PREAMBLE = (
    "You may call one or more functions to assist with the user query. The functions you "
    "can call are listed as JSON objects inside <tools></tools>:\n<tools>\n{tools}\n</tools>"
)
"""The generic tool prompt, before the format's instructions; ``{tools}``: one JSON per line."""

NAMED_INSTRUCTIONS = ("Call the function {name}: answer with its arguments only, as one "
                      "JSON object that matches its parameters.")
REQUIRED_INSTRUCTIONS = ('Answer with the calls only, as a JSON array of objects '
                         '[{"name": <function name>, "parameters": <arguments object>}].')


@lru_cache(maxsize=64)
def template_reads_tools(template: str) -> bool:
    """Whether the chat template ``template`` reads a ``tools`` variable."""
    if not template:
        return False
    try:
        parsed = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return "tools" in template
    return "tools" in jinja2.meta.find_undeclared_variables(parsed)


def _arguments_object(text: str, param: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        raise InvalidRequest(param, "arguments must be a JSON object, as JSON text") from None
    if not isinstance(value, dict):
        raise InvalidRequest(param, "arguments must be a JSON object, as JSON text")
    return value


def check_history(messages: list[dict[str, Any]]) -> None:
    """400s for tool history that no template can render: ``tool_calls`` on a message that
    is not the assistant's or empty (as OpenAI answers), arguments that are not a JSON object, a ``tool`` message
    without its ``tool_call_id`` or the id on another role."""
    for i, message in enumerate(messages):
        role = message["role"]
        calls = message.get("tool_calls")
        if calls is not None and role != "assistant":
            raise InvalidRequest(f"messages[{i}].tool_calls",
                                 "only assistant messages carry tool_calls")
        if calls == []:
            raise InvalidRequest(f"messages[{i}].tool_calls",
                                 "tool_calls must not be empty (leave it out)")
        for j, call in enumerate(calls or []):
            _arguments_object(call["function"]["arguments"],
                              f"messages[{i}].tool_calls[{j}].function.arguments")
        if role == "tool" and "tool_call_id" not in message:
            raise InvalidRequest(f"messages[{i}].tool_call_id",
                                 "a tool message needs the tool_call_id it answers")
        if role != "tool" and "tool_call_id" in message:
            raise InvalidRequest(f"messages[{i}].tool_call_id",
                                 "only tool messages carry a tool_call_id")


def for_template(messages: list[dict[str, Any]]) -> None:
    """History in Hugging Face's convention, in place: arguments as objects."""
    for message in messages:
        for call in message.get("tool_calls") or []:
            function = call["function"]
            function["arguments"] = json.loads(function["arguments"])


def spelled_out(messages: list[dict[str, Any]], parser: type[ToolParser]
                ) -> list[dict[str, Any]]:
    """History as plain chat messages (for a template without tool support)."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        calls = message.pop("tool_calls", None)
        if calls:
            try:
                rendered = parser.render_calls([(c["function"]["name"],
                                                 c["function"]["arguments"]) for c in calls])
            except (ValueError, TypeError) as exc:  # arguments the family cannot write
                raise InvalidRequest(f"messages[{i}].tool_calls", str(exc)) from None
            text = message.get("content") or ""
            message["content"] = f"{text}\n{rendered}" if text else rendered
        if message["role"] == "tool":
            block = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("from_tools"):
                out[-1]["content"] += "\n" + block
                continue
            out.append({"role": "user", "content": block, "from_tools": True})
            continue
        out.append(message)
    for message in out:
        message.pop("from_tools", None)
    return out


def generic_prompt(tools: list[dict[str, Any]], instructions: str) -> str:
    """The generic tool prompt: the tool list and how to call."""
    lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return GENERIC_PREAMBLE.format(tools=lines) + "\n\n" + instructions


def add_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """``messages`` with ``text`` first in the system message (a new one if none)."""
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        first["content"] = f"{first.get('content') or ''}\n\n{text}".lstrip("\n")
        return messages
    return [{"role": "system", "content": text}, *messages]
