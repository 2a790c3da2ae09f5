"""The official ``openai`` SDK against ``freetoken serve`` (default model): chat and
completions, plain and streamed, ``chat.completions.parse`` into a pydantic model, and
forced tool calls (named and ``required``), including the SDK's strict function tools."""

from __future__ import annotations

import openai
import pytest
from framework_checks import (
    MAX_TOKENS,
    MAX_TOKENS_STRUCTURED,
    NAMED,
    PERSON_QUESTION,
    QUESTION,
    RESIDENT_QUESTION,
    WEATHER_PARAMETERS,
    WEATHER_QUESTION,
    WEATHER_TOOL,
    GetWeather,
    Person,
    Resident,
    assert_arguments,
    assert_person,
    user,
)
from server_fixtures import Server


def test_chat(client: openai.OpenAI, default_server: Server) -> None:
    out = client.chat.completions.create(model=default_server.model, messages=user(QUESTION),
                                         max_tokens=MAX_TOKENS, temperature=0)
    assert out.object == "chat.completion" and out.model == default_server.model
    (choice,) = out.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_chat_stream_ends_cleanly(client: openai.OpenAI, default_server: Server) -> None:
    full = client.chat.completions.create(model=default_server.model, messages=user(QUESTION),
                                          max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(client.chat.completions.create(
        model=default_server.model, messages=user(QUESTION), max_tokens=MAX_TOKENS,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    assert {c.id for c in chunks} == {chunks[0].id}
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert "".join(ch.delta.content or "" for c in chunks for ch in c.choices) == \
        full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


def test_completions_plain_and_streamed(client: openai.OpenAI,
                                        default_server: Server) -> None:
    full = client.completions.create(model=default_server.model, prompt="Paris is",
                                     max_tokens=MAX_TOKENS, temperature=0)
    assert full.object == "text_completion" and full.choices[0].finish_reason in ("stop",
                                                                                  "length")
    chunks = list(client.completions.create(model=default_server.model, prompt="Paris is",
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == \
        [full.choices[0].finish_reason]


def test_parse_into_a_model(client: openai.OpenAI, default_server: Server) -> None:
    """``parse`` sends a strict ``json_schema`` and validates the answer into the model."""
    out = client.chat.completions.parse(
        model=default_server.model, messages=user(PERSON_QUESTION), response_format=Person,
        max_tokens=MAX_TOKENS_STRUCTURED, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Person)
    assert_person(choice.message.content)


def test_parse_streamed(client: openai.OpenAI, default_server: Server) -> None:
    with client.chat.completions.stream(
            model=default_server.model, messages=user(PERSON_QUESTION), response_format=Person,
            max_tokens=MAX_TOKENS_STRUCTURED, temperature=0) as stream:
        kinds = {event.type for event in stream}
        final = stream.get_final_completion()
    assert {"content.delta", "content.done"} <= kinds, kinds
    assert final.choices[0].finish_reason == "stop"
    assert isinstance(final.choices[0].message.parsed, Person)


@pytest.mark.parametrize("tool_choice", [NAMED, "required"], ids=["named", "required"])
def test_forced_tool_call(client: openai.OpenAI, default_server: Server,
                          tool_choice: object) -> None:
    out = client.chat.completions.create(
        model=default_server.model, messages=user(WEATHER_QUESTION), tools=[WEATHER_TOOL],
        tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=MAX_TOKENS_STRUCTURED,
        temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    assert_arguments(call.function.arguments)


def test_strict_pydantic_tool_parsed(client: openai.OpenAI, default_server: Server) -> None:
    """``openai.pydantic_function_tool`` sends ``strict: true``; ``parse`` validates the
    arguments into the model."""
    tool = openai.pydantic_function_tool(GetWeather, name="get_weather")
    assert tool["function"]["strict"] is True
    out = client.chat.completions.parse(
        model=default_server.model, messages=user(WEATHER_QUESTION), tools=[tool],
        tool_choice=NAMED, max_tokens=MAX_TOKENS_STRUCTURED, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather)
    assert_arguments(call.function.arguments, tool["function"]["parameters"])


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "Resident"}},
                                         "required"], ids=["named", "required"])
def test_nested_model_tool(client: openai.OpenAI, default_server: Server,
                           tool_choice: object) -> None:
    """A tool whose parameters reference ``$defs`` (every nested pydantic model); under
    ``required`` the server embeds it in the array grammar, where the references must
    still resolve (once a 400: "Pointer '/$defs/Address' does not exist")."""
    tool = openai.pydantic_function_tool(Resident)
    assert "$defs" in tool["function"]["parameters"]
    out = client.chat.completions.parse(
        model=default_server.model, messages=user(RESIDENT_QUESTION), tools=[tool],
        tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=MAX_TOKENS_STRUCTURED,
        temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert isinstance(call.function.parsed_arguments, Resident)


def test_forced_tool_call_streamed(client: openai.OpenAI, default_server: Server) -> None:
    with client.chat.completions.stream(
            model=default_server.model, messages=user(WEATHER_QUESTION), tools=[WEATHER_TOOL],
            tool_choice=NAMED, max_tokens=MAX_TOKENS_STRUCTURED, temperature=0) as stream:
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    assert [e.name for e in done] == ["get_weather"]
    assert final.choices[0].finish_reason == "tool_calls"
    (call,) = final.choices[0].message.tool_calls
    assert call.function.arguments == done[0].arguments
    assert_arguments(call.function.arguments, WEATHER_PARAMETERS)


def test_required_with_parallel_calls_streams_as_it_answers(client: openai.OpenAI,
                                                          default_server: Server) -> None:
    """``required`` without ``parallel_tool_calls: false`` (what LangChain's ``"any"`` and
    the Agents SDK send by default) lets the grammar take several calls (a small model
    may repeat its call until ``max_tokens``). Each call returned holds only the declared keys,
    and the streamed deltas (one ``index`` per call) rebuild the same calls."""
    body = {"model": default_server.model, "messages": user(WEATHER_QUESTION),
            "tools": [WEATHER_TOOL], "tool_choice": "required", "max_tokens": 40,
            "temperature": 0}
    choice = client.chat.completions.create(**body).choices[0]
    assert choice.finish_reason in ("tool_calls", "length"), choice
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert calls
    for name, arguments in calls:
        assert name == "get_weather"
        assert_arguments(arguments)

    streamed: dict[int, list[str]] = {}
    finishes = []
    for chunk in client.chat.completions.create(**body, stream=True):
        for ch in chunk.choices:
            for delta in ch.delta.tool_calls or []:
                if delta.index not in streamed:
                    assert delta.id and delta.function.name
                    streamed[delta.index] = [delta.function.name, ""]
                streamed[delta.index][1] += delta.function.arguments or ""
            if ch.finish_reason:
                finishes.append(ch.finish_reason)
    assert finishes == [choice.finish_reason]
    assert sorted(streamed) == list(range(len(streamed)))
    assert [tuple(streamed[i]) for i in sorted(streamed)] == calls
