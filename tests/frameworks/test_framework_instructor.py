"""``instructor`` over the ``openai`` client against ``freetoken serve`` (default model):
a plain completion (``response_model=None``), a response model in the modes that bind the
answer (``TOOLS``: a forced named tool call; ``TOOLS_STRICT``: the same with ``strict:
true``; ``JSON_SCHEMA``: ``response_format`` ``json_schema``; ``JSON``: ``json_object``),
and a streamed partial model. ``MD_JSON`` is left out: nothing binds its free text."""

from __future__ import annotations

import instructor
import openai
import pytest
from framework_checks import (
    MAX_TOKENS,
    MAX_TOKENS_STRUCTURED,
    PERSON_QUESTION,
    QUESTION,
    Person,
    assert_person,
    user,
)
from server_fixtures import Server


def test_plain_completion(client: openai.OpenAI, default_server: Server) -> None:
    patched = instructor.from_openai(client)
    out = patched.chat.completions.create(model=default_server.model, response_model=None,
                                          messages=user(QUESTION), max_tokens=MAX_TOKENS,
                                          temperature=0)
    assert out.choices[0].message.content
    assert out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(("mode", "finish_reason"), [
    (instructor.Mode.TOOLS, "tool_calls"), (instructor.Mode.TOOLS_STRICT, "tool_calls"),
    (instructor.Mode.JSON_SCHEMA, "stop"), (instructor.Mode.JSON, "stop")],
    ids=lambda v: getattr(v, "name", v))
def test_response_model(client: openai.OpenAI, default_server: Server,
                        mode: instructor.Mode, finish_reason: str) -> None:
    patched = instructor.from_openai(client, mode=mode)
    person, raw = patched.chat.completions.create_with_completion(
        model=default_server.model, response_model=Person, messages=user(PERSON_QUESTION),
        max_retries=0, max_tokens=MAX_TOKENS_STRUCTURED, temperature=0)
    assert isinstance(person, Person)
    choice = raw.choices[0]
    assert choice.finish_reason == finish_reason, choice
    if finish_reason == "tool_calls":
        (call,) = choice.message.tool_calls
        assert call.function.name == "Person"
        assert_person(call.function.arguments)


def test_tools_request_forces_the_named_tool(client: openai.OpenAI,
                                             default_server: Server) -> None:
    """What ``Mode.TOOLS`` sends: one tool and ``tool_choice`` naming it (so the check
    above is a forced tool call, not a lucky one)."""
    sent: list[dict] = []
    patched = instructor.from_openai(client, mode=instructor.Mode.TOOLS)
    patched.on("completion:kwargs", lambda *args, **kwargs: sent.append(kwargs))
    patched.chat.completions.create(model=default_server.model, response_model=Person,
                                    messages=user(PERSON_QUESTION), max_retries=0,
                                    max_tokens=MAX_TOKENS_STRUCTURED, temperature=0)
    (kwargs,) = sent
    assert kwargs["tool_choice"] == {"type": "function", "function": {"name": "Person"}}


@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA],
                         ids=lambda v: v.name)
def test_partial_stream(client: openai.OpenAI, default_server: Server,
                        mode: instructor.Mode) -> None:
    patched = instructor.from_openai(client, mode=mode)
    partials = list(patched.chat.completions.create_partial(
        model=default_server.model, response_model=Person, messages=user(PERSON_QUESTION),
        max_retries=0, max_tokens=MAX_TOKENS_STRUCTURED, temperature=0))
    assert len(partials) > 1
    last = partials[-1]
    assert isinstance(last.name, str) and isinstance(last.age, int)
    Person.model_validate(last.model_dump())
