"""``langchain-openai``'s ``ChatOpenAI`` against ``freetoken serve`` (default model):
``invoke``, ``stream``, ``with_structured_output`` (``json_schema`` and
``function_calling``, strict or not) and ``bind_tools`` with a forced tool (named, and
``"any"``, which LangChain sends as ``required``), plain and streamed."""

from __future__ import annotations

import pytest
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
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from server_fixtures import Server

weather_tool = tool(get_weather)


@pytest.fixture(scope="module")
def llm(base_url: str, default_server: Server) -> ChatOpenAI:
    return ChatOpenAI(base_url=base_url, api_key="sk-dummy", model=default_server.model,
                      temperature=0, max_tokens=MAX_TOKENS, max_retries=0, stream_usage=True)


@pytest.fixture(scope="module")
def llm_long(llm: ChatOpenAI) -> ChatOpenAI:
    """Room for a structured answer or a tool call to finish on its own."""
    return llm.model_copy(update={"max_tokens": MAX_TOKENS_STRUCTURED})


def test_invoke(llm: ChatOpenAI, default_server: Server) -> None:
    out = llm.invoke(QUESTION)
    assert isinstance(out, AIMessage) and isinstance(out.content, str) and out.content
    assert out.response_metadata["finish_reason"] in ("stop", "length")
    assert out.response_metadata["model_name"] == default_server.model
    usage = out.usage_metadata
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"] > 0


def test_stream_equals_invoke(llm: ChatOpenAI) -> None:
    full = llm.invoke(QUESTION)
    chunks = list(llm.stream(QUESTION))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    merged = chunks[0]
    for c in chunks[1:]:
        merged += c
    assert merged.content == full.content
    finishes = [c.response_metadata["finish_reason"] for c in chunks
                if c.response_metadata.get("finish_reason")]
    assert finishes == [full.response_metadata["finish_reason"]]
    assert merged.usage_metadata == full.usage_metadata


@pytest.mark.parametrize(("method", "strict"), [
    ("json_schema", None), ("json_schema", True), ("function_calling", None),
    ("function_calling", True)])
def test_structured_output(llm_long: ChatOpenAI, method: str, strict: bool | None) -> None:
    structured = llm_long.with_structured_output(Person, method=method, strict=strict, include_raw=True)
    out = structured.invoke(PERSON_QUESTION)
    assert out["parsing_error"] is None, out
    assert isinstance(out["parsed"], Person)
    expected = "stop" if method == "json_schema" else "tool_calls"
    assert out["raw"].response_metadata["finish_reason"] == expected, out["raw"]


@pytest.mark.parametrize("tool_choice", ["get_weather", "any"])
def test_forced_tool_call(llm_long: ChatOpenAI, tool_choice: str) -> None:
    bound = llm_long.bind_tools([weather_tool], tool_choice=tool_choice,
                                parallel_tool_calls=False)
    out = bound.invoke(WEATHER_QUESTION)
    assert out.response_metadata["finish_reason"] == "tool_calls", out
    assert out.invalid_tool_calls == []
    (call,) = out.tool_calls
    assert call["name"] == "get_weather" and call["id"]
    assert_arguments(call["args"], weather_tool.tool_call_schema.model_json_schema())
    assert weather_tool.invoke(call["args"]).startswith("18 degrees")


def test_forced_strict_tool_call_streamed(llm_long: ChatOpenAI) -> None:
    bound = llm_long.bind_tools([weather_tool], tool_choice="get_weather", strict=True)
    chunks = list(bound.stream(WEATHER_QUESTION))
    merged = chunks[0]
    for c in chunks[1:]:
        merged += c
    assert merged.response_metadata["finish_reason"] == "tool_calls"
    assert merged.invalid_tool_calls == []
    (call,) = merged.tool_calls
    assert call["name"] == "get_weather"
    assert_arguments(call["args"], weather_tool.tool_call_schema.model_json_schema())


def test_tool_message_round_trip(llm_long: ChatOpenAI) -> None:
    """The agent loop by hand: the forced call, the tool's ``ToolMessage`` sent back with
    the call's id, and a free answer to the whole history."""
    messages = [HumanMessage(WEATHER_QUESTION)]
    ai = llm_long.bind_tools([weather_tool], tool_choice="get_weather").invoke(messages)
    (call,) = ai.tool_calls
    messages += [ai, ToolMessage(weather_tool.invoke(call["args"]), tool_call_id=call["id"])]
    out = llm_long.bind_tools([weather_tool]).invoke(messages)
    assert out.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")
    assert out.invalid_tool_calls == []
    assert out.content or out.tool_calls
