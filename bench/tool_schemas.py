"""Twenty function tools with varied parameter schemas, each with a user message that asks
for it: flat and nested objects, enums, integer and number ranges, booleans, arrays of
strings and of objects, optional properties, string formats and patterns, a map of
string tags and a tool without parameters. Used by ``bench/tool_calls.py``.

Every string has a ``maxLength`` (or a bounded pattern), as strict production schemas do:
with unbounded strings the 135M default model sometimes rambles inside one until
``max_tokens`` cuts the call (the grammar keeps it valid JSON so far, but a cut call does
not parse); bounded, every call ends. ``UNBOUNDED`` gives the same tools without the
bounds, to measure that."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCase:
    name: str
    description: str
    parameters: dict[str, Any] | None
    ask: str

    @property
    def tool(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name, "description": self.description}
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}

    @property
    def schema(self) -> dict[str, Any]:
        """What valid arguments match: a tool without parameters takes none (OpenAI)."""
        if self.parameters is None:
            return {"type": "object", "properties": {}, "additionalProperties": False}
        return self.parameters


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required,
            "additionalProperties": False}


def s(max_length: int, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length, **extra}


NAME, TEXT, EMAIL = s(40), s(200), s(64, format="email")
TOOLS: list[ToolCase] = [
    ToolCase("get_weather", "Current weather in a city",
             _obj({"city": NAME, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}),
             "What's the weather like in Paris today?"),
    ToolCase("search_web", "Search the web",
             _obj({"query": s(80), "max_results": {"type": "integer", "minimum": 1,
                                               "maximum": 10}}),
             "Find me recent news about solar panels."),
    ToolCase("send_email", "Send an email",
             _obj({"to": EMAIL, "subject": s(80), "body": s(400)}),
             "Email bob@example.com that the meeting moved to 3pm."),
    ToolCase("create_event", "Add an event to the calendar",
             _obj({"title": s(80), "date": {"type": "string", "format": "date"},
                   "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 480}}),
             "Put a dentist appointment on my calendar for 2025-03-14, one hour."),
    ToolCase("convert_currency", "Convert an amount between currencies",
             _obj({"amount": {"type": "number", "minimum": 0},
                   "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                   "to": {"type": "string", "pattern": "^[A-Z]{3}$"}}),
             "How much is 250 US dollars in euros?"),
    ToolCase("set_timer", "Start a timer",
             _obj({"seconds": {"type": "integer", "minimum": 1, "maximum": 86400},
                   "label": NAME}, ["seconds"]),
             "Set a timer for ten minutes for the pasta."),
    ToolCase("translate", "Translate text",
             _obj({"text": TEXT, "target_language": {"type": "string",
                                                  "enum": ["en", "fr", "de", "es", "it"]}}),
             "Translate 'good morning' into German."),
    ToolCase("book_flight", "Book a flight",
             _obj({"origin": NAME, "destination": NAME, "date": {"type": "string", "format": "date"},
                   "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
                   "class": {"type": "string", "enum": ["economy", "business", "first"]}}),
             "Book two economy seats from Boston to Chicago on 2025-06-01."),
    ToolCase("add_todo", "Add items to the to-do list",
             _obj({"items": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 5}}),
             "Add milk, eggs and bread to my to-do list."),
    ToolCase("create_user", "Create a user account",
             _obj({"user": _obj({"name": NAME, "age": {"type": "integer", "minimum": 0,
                                                    "maximum": 130},
                                 "admin": {"type": "boolean"}})}),
             "Create an account for Alice, 34 years old, not an admin."),
    ToolCase("calculate", "Evaluate an arithmetic expression",
             _obj({"expression": {"type": "string", "pattern": "^[0-9+*/() .-]{1,40}$"}}),
             "What is 17 times 23?"),
    ToolCase("play_music", "Play music",
             _obj({"artist": s(60), "song": s(60), "shuffle": {"type": "boolean"}}, ["artist"]),
             "Play something by The Beatles."),
    ToolCase("get_stock_price", "Latest price of a stock",
             _obj({"ticker": {"type": "string", "pattern": "^[A-Z]{1,5}$"}}),
             "What's Apple's stock price right now?"),
    ToolCase("order_pizza", "Order a pizza",
             _obj({"size": {"type": "string", "enum": ["small", "medium", "large"]},
                   "toppings": {"type": "array", "maxItems": 4,
                                "items": {"type": "string",
                                          "enum": ["cheese", "ham", "mushroom", "olive"]}},
                   "address": s(120)}),
             "Order a large pizza with ham and mushrooms to 12 Main Street."),
    ToolCase("update_settings", "Change device settings",
             _obj({"brightness": {"type": "integer", "minimum": 0, "maximum": 100},
                   "dark_mode": {"type": "boolean"},
                   "volume": {"type": "number", "minimum": 0, "maximum": 1}}, []),
             "Turn on dark mode and set the brightness to 40."),
    ToolCase("schedule_meeting", "Schedule a meeting with people",
             _obj({"attendees": {"type": "array", "minItems": 1, "maxItems": 4,
                                 "items": _obj({"name": NAME, "email": EMAIL})},
                   "topic": s(80)}),
             "Schedule a meeting about the budget with Carol (carol@corp.com)."),
    ToolCase("get_time", "The current time", None, "What time is it?"),
    ToolCase("rate_movie", "Rate a movie",
             _obj({"title": s(80), "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                   "review": TEXT}, ["title", "stars"]),
             "Give Inception five stars."),
    ToolCase("store_note", "Store a note with free-form metadata",
             _obj({"text": TEXT, "metadata": {"type": "object", "maxProperties": 4,
                                              "additionalProperties": s(32)}}),
             "Save a note saying 'call mom' tagged as personal."),
    ToolCase("navigate", "Directions between two places",
             _obj({"from": s(80), "to": s(80),
                   "mode": {"type": "string", "enum": ["driving", "walking", "transit"]},
                   "avoid": {"type": "array", "items": {"type": "string",
                                                        "enum": ["tolls", "highways"]}}},
                  ["from", "to", "mode"]),
             "How do I walk from the station to the museum?"),
]
assert len(TOOLS) == 20 and len({t.name for t in TOOLS}) == 20


def _unbounded(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {k: _unbounded(v) for k, v in schema.items()
                if k not in ("maxLength", "maxProperties")}
    return [_unbounded(v) for v in schema] if isinstance(schema, list) else schema


UNBOUNDED: list[ToolCase] = [
    ToolCase(t.name, t.description, None if t.parameters is None else _unbounded(t.parameters),
             t.ask) for t in TOOLS]
"""The same tools with no ``maxLength`` / ``maxProperties`` anywhere."""
