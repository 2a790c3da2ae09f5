"""The ``AddRequest`` message between the server and the engine process: the core
parameters and each plugin's typed, validated ``Fields`` arrive as they were sent, and the
engine validates nothing again (``SamplingParams.trusted``)."""

from __future__ import annotations

import msgspec
import pytest

from freetoken_core.engine.process import add_request, params_of, to_engine_type
from freetoken_core.plugins import PluginManager
from freetoken_core.processors import ModelInfo
from freetoken_core.sampling_params import INT64_MAX, SamplingParams

MODEL = ModelInfo(vocab_size=1000, eos_token_ids=frozenset({0}), max_model_len=512)
PLUGINS = "min_p,stop_tokens,fim"


@pytest.fixture(scope="module")
def plugins() -> PluginManager:
    return PluginManager(PLUGINS)


def round_trip(plugins: PluginManager, params: SamplingParams, is_chat: bool = False
               ) -> tuple[object, SamplingParams]:
    """``params`` encoded as the server sends them and decoded as the engine reads them."""
    wire = msgspec.msgpack.encode(add_request("r-1", [5, 6, 7], params, is_chat))
    message = msgspec.msgpack.Decoder(to_engine_type(plugins.fields_types())).decode(wire)
    return message, params_of(message)


@pytest.mark.parametrize("is_chat", [False, True])
def test_core_and_plugin_fields_arrive_typed(plugins: PluginManager, is_chat: bool) -> None:
    params = SamplingParams(n=2, temperature=0.7, top_k=40, max_tokens=9, seed=INT64_MAX,
                            stop=["\n"], logprobs=3, cache_salt="s", min_p=0.1,
                            stop_token_ids=[9, 4, 9], suffix="")
    plugins.validate(params, MODEL, "completions")
    message, got = round_trip(plugins, params, is_chat)
    assert (message.request_id, message.prompt_token_ids, message.is_chat) == (
        "r-1", [5, 6, 7], is_chat)
    assert got.core_fields() == params.core_fields()
    assert got.fields == params.fields
    for name, cls in plugins.fields_types().items():
        assert type(got.fields[name]) is cls
    assert got.fields["stop_tokens"].stop_token_ids == [9, 4]  # validated
    assert got.extra == {}


def test_a_request_without_plugin_fields(plugins: PluginManager) -> None:
    params = SamplingParams(temperature=0, min_p=0)  # min_p 0: the plugin is not used
    plugins.validate(params, MODEL)
    assert params.fields == {}
    _, got = round_trip(plugins, params)
    assert got.fields == {} and got.is_greedy and got.max_tokens == 16


def test_the_engine_trusts_what_it_receives(plugins: PluginManager) -> None:
    params = SamplingParams(min_p=0.5)
    plugins.validate(params, MODEL)
    core = params.core_fields()
    # A value the engine would refuse on construction is not checked again.
    trusted = SamplingParams.trusted({**core, "top_k": 10**6}, params.fields)
    assert trusted.top_k == 10**6 and trusted.fields["min_p"].min_p == 0.5
