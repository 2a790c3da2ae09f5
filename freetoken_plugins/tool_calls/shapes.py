"""The wire shapes of the tool_calls plugin: a request's ``tools`` and ``tool_choice``, an
earlier assistant message's calls, and the calls (whole or as stream deltas) a response
carries. Their docstrings are the OpenAPI document's descriptions of these fields."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class Function(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    name: Annotated[str, Meta(pattern=_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments object (none: the function takes no arguments)."""
    strict: bool | None = None
    """true: under ``required`` or a named choice the call's arguments take exactly the
    declared keys, even under ``--structured-outputs-allow-additional-properties`` (they do
    by default anyway); under ``auto`` calls are parsed from free text, unconstrained."""


class Tool(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: Function


class ChosenFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: ChosenFunction


class CalledFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str
    """The arguments object as JSON text, as OpenAI sends it."""


class HistoryCall(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    type: Literal["function"]
    function: CalledFunction


class FunctionDelta(msgspec.Struct, omit_defaults=True):
    name: str | msgspec.UnsetType = msgspec.UNSET
    arguments: str | msgspec.UnsetType = msgspec.UNSET


class ToolCall(msgspec.Struct, omit_defaults=True):
    """A call in a message (``id``, ``type``, ``function``) or a stream delta (``index``,
    then ``id``/``type``/``function.name`` on its first delta only)."""

    index: int | msgspec.UnsetType = msgspec.UNSET
    id: str | msgspec.UnsetType = msgspec.UNSET
    type: str | msgspec.UnsetType = msgspec.UNSET
    function: FunctionDelta | msgspec.UnsetType = msgspec.UNSET
