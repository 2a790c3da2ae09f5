"""``openai-agents`` (the Agents SDK) on its Chat Completions model against ``freetoken
serve`` (default model): a run, a streamed run, a structured ``output_type`` (a strict
``json_schema``) and function tools forced by ``tool_choice`` (named and ``required``;
the SDK's ``function_tool`` schemas are strict). Trace export is off: nothing leaves
loopback."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    ToolCallItem,
    ToolCallOutputItem,
    function_tool,
    set_tracing_disabled,
)
from agents.stream_events import RawResponsesStreamEvent
from framework_checks import (
    MAX_TOKENS,
    MAX_TOKENS_STRUCTURED,
    PERSON_QUESTION,
    QUESTION,
    WEATHER_QUESTION,
    Person,
    assert_arguments,
    get_weather,
)
from server_fixtures import Server

set_tracing_disabled(True)
weather_tool = function_tool(get_weather)


@pytest.fixture
def model(base_url: str, default_server: Server) -> OpenAIChatCompletionsModel:
    """A model per test: its ``AsyncOpenAI`` pool belongs to one event loop, and each test
    runs its own (``asyncio.run``)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="sk-dummy", max_retries=0)
    return OpenAIChatCompletionsModel(model=default_server.model, openai_client=client)


def _settings(max_tokens: int = MAX_TOKENS, **kwargs) -> ModelSettings:
    return ModelSettings(max_tokens=max_tokens, temperature=0, **kwargs)


def test_run(model: OpenAIChatCompletionsModel) -> None:
    agent = Agent(name="assistant", instructions="Answer briefly.", model=model,
                  model_settings=_settings())
    result = asyncio.run(Runner.run(agent, QUESTION))
    assert isinstance(result.final_output, str) and result.final_output
    (response,) = result.raw_responses
    assert response.usage.output_tokens > 0


def test_run_streamed_equals_run(model: OpenAIChatCompletionsModel) -> None:
    agent = Agent(name="assistant", instructions="Answer briefly.", model=model,
                  model_settings=_settings())

    async def streamed() -> tuple[list, object]:
        run = Runner.run_streamed(agent, QUESTION)
        events = [event async for event in run.stream_events()]
        return events, run

    async def both() -> tuple[object, list, object]:
        full = await Runner.run(agent, QUESTION)
        return (full, *await streamed())

    full, events, run = asyncio.run(both())
    assert run.is_complete and run.final_output == full.final_output
    raw = [e.data.type for e in events if isinstance(e, RawResponsesStreamEvent)]
    assert "response.output_text.delta" in raw
    assert raw[-1] == "response.completed"


def test_structured_output_type(model: OpenAIChatCompletionsModel) -> None:
    agent = Agent(name="assistant", instructions="Answer in JSON.", model=model,
                  output_type=Person, model_settings=_settings(MAX_TOKENS_STRUCTURED))
    result = asyncio.run(Runner.run(agent, PERSON_QUESTION))
    assert isinstance(result.final_output, Person)


@pytest.mark.parametrize("tool_choice", ["get_weather", "required"])
def test_forced_tool_call(model: OpenAIChatCompletionsModel, tool_choice: str) -> None:
    """The forced call runs the tool, whose output ends the run (``stop_on_first_tool``)."""
    assert weather_tool.strict_json_schema
    agent = Agent(name="assistant", instructions="Use the tools.", model=model,
                  tools=[weather_tool], tool_use_behavior="stop_on_first_tool",
                  model_settings=_settings(MAX_TOKENS_STRUCTURED, tool_choice=tool_choice,
                                           parallel_tool_calls=False))
    result = asyncio.run(Runner.run(agent, WEATHER_QUESTION))
    calls = [i for i in result.new_items if isinstance(i, ToolCallItem)]
    outputs = [i for i in result.new_items if isinstance(i, ToolCallOutputItem)]
    (call,) = calls
    assert call.raw_item.name == "get_weather"
    arguments = assert_arguments(call.raw_item.arguments, weather_tool.params_json_schema)
    assert result.final_output == get_weather(**arguments) == outputs[0].output


def test_forced_tool_call_streamed(model: OpenAIChatCompletionsModel) -> None:
    agent = Agent(name="assistant", instructions="Use the tools.", model=model,
                  tools=[weather_tool], tool_use_behavior="stop_on_first_tool",
                  model_settings=_settings(MAX_TOKENS_STRUCTURED, tool_choice="get_weather"))

    async def streamed():
        run = Runner.run_streamed(agent, WEATHER_QUESTION)
        events = [event async for event in run.stream_events()]
        return events, run

    events, run = asyncio.run(streamed())
    assert run.is_complete
    done = [e.data for e in events if isinstance(e, RawResponsesStreamEvent)
            and e.data.type == "response.output_item.done"
            and getattr(e.data.item, "type", None) == "function_call"]
    (item,) = done
    assert item.item.name == "get_weather"
    arguments = assert_arguments(json.loads(item.item.arguments))
    assert run.final_output == get_weather(**arguments)


def test_tool_result_goes_back_to_the_model(model: OpenAIChatCompletionsModel) -> None:
    """The default loop: the forced call runs, the SDK resets ``tool_choice`` and sends the
    call and its output back (an assistant ``tool_calls`` message and a ``tool`` message),
    and the model's text ends the run."""
    agent = Agent(name="assistant", instructions="Use the tools.", model=model,
                  tools=[weather_tool],
                  model_settings=_settings(MAX_TOKENS_STRUCTURED, tool_choice="required",
                                           parallel_tool_calls=False))
    result = asyncio.run(Runner.run(agent, WEATHER_QUESTION, max_turns=2))
    kinds = [type(i).__name__ for i in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"], kinds
    assert isinstance(result.final_output, str) and result.final_output
    assert len(result.raw_responses) == 2
