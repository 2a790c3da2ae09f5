"""``litellm`` (its ``openai/`` provider with ``api_base``) against ``freetoken serve``
(default model): ``completion`` plain and streamed (rebuilt with ``stream_chunk_builder``),
``response_format`` from a pydantic model, and forced tool calls (named and ``required``),
plain and streamed, sync and async. The conftest has set ``LITELLM_LOCAL_MODEL_COST_MAP``
before this import, so litellm reads its bundled cost map instead of fetching it."""

from __future__ import annotations

import asyncio
import os
import socket

import litellm
import pytest
from framework_checks import (
    MAX_TOKENS,
    MAX_TOKENS_STRUCTURED,
    NAMED,
    PERSON_QUESTION,
    QUESTION,
    WEATHER_QUESTION,
    WEATHER_TOOL,
    Person,
    assert_arguments,
    assert_person,
    user,
)
from server_fixtures import Server


@pytest.fixture(scope="module")
def args(base_url: str, default_server: Server) -> dict:
    """What every call sends: the server as an OpenAI-compatible ``api_base``."""
    return {"model": f"openai/{default_server.model}", "api_base": base_url,
            "api_key": "sk-dummy", "temperature": 0, "num_retries": 0}


def test_cost_map_is_the_bundled_one() -> None:
    assert os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"
    assert litellm.model_cost  # loaded from the package, not fetched


def test_nothing_leaves_loopback() -> None:
    """The conftest's guard is on: a connection elsewhere fails before any packet."""
    with pytest.raises(AssertionError, match="tried to reach"):
        socket.create_connection(("192.0.2.1", 443), timeout=1)  # TEST-NET-1


def test_completion(args: dict) -> None:
    out = litellm.completion(**args, messages=user(QUESTION), max_tokens=MAX_TOKENS)
    assert isinstance(out, litellm.ModelResponse)
    (choice,) = out.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_stream_rebuilds_the_completion(args: dict) -> None:
    full = litellm.completion(**args, messages=user(QUESTION), max_tokens=MAX_TOKENS)
    chunks = list(litellm.completion(**args, messages=user(QUESTION), max_tokens=MAX_TOKENS,
                                     stream=True))
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    rebuilt = litellm.stream_chunk_builder(chunks, messages=user(QUESTION))
    assert rebuilt.choices[0].message.content == full.choices[0].message.content


def test_response_format_model(args: dict) -> None:
    out = litellm.completion(**args, messages=user(PERSON_QUESTION), response_format=Person,
                             max_tokens=MAX_TOKENS_STRUCTURED)
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    assert_person(choice.message.content)


@pytest.mark.parametrize("tool_choice", [NAMED, "required"], ids=["named", "required"])
def test_forced_tool_call(args: dict, tool_choice: object) -> None:
    out = litellm.completion(**args, messages=user(WEATHER_QUESTION), tools=[WEATHER_TOOL],
                             tool_choice=tool_choice, parallel_tool_calls=False,
                             max_tokens=MAX_TOKENS_STRUCTURED)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id
    assert_arguments(call.function.arguments)


def test_forced_tool_call_streamed_async(args: dict) -> None:
    async def run() -> list:
        stream = await litellm.acompletion(
            **args, messages=user(WEATHER_QUESTION), tools=[WEATHER_TOOL], tool_choice=NAMED,
            max_tokens=MAX_TOKENS_STRUCTURED, stream=True)
        return [chunk async for chunk in stream]

    chunks = asyncio.run(run())
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert finishes == ["tool_calls"]
    rebuilt = litellm.stream_chunk_builder(chunks, messages=user(WEATHER_QUESTION))
    (call,) = rebuilt.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert_arguments(call.function.arguments)
