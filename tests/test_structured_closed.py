"""Schemas mean what they say: undeclared object keys and whitespace runs in JSON constraints.

On both grammar backends (the tiny offline tokenizer): an object schema with ``properties``
and no ``additionalProperties`` takes no other key when the constraint is closed, any key
when it is open; explicit ``additionalProperties`` wins either way; whitespace between
tokens is bounded by ``MAX_WHITESPACE``. Then the request fields that choose
(``structured_outputs.disable_additional_properties``, ``json_schema.strict``, a tool's
``strict``) and the server default the processor applies
(``--structured-outputs-allow-additional-properties``).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch
from tiny_models import build_tokenizer

from freetoken_core.errors import InvalidRequest
from freetoken_core.processors import ModelInfo, ProcessorContext, RequestView
from freetoken_core.sampling_params import SamplingParams
from freetoken_plugins.structured_outputs.backends import BACKENDS, GrammarBackend, make_backend
from freetoken_plugins.structured_outputs.constraints import (
    MAX_WHITESPACE,
    Constraint,
    close_objects,
    parse_constraint,
)
from freetoken_plugins.structured_outputs.processor import StructuredOutputs
from freetoken_plugins.tool_calls.plugin import parameters_schema
from freetoken_plugins.tool_calls.shapes import Function

VOCAB, EOS = 672, 2
OPEN_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"a": {"type": "integer"},
                   "inner": {"type": "object", "properties": {"b": {"type": "boolean"}}}},
    "required": ["a"],
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest, tokenizer: Any) -> GrammarBackend:
    pytest.importorskip(request.param)
    return make_backend(request.param, tokenizer, VOCAB, [EOS])


def matches(backend: GrammarBackend, tokenizer: Any, constraint: Constraint, text: str) -> bool:
    """Whether the whole of ``text`` is accepted, token by token, and complete."""
    matcher = backend.matcher(backend.compile(constraint, "p"))
    return all(matcher.accept(t) for t in tokenizer.encode(text)) and matcher.is_accepting()


def json_constraint(schema: dict[str, Any], additional: bool | None) -> Constraint:
    return Constraint("json", json.dumps(schema), additional_properties=additional)


def test_close_objects_closes_every_object_schema_and_nothing_else() -> None:
    schema = {
        "type": "object",
        "properties": {"properties": {"type": "object", "properties": {"x": {}}},
                       "open": {"type": "object", "properties": {"y": {}},
                                "additionalProperties": True},
                       "list": {"type": "array", "items": {"properties": {"z": {}}}}},
        "anyOf": [{"properties": {"w": {}}}, {"type": "string"}],
        "$defs": {"d": {"patternProperties": {"^k": {}}}},
    }
    before = copy.deepcopy(schema)
    closed = close_objects(schema)
    assert schema == before, "the input is not changed"
    assert closed["additionalProperties"] is False
    props = closed["properties"]
    # A property named "properties" is a name, not a keyword: no key is added beside it.
    assert set(props) == {"properties", "open", "list"}
    assert props["properties"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True  # what the schema says wins
    assert props["list"]["items"]["additionalProperties"] is False
    assert closed["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in closed["anyOf"][1]
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert close_objects({"type": "object"}) == {"type": "object"}  # any object stays any
    assert close_objects(True) is True


@pytest.mark.parametrize(("additional", "extra_allowed"), [(False, False), (True, True),
                                                           (None, True)])
def test_undeclared_keys_follow_the_constraint(backend: GrammarBackend, tokenizer: Any,
                                               additional: bool | None,
                                               extra_allowed: bool) -> None:
    constraint = json_constraint(OPEN_SCHEMA, additional)
    assert matches(backend, tokenizer, constraint, '{"a": 1, "inner": {"b": true}}')
    assert matches(backend, tokenizer, constraint, '{"a": 1, "c": 2}') is extra_allowed
    # Nested objects too.
    assert matches(backend, tokenizer, constraint,
                   '{"a": 1, "inner": {"b": true, "c": 1}}') is extra_allowed


def test_explicit_additional_properties_wins(backend: GrammarBackend, tokenizer: Any) -> None:
    schema = {**OPEN_SCHEMA, "additionalProperties": {"type": "string"}}
    closed = json_constraint(schema, False)
    assert matches(backend, tokenizer, closed, '{"a": 1, "c": "x"}')
    assert not matches(backend, tokenizer, closed, '{"a": 1, "c": 2}')
    # An object schema without properties is any object, closed or not (json_object).
    assert matches(backend, tokenizer, json_constraint({"type": "object"}, False),
                   '{"anything": [1, 2]}')


def test_whitespace_runs_are_bounded(backend: GrammarBackend, tokenizer: Any) -> None:
    constraint = json_constraint(OPEN_SCHEMA, False)
    most = " " * MAX_WHITESPACE
    assert matches(backend, tokenizer, constraint, '{\n  "a": 1\n}')
    assert matches(backend, tokenizer, constraint, '{"a":' + most + '1}')
    assert not matches(backend, tokenizer, constraint, '{"a":' + most + ' 1}')
    compact = Constraint("json", json.dumps(OPEN_SCHEMA), compact=True,
                         additional_properties=False)
    assert not matches(backend, tokenizer, compact, '{"a":  1}')


@pytest.mark.parametrize(("structured_outputs", "additional"), [
    ({"json": OPEN_SCHEMA}, None),
    ({"json": OPEN_SCHEMA, "disable_additional_properties": None}, None),
    ({"json": OPEN_SCHEMA, "disable_additional_properties": True}, False),
    ({"json": OPEN_SCHEMA, "disable_additional_properties": False}, True),
    ({"json_object": True, "disable_additional_properties": True}, None),
    ({"regex": "a+", "disable_additional_properties": False}, None),  # vLLM's default: unset
])
def test_disable_additional_properties_is_read(structured_outputs: dict[str, Any],
                                               additional: bool | None) -> None:
    constraint = parse_constraint(None, structured_outputs)
    assert constraint is not None and constraint.additional_properties is additional


@pytest.mark.parametrize(("structured_outputs", "message"), [
    ({"json": {}, "disable_additional_properties": "yes"}, "must be a boolean"),
    ({"regex": "a", "disable_additional_properties": True}, "json and json_object only"),
])
def test_disable_additional_properties_refusals(structured_outputs: dict[str, Any],
                                                message: str) -> None:
    with pytest.raises(InvalidRequest, match=message) as info:
        parse_constraint(None, structured_outputs)
    assert info.value.param == "structured_outputs.disable_additional_properties"


@pytest.mark.parametrize(("strict", "additional"), [(True, False), (False, None),
                                                    (None, None)])
def test_json_schema_strict_closes(strict: bool | None, additional: bool | None) -> None:
    body = {"name": "t", "schema": OPEN_SCHEMA, "strict": strict}
    constraint = parse_constraint({"type": "json_schema", "json_schema": body}, None)
    assert constraint is not None and constraint.additional_properties is additional


def test_a_strict_tool_closes_its_parameters() -> None:
    loose = Function(name="f", parameters=OPEN_SCHEMA)
    assert parameters_schema(loose) is OPEN_SCHEMA  # the server's default decides
    strict = parameters_schema(Function(name="f", parameters=OPEN_SCHEMA, strict=True))
    assert strict == close_objects(OPEN_SCHEMA) and strict["additionalProperties"] is False


@pytest.mark.parametrize(("option", "sent", "resolved"), [
    (None, None, False), (True, None, True), (True, True, False), (None, False, True)])
def test_the_processor_applies_the_server_default(tokenizer: Any, option: bool | None,
                                                  sent: bool | None, resolved: bool) -> None:
    options = {"structured_outputs_backend": BACKENDS[0],
               "structured_outputs_allow_additional_properties": option}
    ctx = ProcessorContext(2, ModelInfo(VOCAB, frozenset({EOS}), 2048), torch.device("cpu"),
                           tokenizer, options, None)
    proc = StructuredOutputs(ctx)
    fields = StructuredOutputs.Fields(structured_outputs={
        "json": OPEN_SCHEMA, "disable_additional_properties": sent})
    view = RequestView("r", 0, fields, SamplingParams(), [5], [], is_chat=False)
    compiled = proc.prepare_request(view).result(timeout=30)
    assert compiled.constraint.additional_properties is resolved
    proc.compiler.close()
