"""What every framework module sends and checks: one tool, one answer model, and the
protocol assertions (the answer parses, tool arguments hold exactly the declared
parameters). The tiny model's wisdom is never checked, only the shape of what it wrote."""

from __future__ import annotations

import json
from typing import Any, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict

QUESTION = "What is the capital of France?"
WEATHER_QUESTION = "What is the weather like in Paris?"
PERSON_QUESTION = "Describe a person: a name and an age."
RESIDENT_QUESTION = "Record Marie, who lives in Paris, France."
# Small, but room for a forced call ({"city":"Paris","unit":"celsius"} is ~15 tokens) or a
# two-key answer with its bounded whitespace to finish on its own.
MAX_TOKENS = 16
MAX_TOKENS_STRUCTURED = 64


class Person(BaseModel):
    """The structured answer: two keys, nothing else allowed when parsed."""

    model_config = ConfigDict(extra="forbid")
    name: str
    age: int


class Address(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str
    country: str


class Resident(BaseModel):
    """A nested model: pydantic writes ``Address`` under ``$defs`` and a ``$ref`` to it."""

    model_config = ConfigDict(extra="forbid")
    name: str
    address: Address


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    model_config = ConfigDict(extra="forbid")
    city: str
    unit: Literal["celsius", "fahrenheit"] = "celsius"


WEATHER_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "The city, e.g. Paris"},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"]}
WEATHER_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": WEATHER_PARAMETERS}}


def get_weather(city: str, unit: str = "celsius") -> str:
    """Get the current weather in a city."""
    return f"18 degrees {unit} and sunny in {city}"


def _closed(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with every object that declares properties closed to other keys (what
    the server's default promises), so ``jsonschema`` checks "exactly the declared keys"."""
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    return schema


def assert_arguments(arguments: str | dict[str, Any],
                     parameters: dict[str, Any] = WEATHER_PARAMETERS) -> dict[str, Any]:
    """Arguments of a ``get_weather`` call (the JSON text or an already parsed dict), valid
    against the declared ``parameters`` with no undeclared key; returns them parsed."""
    value = json.loads(arguments) if isinstance(arguments, str) else arguments
    assert isinstance(value, dict), value
    jsonschema.validate(value, _closed(parameters))
    get_weather(**value)  # what a framework does with them: no TypeError
    return value


def assert_person(text: str) -> Person:
    """A structured answer: JSON that parses into ``Person`` with no other key."""
    return Person.model_validate_json(text)


# A forced call of the one declared tool, as tool_choice names it.
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def user(text: str) -> list[dict]:
    """One user message, as the chat APIs take it."""
    return [{"role": "user", "content": text}]
