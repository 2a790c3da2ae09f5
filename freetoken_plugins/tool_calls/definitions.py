"""The shared definitions of the ``required`` grammar's tools.

A tool's ``parameters`` may keep its subschemas in ``$defs`` (or draft-7 ``definitions``)
and point at them with local references (``{"$ref": "#/$defs/Address"}``: what pydantic
writes for every nested model, so LangChain, instructor, pydantic-ai and the Agents SDK
all send them). Under ``tool_choice: "required"`` each tool's schema sits inside one array
schema, where ``#`` is the array's root: the definitions move up to that root, as vLLM
moves ``$defs``. Two tools that define one name differently keep both: the later one is
renamed (``Address_2``) and its references rewritten, so no valid request is refused."""

from __future__ import annotations

from typing import Any

DEFINITION_KEYS = ("$defs", "definitions")


def _pointer_token(name: str) -> str:
    """``name`` as one JSON-pointer token (RFC 6901: ``~`` and ``/`` escaped)."""
    return name.replace("~", "~0").replace("/", "~1")


def _renamed_refs(value: Any, renames: dict[str, str]) -> Any:
    """A copy of ``value`` with every ``$ref`` string under an old pointer prefix moved to
    the new one (``renames``: old prefix to new prefix)."""
    if isinstance(value, list):
        return [_renamed_refs(v, renames) for v in value]
    if not isinstance(value, dict):
        return value
    out = {k: _renamed_refs(v, renames) for k, v in value.items()}
    ref = out.get("$ref")
    if isinstance(ref, str):
        for old, new in renames.items():
            if ref == old or ref.startswith(old + "/"):
                out["$ref"] = new + ref[len(old):]
                break
    return out


def hoist_definitions(schemas: list[dict[str, Any]]
                      ) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """``schemas`` (the tools' arguments schemas) without their top-level definitions, and
    those definitions merged by keyword (``{"$defs": {...}, "definitions": {...}}``, only
    the keywords used), for the root of the schema that embeds them. Identical definitions
    of a name are kept once; a different one under a taken name is renamed."""
    merged: dict[str, dict[str, Any]] = {}
    out: list[dict[str, Any]] = []
    for schema in schemas:
        found = {key: schema[key] for key in DEFINITION_KEYS if isinstance(schema.get(key), dict)}
        if not found:
            out.append(schema)
            continue
        renames: dict[str, str] = {}
        chosen: dict[str, dict[str, str]] = {}
        for key, definitions in found.items():
            taken = merged.setdefault(key, {})
            chosen[key] = {}
            for name, definition in definitions.items():
                new, n = name, 1
                while new in taken and taken[new] != definition:
                    n += 1
                    new = f"{name}_{n}"
                chosen[key][name] = new
                if new != name:
                    renames[f"#/{key}/{_pointer_token(name)}"] = f"#/{key}/{_pointer_token(new)}"
        body = {k: v for k, v in schema.items() if k not in found}
        for key, definitions in found.items():
            for name, definition in definitions.items():
                merged[key][chosen[key][name]] = _renamed_refs(definition, renames)
        out.append(_renamed_refs(body, renames))
    return out, merged
