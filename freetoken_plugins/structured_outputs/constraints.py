"""What a client sends to constrain its output, validated into one ``Constraint``.

Two request fields say it, OpenAI's and vLLM's:

* ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``
  (any JSON object) or ``{"type": "json_schema", "json_schema": {"name", "schema",
  "strict", "description"}}``;
* ``structured_outputs`` (vLLM's extra field): an object with exactly one of ``json`` (a
  schema, as an object or its JSON text), ``regex``, ``choice`` (a non-empty list of
  strings), ``grammar`` (Lark text) or ``json_object: true``; and, with ``json`` or
  ``json_object``, ``disable_any_whitespace: true`` (compact JSON: no whitespace beyond the
  backend's fixed separators). vLLM's other tuning keys are refused when set, never
  silently ignored: an ignored key would change what the client gets without telling it.

A request may use one of the two, not both. Every failure is an ``InvalidRequest`` whose
``param`` is the exact field (``response_format.json_schema.name``, ``structured_outputs.regex``).

The spec of a JSON constraint keeps the schema's key order: JSON-schema backends emit an
object's properties in the order its schema declares them (OpenAI documents this), so
sorting the keys would change the output, not only its cache key.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from freetoken_core.errors import InvalidRequest

__all__ = [
    "ANY_JSON_OBJECT",
    "DEFAULT_MAX_SPEC_CHARS",
    "Constraint",
    "ConstraintKind",
    "parse_constraint",
]

ConstraintKind = Literal["json", "regex", "choice", "grammar"]

DEFAULT_MAX_SPEC_CHARS = 65_536
"""The longest spec (schema JSON, regex, choice list JSON, grammar) a request may send."""

ANY_JSON_OBJECT = '{"type":"object"}'
"""The spec of ``{"type": "json_object"}``: the schema every JSON object satisfies."""

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_KINDS: tuple[str, ...] = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's StructuredOutputsParams fields that tune a constraint rather than state one.
_TUNING = ("disable_any_whitespace",)
_UNSUPPORTED = ("disable_additional_properties",
                "whitespace_pattern", "structural_tag", "disable_fallback", "_backend")


@dataclass(frozen=True)
class Constraint:
    """One output constraint, whatever field it came from.

    ``spec`` is text, so a constraint is hashable and two requests asking the same thing
    share one compiled grammar: for ``json`` the schema serialized compactly (keys in the
    client's order, see the module docstring), for ``regex`` the pattern, for ``choice`` the
    JSON list of the choices, for ``grammar`` the Lark grammar text.
    """

    kind: ConstraintKind
    spec: str
    compact: bool = False
    """JSON only: no free whitespace (``disable_any_whitespace``)."""


def parse_constraint(response_format: Any, structured_outputs: Any,
                     max_spec_chars: int = DEFAULT_MAX_SPEC_CHARS) -> Constraint | None:
    """The constraint a request asks for, or ``None`` when it asks for none.

    ``response_format`` and ``structured_outputs`` are the request's fields as decoded from
    JSON (``None`` when absent). Raises ``InvalidRequest`` naming the offending field when
    either is malformed, when both state a constraint, or when a spec is longer than
    ``max_spec_chars`` characters.
    """
    from_format = _from_response_format(response_format, max_spec_chars)
    from_extra = _from_structured_outputs(structured_outputs, max_spec_chars)
    if from_format is not None and from_extra is not None:
        raise InvalidRequest("structured_outputs",
                             "use either response_format or structured_outputs, not both")
    return from_format if from_format is not None else from_extra


def _from_response_format(value: Any, max_chars: int) -> Constraint | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest("response_format", "response_format must be an object")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json", ANY_JSON_OBJECT)
    if kind != "json_schema":
        raise InvalidRequest("response_format.type", "response_format.type must be 'text', "
                             f"'json_object' or 'json_schema', got {_shown(kind)}")
    body = value.get("json_schema")
    param = "response_format.json_schema"
    if not isinstance(body, dict):
        raise InvalidRequest(param, f"{param} must be an object when type is 'json_schema'")
    name = body.get("name")
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise InvalidRequest(f"{param}.name", f"{param}.name must be 1 to 64 letters, digits, "
                             f"underscores or dashes, got {_shown(name)}")
    if body.get("strict") is not None and not isinstance(body["strict"], bool):
        raise InvalidRequest(f"{param}.strict", f"{param}.strict must be a boolean or null")
    if body.get("description") is not None and not isinstance(body["description"], str):
        raise InvalidRequest(f"{param}.description", f"{param}.description must be a string")
    if "schema" not in body:
        raise InvalidRequest(f"{param}.schema", f"{param}.schema is required")
    return Constraint("json", _schema_spec(body["schema"], f"{param}.schema", max_chars))


def _from_structured_outputs(value: Any, max_chars: int) -> Constraint | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest("structured_outputs", "structured_outputs must be an object")
    for key, item in value.items():
        # vLLM sends every field; its defaults (null, false) mean "not set".
        if key not in _KINDS and key not in _TUNING and item not in (None, False):
            reason = "is not supported" if key in _UNSUPPORTED else "is not a known field"
            raise InvalidRequest(f"structured_outputs.{key}", f"structured_outputs.{key} {reason}"
                                 f"; set exactly one of {', '.join(_KINDS)}")
    chosen = [key for key in _KINDS if value.get(key) not in (None, False)]
    if len(chosen) != 1:
        raise InvalidRequest("structured_outputs", "structured_outputs must set exactly one of "
                             f"{', '.join(_KINDS)}, got {len(chosen)}")
    key = chosen[0]
    param, item = f"structured_outputs.{key}", value[key]
    compact = value.get("disable_any_whitespace")
    if compact not in (None, False, True):
        raise InvalidRequest("structured_outputs.disable_any_whitespace",
                             "structured_outputs.disable_any_whitespace must be a boolean")
    if compact and key not in ("json", "json_object"):
        raise InvalidRequest("structured_outputs.disable_any_whitespace",
                             "structured_outputs.disable_any_whitespace applies to json and "
                             "json_object only")
    if key == "json_object":
        if item is not True:
            raise InvalidRequest(param, f"{param} must be true or absent")
        return Constraint("json", ANY_JSON_OBJECT, bool(compact))
    if key == "json":
        if isinstance(item, str):
            _limited(item, param, max_chars)
            try:
                item = json.loads(item)
            except ValueError as exc:
                raise InvalidRequest(param, f"{param} is not valid JSON: {exc}") from None
        return Constraint("json", _schema_spec(item, param, max_chars), bool(compact))
    if key == "choice":
        if (not isinstance(item, list) or not item
                or not all(isinstance(choice, str) for choice in item)):
            raise InvalidRequest(param, f"{param} must be a non-empty list of strings")
        return Constraint("choice", _limited(json.dumps(item, ensure_ascii=False), param,
                                             max_chars))
    if not isinstance(item, str):
        raise InvalidRequest(param, f"{param} must be a string")
    return Constraint(key, _limited(item, param, max_chars))  # type: ignore[arg-type]


def _schema_spec(schema: Any, param: str, max_chars: int) -> str:
    if not isinstance(schema, dict):
        raise InvalidRequest(param, f"{param} must be a JSON object")
    try:
        text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(param, f"{param} is not JSON: {exc}") from None
    return _limited(text, param, max_chars)


def _limited(text: str, param: str, max_chars: int) -> str:
    """``text``, or ``InvalidRequest`` when it is longer than ``max_chars``."""
    if len(text) > max_chars:
        raise InvalidRequest(param, f"{param} is {len(text):,} characters long; "
                             f"the limit is {max_chars:,}")
    return text


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
