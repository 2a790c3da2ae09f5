"""Validation of SamplingParams and EngineConfig: every bad value is a 400 naming its field."""

from __future__ import annotations

import math

import pytest

from freetoken_core.config import EngineConfig
from freetoken_core.errors import InvalidRequest
from freetoken_core.sampling_params import MAX_LOGPROBS, SamplingParams

BAD_VALUES = [
    ("n", 0), ("n", 129), ("n", -1), ("n", 2.0), ("n", "2"), ("n", None),
    ("temperature", -0.1), ("temperature", 2.1), ("temperature", math.nan),
    ("temperature", math.inf), ("temperature", -math.inf), ("temperature", "0.5"),
    ("temperature", None), ("temperature", True),
    ("top_p", 0), ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.5), ("top_p", math.nan),
    ("top_p", math.inf), ("top_p", "0.9"), ("top_p", None),
    ("top_k", 0), ("top_k", -2), ("top_k", 2.0), ("top_k", "5"), ("top_k", None),
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 1.5), ("max_tokens", "16"),
    ("seed", 1.0), ("seed", 1.5), ("seed", True), ("seed", False), ("seed", "42"),
    ("stop", ""), ("stop", [""]), ("stop", ["ok", ""]), ("stop", [5]), ("stop", ["a", None]),
    ("stop", 5), ("stop", 1.5), ("stop", b"x"),
    ("logprobs", -1), ("logprobs", MAX_LOGPROBS + 1), ("logprobs", 1.0), ("logprobs", "3"),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES,
                         ids=[f"{f}={v!r}" for f, v in BAD_VALUES])
def test_bad_value_raises_invalid_request_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field
    assert field in info.value.message
    assert isinstance(info.value, ValueError)  # callers catching ValueError still work


def test_first_bad_field_is_reported_even_with_other_good_fields() -> None:
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=5, logprobs=25)
    assert info.value.param == "logprobs"


GOOD_VALUES = [
    ("n", 1), ("n", 128),
    ("temperature", 0), ("temperature", 0.0), ("temperature", 2), ("temperature", 2.0),
    ("temperature", 1e-6),
    ("top_p", 1), ("top_p", 1.0), ("top_p", 1e-9), ("top_p", 0.5),
    ("top_k", -1), ("top_k", 1), ("top_k", 100_000),
    ("max_tokens", None), ("max_tokens", 1), ("max_tokens", 1_000_000),
    ("seed", None), ("seed", 0), ("seed", -1), ("seed", 2**63 - 1), ("seed", 2**80),
    ("stop", []), ("stop", ["a", "bc"]), ("stop", ("x", "y")),
    ("logprobs", None), ("logprobs", 0), ("logprobs", MAX_LOGPROBS),
]


@pytest.mark.parametrize(("field", "value"), GOOD_VALUES,
                         ids=[f"{f}={v!r}" for f, v in GOOD_VALUES])
def test_valid_edge_values_are_accepted(field: str, value: object) -> None:
    params = SamplingParams(**{field: value})
    got = getattr(params, field)
    if field == "stop":
        assert got == list(value)  # type: ignore[call-overload]
    else:
        assert got == value


def test_defaults() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens) == (1, 1.0, 1.0, -1, 16)
    assert p.seed is None and p.logprobs is None and p.stop == []
    assert p.skip_special_tokens and not p.include_stop_str_in_output and not p.ignore_eos
    assert not p.is_greedy
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0.0).is_greedy


def test_stop_string_becomes_a_list() -> None:
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]
    assert SamplingParams(stop=None).stop == []  # type: ignore[arg-type]


def test_stop_list_is_copied() -> None:
    stops = ["a"]
    params = SamplingParams(stop=stops)
    stops.append("b")
    assert params.stop == ["a"]


ENGINE_BAD = [
    ("dtype", "float64"), ("dtype", "fp16"), ("dtype", "int8"),
    ("device", "tpu"), ("device", "mps"), ("device", ""),
    ("max_num_seqs", 0), ("max_num_seqs", -1),
    ("max_num_batched_tokens", 0),
    ("block_size", 0),
    ("max_model_len", 0),
]


@pytest.mark.parametrize(("option", "value"), ENGINE_BAD,
                         ids=[f"{o}={v!r}" for o, v in ENGINE_BAD])
def test_engine_config_bad_option_names_the_option(option: str, value: object) -> None:
    with pytest.raises(InvalidRequest) as info:
        EngineConfig(**{option: value})
    assert info.value.param == option
    assert option in str(info.value)


@pytest.mark.parametrize(("kv_cache_tokens", "block_size"), [(8, 16), (15, 16), (0, 16), (1, 2)])
def test_engine_config_kv_cache_smaller_than_a_block(kv_cache_tokens: int,
                                                     block_size: int) -> None:
    with pytest.raises(InvalidRequest) as info:
        EngineConfig(kv_cache_tokens=kv_cache_tokens, block_size=block_size)
    assert info.value.param == "kv_cache_tokens"


def test_engine_config_valid_options() -> None:
    EngineConfig()
    EngineConfig(kv_cache_tokens=16, block_size=16)  # exactly one block
    for dtype in ("auto", "float32", "bfloat16", "float16"):
        assert EngineConfig(dtype=dtype).dtype == dtype
    for device in ("auto", "cpu", "cuda", "cuda:1"):
        assert EngineConfig(device=device).device == device
    cfg = EngineConfig(max_num_seqs=1, max_num_batched_tokens=1, block_size=1,
                       kv_cache_tokens=1, max_model_len=1)
    assert cfg.max_num_seqs == 1 and cfg.max_model_len == 1


def test_engine_config_dtype_resolution() -> None:
    import torch

    assert EngineConfig().torch_dtype(torch.device("cpu")) == torch.float32
    assert EngineConfig().torch_dtype(torch.device("cuda")) == torch.bfloat16
    assert EngineConfig(dtype="float16").torch_dtype(torch.device("cpu")) == torch.float16
    assert EngineConfig(device="cpu").torch_device() == torch.device("cpu")
