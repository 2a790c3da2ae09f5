"""Thirty JSON schemas, each with a short request for a document that fits it.

What ``bench/structured_outputs.py`` generates against: everyday shapes (a person, an order,
a calendar event ...) that together cover nested objects, arrays bounded by ``minItems`` /
``maxItems``, ``enum`` and ``const``, ``anyOf``, integers and numbers with ``minimum`` /
``maximum``, string ``pattern`` and ``maxLength``, the ``date``, ``date-time``, ``email``,
``uuid`` and ``ipv4`` formats, ``$defs`` references, and required beside optional keys.
Every schema compiles on both backends (llguidance and xgrammar); validate with
``jsonschema`` and a ``FormatChecker`` so that formats count.

``SCHEMAS`` is a list of ``JsonCase(name, prompt, schema)``; names are unique.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["SCHEMAS", "JsonCase"]


@dataclass(frozen=True)
class JsonCase:
    name: str
    prompt: str
    schema: dict[str, Any]


def _obj(properties: dict[str, Any], required: list[str] | None = None,
         closed: bool = True) -> dict[str, Any]:
    """An object schema; every property required unless ``required`` says otherwise."""
    schema: dict[str, Any] = {"type": "object", "properties": properties,
                              "required": list(properties) if required is None else required}
    if closed:
        schema["additionalProperties"] = False
    return schema


_STR = {"type": "string", "maxLength": 40}
_NAME = {"type": "string", "pattern": "^[A-Z][a-z]+( [A-Z][a-z]+)?$"}
_INT = {"type": "integer"}
_BOOL = {"type": "boolean"}
_DATE = {"type": "string", "format": "date"}
_EMAIL = {"type": "string", "format": "email"}
_UUID = {"type": "string", "format": "uuid"}

SCHEMAS: list[JsonCase] = [
    JsonCase("person", "Describe a fictional person as JSON with a name and an age.",
             _obj({"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    JsonCase("contact", "Give a contact card in JSON: name, email and an optional phone.",
             _obj({"name": _NAME, "email": _EMAIL,
                   "phone": {"type": "string", "pattern": r"^\+?[0-9 ]{7,15}$"}},
                  required=["name", "email"])),
    JsonCase("book", "Describe a made-up book as JSON: title, author, year and 1 to 3 genres.",
             _obj({"title": _STR, "author": _NAME,
                   "year": {"type": "integer", "minimum": 1450, "maximum": 2025},
                   "genres": {"type": "array", "minItems": 1, "maxItems": 3,
                              "items": {"enum": ["fiction", "mystery", "science", "history",
                                                 "poetry", "fantasy"]}}})),
    JsonCase("weather", "Report today's weather in Paris as JSON.",
             _obj({"city": _STR,
                   "temperature_c": {"type": "number", "minimum": -50, "maximum": 60},
                   "condition": {"enum": ["sunny", "cloudy", "rain", "snow", "fog"]},
                   "humidity": {"type": "integer", "minimum": 0, "maximum": 100}})),
    JsonCase("event", "Plan a team meeting as JSON: title, date, attendees, online or not.",
             _obj({"title": _STR, "date": _DATE,
                   "attendees": {"type": "array", "minItems": 1, "maxItems": 4,
                                 "items": _NAME},
                   "online": _BOOL})),
    JsonCase("address", "Write a postal address in JSON with street, city, postcode, country.",
             _obj({"street": _STR, "city": _STR,
                   "postcode": {"type": "string", "pattern": "^[0-9]{5}$"},
                   "country": {"type": "string", "pattern": "^[A-Z]{2}$"}})),
    JsonCase("order", "Create an online shop order as JSON with an id, items and a total.",
             _obj({"order_id": _UUID,
                   "items": {"type": "array", "minItems": 1, "maxItems": 3,
                             "items": _obj({"sku": {"type": "string",
                                                    "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                            "quantity": {"type": "integer", "minimum": 1,
                                                         "maximum": 10}})},
                   "total": {"type": "number", "minimum": 0, "maximum": 10000}})),
    JsonCase("user_profile", "Make a user profile in JSON: username, email, signup date, "
             "and an optional bio.",
             _obj({"username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,15}$"},
                   "email": _EMAIL, "signed_up": _DATE, "bio": _STR},
                  required=["username", "email", "signed_up"])),
    JsonCase("recipe", "Give a short recipe as JSON: name, servings, 2 to 5 ingredients and "
             "the steps.",
             _obj({"name": _STR, "servings": {"type": "integer", "minimum": 1, "maximum": 12},
                   "ingredients": {"type": "array", "minItems": 2, "maxItems": 5,
                                   "items": _obj({"item": _STR,
                                                  "grams": {"type": "integer", "minimum": 1,
                                                            "maximum": 2000}})},
                   "steps": {"type": "array", "minItems": 1, "maxItems": 4, "items": _STR}})),
    JsonCase("movie_review", "Review a film in JSON: title, rating out of 5, and a verdict.",
             _obj({"title": _STR,
                   "rating": {"type": "number", "minimum": 0, "maximum": 5},
                   "verdict": {"enum": ["must see", "worth it", "skip"]}})),
    JsonCase("sentiment", "Classify the sentiment of 'I love this phone' as JSON.",
             _obj({"label": {"enum": ["positive", "negative", "neutral"]},
                   "confidence": {"type": "number", "minimum": 0, "maximum": 1}})),
    JsonCase("flight", "Describe a flight booking as JSON: flight number, from, to, "
             "departure time and seat.",
             _obj({"flight": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2,4}$"},
                   "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                   "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
                   "departure": {"type": "string", "format": "date-time"},
                   "seat": {"type": "string", "pattern": "^[0-9]{1,2}[A-F]$"}})),
    JsonCase("product", "Describe a product for sale in JSON with a price and stock.",
             _obj({"name": _STR, "price": {"type": "number", "minimum": 0.01,
                                           "maximum": 5000},
                   "currency": {"enum": ["EUR", "USD", "GBP"]},
                   "in_stock": _BOOL,
                   "tags": {"type": "array", "maxItems": 3, "items": _STR}},
                  required=["name", "price", "currency", "in_stock"])),
    JsonCase("employee", "Give an employee record as JSON, with the manager as a nested "
             "object.",
             _obj({"name": _NAME, "id": {"type": "integer", "minimum": 1000, "maximum": 9999},
                   "department": {"enum": ["sales", "engineering", "support", "finance"]},
                   "manager": _obj({"name": _NAME, "email": _EMAIL})})),
    JsonCase("todo_list", "Write a to-do list in JSON with 1 to 4 tasks.",
             _obj({"tasks": {"type": "array", "minItems": 1, "maxItems": 4,
                             "items": _obj({"task": _STR, "done": _BOOL,
                                            "priority": {"enum": ["low", "medium", "high"]}})
                             }})),
    JsonCase("payment", "Record a payment as JSON, paid either by card or by bank transfer.",
             _obj({"amount": {"type": "number", "minimum": 0, "maximum": 100000},
                   "method": {"anyOf": [
                       _obj({"type": {"const": "card"},
                             "last4": {"type": "string", "pattern": "^[0-9]{4}$"}}),
                       _obj({"type": {"const": "transfer"},
                             "iban": {"type": "string",
                                      "pattern": "^[A-Z]{2}[0-9]{2}[A-Z0-9]{8,20}$"}})]}})),
    JsonCase("geo_point", "Give the coordinates of a famous landmark as JSON.",
             _obj({"name": _STR,
                   "latitude": {"type": "number", "minimum": -90, "maximum": 90},
                   "longitude": {"type": "number", "minimum": -180, "maximum": 180}})),
    JsonCase("server_config", "Write a small web server configuration in JSON.",
             _obj({"host": {"type": "string", "format": "ipv4"},
                   "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                   "tls": _BOOL,
                   "log_level": {"enum": ["debug", "info", "warning", "error"]},
                   "workers": {"type": "integer", "minimum": 1, "maximum": 64}},
                  required=["host", "port", "tls"])),
    JsonCase("quiz", "Write one multiple-choice quiz question as JSON with 3 or 4 options.",
             _obj({"question": {"type": "string", "maxLength": 80},
                   "options": {"type": "array", "minItems": 3, "maxItems": 4,
                               "items": {"type": "string", "maxLength": 30}},
                   "answer": {"type": "integer", "minimum": 0, "maximum": 3}})),
    JsonCase("invoice", "Make an invoice as JSON: number, issue date, customer and lines.",
             {"$defs": {"line": _obj({"description": _STR,
                                      "amount": {"type": "number", "minimum": 0,
                                                 "maximum": 10000}})},
              **_obj({"number": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
                      "issued": _DATE, "customer": _NAME,
                      "lines": {"type": "array", "minItems": 1, "maxItems": 3,
                                "items": {"$ref": "#/$defs/line"}}})}),
    JsonCase("color", "Name a colour and give it as RGB and hex in JSON.",
             _obj({"name": _STR,
                   "rgb": {"type": "array", "minItems": 3, "maxItems": 3,
                           "items": {"type": "integer", "minimum": 0, "maximum": 255}},
                   "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}})),
    JsonCase("task_status", "Report the status of a background job in JSON.",
             _obj({"job_id": _UUID,
                   "status": {"enum": ["queued", "running", "done", "failed"]},
                   "progress": {"type": "integer", "minimum": 0, "maximum": 100},
                   "error": {"anyOf": [{"type": "string", "maxLength": 60},
                                       {"type": "null"}]}},
                  required=["job_id", "status", "progress"])),
    JsonCase("country", "Give facts about Japan as JSON: capital, population, languages.",
             _obj({"name": _STR, "capital": _STR,
                   "population": {"type": "integer", "minimum": 0, "maximum": 2000000000},
                   "languages": {"type": "array", "minItems": 1, "maxItems": 3,
                                 "items": _STR}})),
    JsonCase("library_loan", "Record a library book loan as JSON.",
             _obj({"isbn": {"type": "string", "pattern": "^97[89][0-9]{10}$"},
                   "borrower": _obj({"name": _NAME, "card": {"type": "integer",
                                                             "minimum": 1, "maximum": 99999}}),
                   "due": _DATE, "renewed": _BOOL}, required=["isbn", "borrower", "due"])),
    JsonCase("workout", "Plan a workout as JSON with 2 to 4 exercises.",
             _obj({"day": {"enum": ["monday", "tuesday", "wednesday", "thursday", "friday",
                                    "saturday", "sunday"]},
                   "exercises": {"type": "array", "minItems": 2, "maxItems": 4,
                                 "items": _obj({"name": _STR,
                                                "sets": {"type": "integer", "minimum": 1,
                                                         "maximum": 6},
                                                "reps": {"type": "integer", "minimum": 1,
                                                         "maximum": 30}})}})),
    JsonCase("shape", "Describe a geometric shape as JSON: a circle or a rectangle.",
             {"anyOf": [
                 _obj({"kind": {"const": "circle"},
                       "radius": {"type": "number", "minimum": 0, "maximum": 100}}),
                 _obj({"kind": {"const": "rectangle"},
                       "width": {"type": "number", "minimum": 0, "maximum": 100},
                       "height": {"type": "number", "minimum": 0, "maximum": 100}})]}),
    JsonCase("meeting_notes", "Summarise a meeting as JSON: date, decisions and action items.",
             _obj({"date": _DATE,
                   "decisions": {"type": "array", "maxItems": 3, "items": _STR},
                   "actions": {"type": "array", "minItems": 1, "maxItems": 3,
                               "items": _obj({"owner": _NAME, "action": _STR,
                                              "due": _DATE}, required=["owner", "action"])}})),
    JsonCase("api_error", "Return an API error response as JSON.",
             _obj({"error": _obj({"code": {"type": "integer", "minimum": 400, "maximum": 599},
                                  "message": _STR,
                                  "request_id": _UUID})})),
    JsonCase("song", "Describe a song as JSON: title, artist, length in seconds, explicit.",
             _obj({"title": _STR, "artist": _NAME,
                   "seconds": {"type": "integer", "minimum": 30, "maximum": 900},
                   "explicit": _BOOL,
                   "album": _STR}, required=["title", "artist", "seconds"])),
    JsonCase("open_metadata", "Describe a photo as JSON: at least a file name and its width "
             "and height; add any other fields you like.",
             _obj({"file": {"type": "string", "pattern": "^[a-z0-9_]{1,20}\\.(jpg|png)$"},
                   "width": {"type": "integer", "minimum": 1, "maximum": 10000},
                   "height": {"type": "integer", "minimum": 1, "maximum": 10000}},
                  closed=False)),
]

assert len(SCHEMAS) == 30 and len({case.name for case in SCHEMAS}) == 30
