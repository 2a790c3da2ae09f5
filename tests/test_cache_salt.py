"""``cache_salt``: validated where a request is accepted, carried to the engine process, and
keeping the prefix cache apart end to end (the block manager's own tests cover the keys)."""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import pytest

from freetoken_core.engine.process import add_request, params_of, to_engine_type
from freetoken_core.errors import InvalidRequest
from freetoken_core.llm import LLM
from freetoken_core.plugins import PluginManager
from freetoken_core.processors import ModelInfo
from freetoken_core.sampling_params import SamplingParams
from freetoken_core.server.limits import RequestLimits
from freetoken_core.server.protocol import ChatCompletionRequest, CompletionRequest
from freetoken_core.server.serving import parse_body, sampling_params

MODEL = ModelInfo(vocab_size=1000, eos_token_ids=frozenset({0}), max_model_len=512)


def http_params(body: bytes, cls: type = CompletionRequest) -> SamplingParams:
    request, extra, _ = parse_body(body, cls)
    return sampling_params(request, extra, PluginManager("none"), MODEL)


def test_validated_on_construction() -> None:
    assert SamplingParams(cache_salt="x" * 5000).extra == {}  # the server bounds the length
    for bad in ["", 7, ["a"]]:
        with pytest.raises(InvalidRequest) as info:
            SamplingParams(cache_salt=bad)
        assert info.value.param == "cache_salt"


def test_crosses_the_process_boundary() -> None:
    decoder = msgspec.msgpack.Decoder(to_engine_type({}))
    for salt in ("tenant-a", None):
        wire = msgspec.msgpack.encode(add_request("r", [1, 2], SamplingParams(
            cache_salt=salt, top_k=5)))
        assert params_of(decoder.decode(wire)).cache_salt == salt


def test_both_routes_take_it_and_name_it_when_bad() -> None:
    assert http_params(b'{"prompt": "hi", "cache_salt": "t1"}').cache_salt == "t1"
    chat = b'{"messages": [{"role": "user", "content": "hi"}], "cache_salt": "t2"}'
    assert http_params(chat, ChatCompletionRequest).cache_salt == "t2"
    assert http_params(b'{"prompt": "hi"}').cache_salt is None
    for bad in [b'""', b"5"]:
        with pytest.raises(InvalidRequest) as info:
            http_params(b'{"prompt": "hi", "cache_salt": ' + bad + b"}")
        assert info.value.param == "cache_salt"
    limits = RequestLimits()
    limits.check_cache_salt("x" * limits.max_cache_salt_chars)
    with pytest.raises(InvalidRequest) as info:
        limits.check_cache_salt("x" * (limits.max_cache_salt_chars + 1))
    assert info.value.param == "cache_salt"


def test_salts_keep_the_prefix_cache_apart(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), kv_cache_tokens=4096, progress=False)
    rng = random.Random(3)
    prompt = [rng.randrange(5, len(llm.tokenizer)) for _ in range(100)]

    def run(salt: str | None) -> tuple[int, list[int]]:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, cache_salt=salt)
        out = llm.generate(prompt, params)[0]
        return out.num_cached_tokens, out.outputs[0].token_ids

    cached, tokens = run("tenant-a")
    assert cached == 0
    assert run("tenant-b")[0] == 0
    assert run(None)[0] == 0
    again, same = run("tenant-a")
    assert again >= 96 and same == tokens
    assert run(None)[0] >= 96
    assert llm.engine.core.scheduler.block_manager.num_used_blocks == 0
