"""What a client sends to constrain its output, validated into one ``Constraint``.

Two request fields say it, OpenAI's and vLLM's:

* ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``
  (any JSON object) or ``{"type": "json_schema", "json_schema": {"name", "schema",
  "strict", "description"}}``;
* ``structured_outputs`` (vLLM's extra field): an object with exactly one of ``json`` (a
  schema, as an object or its JSON text), ``regex``, ``choice`` (a non-empty list of
  strings), ``grammar`` (Lark text) or ``json_object: true``; and, with ``json`` or
  ``json_object``, ``disable_any_whitespace: true`` (compact JSON: no whitespace beyond the
  backend's fixed separators) and ``disable_additional_properties`` (``true``: an object
  whose schema declares ``properties`` and says nothing of ``additionalProperties`` takes no
  other key; ``false``: such an object takes any other key, as JSON Schema reads it;
  ``null`` or absent: the server's default, which refuses them unless
  ``--structured-outputs-allow-additional-properties``). vLLM's other tuning keys are
  refused when set, never silently ignored: an ignored key would change what the client
  gets without telling it.

``response_format.json_schema.strict: true`` refuses undeclared keys whatever the server's
default (OpenAI's strict mode); ``false`` or absent leaves the server's default.

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
    "MAX_WHITESPACE",
    "Constraint",
    "ConstraintKind",
    "close_objects",
    "parse_constraint",
]

ConstraintKind = Literal["json", "regex", "choice", "grammar"]

DEFAULT_MAX_SPEC_CHARS = 65_536
"""The longest spec (schema JSON, regex, choice list JSON, grammar) a request may send."""

ANY_JSON_OBJECT = '{"type":"object"}'
"""The spec of ``{"type": "json_object"}``: the schema every JSON object satisfies."""

MAX_WHITESPACE = 12
"""The most whitespace characters a JSON constraint allows between two tokens (a newline and
indentation five levels deep at two spaces): enough for pretty-printed JSON, never an
endless run (both backends bound the run: xgrammar's ``max_whitespace_cnt``, llguidance's
``whitespace_pattern``). ``disable_any_whitespace`` allows none."""

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_KINDS: tuple[str, ...] = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's StructuredOutputsParams fields that tune a constraint rather than state one.
_TUNING = ("disable_any_whitespace", "disable_additional_properties")
_UNSUPPORTED = ("whitespace_pattern", "structural_tag", "disable_fallback", "_backend")


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
    additional_properties: bool | None = None
    """JSON only: whether an object whose schema declares ``properties`` but not
    ``additionalProperties`` takes undeclared keys; ``None``: the server's default (the
    processor resolves it before compiling, so a backend always sees a bool)."""


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
    return Constraint("json", _schema_spec(body["schema"], f"{param}.schema", max_chars),
                      additional_properties=False if body.get("strict") else None)


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
    closed = value.get("disable_additional_properties")
    if closed not in (None, False, True):
        raise InvalidRequest("structured_outputs.disable_additional_properties",
                             "structured_outputs.disable_additional_properties must be a "
                             "boolean or null")
    if closed and key not in ("json", "json_object"):
        raise InvalidRequest("structured_outputs.disable_additional_properties",
                             "structured_outputs.disable_additional_properties applies to "
                             "json and json_object only")
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
        return Constraint("json", _schema_spec(item, param, max_chars), bool(compact),
                          None if closed is None else not closed)
    if key == "choice":
        if (not isinstance(item, list) or not item
                or not all(isinstance(choice, str) for choice in item)):
            raise InvalidRequest(param, f"{param} must be a non-empty list of strings")
        return Constraint("choice", _limited(json.dumps(item, ensure_ascii=False), param,
                                             max_chars))
    if not isinstance(item, str):
        raise InvalidRequest(param, f"{param} must be a string")
    return Constraint(key, _limited(item, param, max_chars))  # type: ignore[arg-type]


# Keywords whose value is one subschema, a list of them, or a map of names to them.
_SUBSCHEMA = ("additionalProperties", "items", "contains", "not", "if", "then", "else",
              "propertyNames", "unevaluatedItems", "unevaluatedProperties",
              "additionalItems")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas")


def close_objects(schema: Any) -> Any:
    """A copy of the JSON schema ``schema`` in which every object schema that declares
    ``properties`` or ``patternProperties`` and says nothing of ``additionalProperties``
    says ``false`` (what vLLM does for llguidance under ``disable_additional_properties``,
    walking only subschema positions, so a property named ``properties`` stays a name).
    Anything that is not a schema object is returned as it is."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if key in out:
            out[key] = close_objects(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(item) for item in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(item) for name, item in out[key].items()}
    if isinstance(out.get("items"), list):  # draft 4-7 tuples
        out["items"] = [close_objects(item) for item in out["items"]]
    if ("properties" in out or "patternProperties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _schema_spec(schema: Any, param: str, max_chars: int) -> str:
    if not isinstance(schema, dict):
        raise InvalidRequest(param, f"{param} must be a JSON object")
    try:
        text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(param, f"{param} is not JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequest(param, f"{param} is nested too deeply") from None
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
