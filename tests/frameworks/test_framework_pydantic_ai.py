"""``pydantic-ai`` (``OpenAIChatModel`` with an ``OpenAIProvider`` on ``base_url``) against
``freetoken serve`` (default model): an agent run, a streamed run, structured output both
as pydantic-ai's output tool (a tool call forced with ``required``) and as
``NativeOutput`` (a strict ``json_schema``), and forced function tools (named and
``required``) through ``pydantic_ai.direct.model_request``, plain and streamed: an agent
refuses a static forcing ``tool_choice``, which would never let it finish."""

from __future__ import annotations

import asyncio

import pytest
from framework_checks import (
    MAX_TOKENS,
    MAX_TOKENS_STRUCTURED,
    PERSON_QUESTION,
    QUESTION,
    RESIDENT_QUESTION,
    WEATHER_PARAMETERS,
    WEATHER_QUESTION,
    Person,
    Resident,
    assert_arguments,
)
from pydantic_ai import Agent, NativeOutput
from pydantic_ai.direct import model_request, model_request_stream
from pydantic_ai.messages import ModelRequest, ModelResponse, ToolCallPart
from pydantic_ai.models import ModelRequestParameters
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.tools import ToolDefinition
from server_fixtures import Server

WEATHER = ToolDefinition(name="get_weather", description="Get the current weather in a city.",
                         parameters_json_schema=WEATHER_PARAMETERS)


@pytest.fixture
def model(base_url: str, default_server: Server) -> OpenAIChatModel:
    """A model per test: its HTTP pool belongs to the event loop of the test's run."""
    return OpenAIChatModel(default_server.model,
                           provider=OpenAIProvider(base_url=base_url, api_key="sk-dummy"))


def _responses(messages: list) -> list[ModelResponse]:
    return [m for m in messages if isinstance(m, ModelResponse)]


def test_run(model: OpenAIChatModel, default_server: Server) -> None:
    agent = Agent(model, model_settings={"max_tokens": MAX_TOKENS, "temperature": 0})
    result = agent.run_sync(QUESTION)
    assert isinstance(result.output, str) and result.output
    (response,) = _responses(result.all_messages())
    assert response.model_name == default_server.model
    assert response.finish_reason in ("stop", "length")
    assert result.usage.output_tokens > 0


def test_run_stream_equals_run(model: OpenAIChatModel) -> None:
    agent = Agent(model, model_settings={"max_tokens": MAX_TOKENS, "temperature": 0})

    async def both() -> tuple[str, list[str], str]:
        full = await agent.run(QUESTION)
        async with agent.run_stream(QUESTION) as run:
            deltas = [d async for d in run.stream_text(delta=True)]
            return full.output, deltas, run.response.finish_reason

    full, deltas, finish = asyncio.run(both())
    assert "".join(deltas) == full
    assert finish in ("stop", "length")


def test_output_tool(model: OpenAIChatModel) -> None:
    """The default structured output: an output tool the model is forced to call."""
    agent = Agent(model, output_type=Person,
                  model_settings={"max_tokens": MAX_TOKENS_STRUCTURED, "temperature": 0})
    result = agent.run_sync(PERSON_QUESTION)
    assert isinstance(result.output, Person)
    (response,) = _responses(result.all_messages())
    assert response.finish_reason == "tool_call"
    (call,) = [p for p in response.parts if isinstance(p, ToolCallPart)]
    Person.model_validate(call.args_as_dict())


def test_nested_output_tool(model: OpenAIChatModel) -> None:
    """The output tool of a nested model (``$defs`` in its parameters), forced with
    ``required``."""
    agent = Agent(model, output_type=Resident,
                  model_settings={"max_tokens": MAX_TOKENS_STRUCTURED, "temperature": 0})
    result = agent.run_sync(RESIDENT_QUESTION)
    assert isinstance(result.output, Resident)


def test_native_output(model: OpenAIChatModel) -> None:
    agent = Agent(model, output_type=NativeOutput(Person),
                  model_settings={"max_tokens": MAX_TOKENS_STRUCTURED, "temperature": 0})
    result = agent.run_sync(PERSON_QUESTION)
    assert isinstance(result.output, Person)
    (response,) = _responses(result.all_messages())
    assert response.finish_reason == "stop"


@pytest.mark.parametrize("tool_choice", [["get_weather"], "required"],
                         ids=["named", "required"])
def test_forced_tool_call(model: OpenAIChatModel, tool_choice: object) -> None:
    response = asyncio.run(model_request(
        model, [ModelRequest.user_text_prompt(WEATHER_QUESTION)],
        model_settings={"max_tokens": MAX_TOKENS_STRUCTURED, "temperature": 0,
                        "tool_choice": tool_choice, "parallel_tool_calls": False},
        model_request_parameters=ModelRequestParameters(function_tools=[WEATHER])))
    assert response.finish_reason == "tool_call", response
    (call,) = response.parts
    assert isinstance(call, ToolCallPart) and call.tool_name == "get_weather"
    assert_arguments(call.args_as_dict())


def test_forced_tool_call_streamed(model: OpenAIChatModel) -> None:
    async def run() -> ModelResponse:
        async with model_request_stream(
                model, [ModelRequest.user_text_prompt(WEATHER_QUESTION)],
                model_settings={"max_tokens": MAX_TOKENS_STRUCTURED, "temperature": 0,
                                "tool_choice": ["get_weather"]},
                model_request_parameters=ModelRequestParameters(
                    function_tools=[WEATHER])) as stream:
            async for _ in stream:
                pass
            return stream.get()

    response = asyncio.run(run())
    assert response.finish_reason == "tool_call", response
    (call,) = response.parts
    assert isinstance(call, ToolCallPart) and call.tool_name == "get_weather"
    assert_arguments(call.args_as_dict())
