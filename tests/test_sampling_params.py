"""Validation of SamplingParams and EngineConfig: every bad value is a 400 naming its field."""

from __future__ import annotations

import math

import pytest
import torch

from freetoken_core.config import EngineConfig
from freetoken_core.errors import InvalidRequest
from freetoken_core.processors import ModelInfo
from freetoken_core.sampling_params import (
    GREEDY_TEMPERATURE,
    INT64_MAX,
    INT64_MIN,
    MAX_LOGPROBS,
    SamplingParams,
    finite_float,
)

BAD_VALUES = [
    ("n", 0), ("n", 129), ("n", -1), ("n", 2.0), ("n", "2"), ("n", None),
    ("temperature", -0.1), ("temperature", 2.1), ("temperature", math.nan),
    ("temperature", math.inf), ("temperature", -math.inf), ("temperature", "0.5"),
    ("temperature", None), ("temperature", True), ("temperature", 10**400),
    ("temperature", -(10**400)),
    ("top_p", 0), ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.5), ("top_p", math.nan),
    ("top_p", math.inf), ("top_p", "0.9"), ("top_p", None), ("top_p", 10**400),
    ("top_k", 0), ("top_k", -2), ("top_k", 2.0), ("top_k", "5"), ("top_k", None),
    ("top_k", True), ("top_k", 2**63), ("top_k", 10**400),
    ("max_tokens", -1), ("max_tokens", 1.5), ("max_tokens", "16"),
    ("max_tokens", True),
    ("seed", 1.0), ("seed", 1.5), ("seed", True), ("seed", False), ("seed", "42"),
    ("seed", 2**63), ("seed", 2**64), ("seed", -(2**63) - 1), ("seed", 10**400),
    ("n", True),
    ("stop", ""), ("stop", [""]), ("stop", ["ok", ""]), ("stop", [5]), ("stop", ["a", None]),
    ("stop", 5), ("stop", 1.5), ("stop", b"x"),
    ("logprobs", -1), ("logprobs", MAX_LOGPROBS + 1), ("logprobs", 1.0), ("logprobs", "3"),
    ("prompt_logprobs", -1), ("prompt_logprobs", MAX_LOGPROBS + 1), ("prompt_logprobs", 1.0),
    ("prompt_logprobs", True),
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
    ("temperature", GREEDY_TEMPERATURE), ("temperature", 0.5),
    ("top_p", 1), ("top_p", 1.0), ("top_p", 1e-9), ("top_p", 0.5), ("top_p", 5e-324),
    ("top_k", -1), ("top_k", 1), ("top_k", 100_000), ("top_k", INT64_MAX),
    ("max_tokens", None), ("max_tokens", 0), ("max_tokens", 1), ("max_tokens", 1_000_000),
    ("seed", None), ("seed", 0), ("seed", -1), ("seed", INT64_MAX), ("seed", INT64_MIN),
    ("stop", []), ("stop", ["a", "bc"]), ("stop", ("x", "y")),
    ("logprobs", None), ("logprobs", 0), ("logprobs", MAX_LOGPROBS),
    ("prompt_logprobs", None), ("prompt_logprobs", 0), ("prompt_logprobs", MAX_LOGPROBS),
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


@pytest.mark.parametrize("temperature", [1e-50, 5e-324, 1e-6, GREEDY_TEMPERATURE / 2])
def test_temperature_below_the_greedy_epsilon_is_greedy(temperature: float) -> None:
    params = SamplingParams(temperature=temperature)
    assert params.temperature == 0.0 and params.is_greedy
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).is_greedy


def test_seed_error_names_the_int64_range() -> None:
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(seed=2**64)
    assert info.value.param == "seed" and str(INT64_MAX) in info.value.message


def test_finite_float_never_raises() -> None:
    assert finite_float(1) == 1.0 and finite_float(0.5) == 0.5 and finite_float(5e-324) > 0
    for value in (10**400, -(10**400), math.inf, math.nan, True, "1", None, [1.0]):
        assert finite_float(value) is None


CPU_DEVICE = torch.device("cpu")
MODEL = ModelInfo(vocab_size=640, eos_token_ids=frozenset({0}), max_model_len=256)


@pytest.mark.parametrize(("field", "value"), [("top_k", 641), ("top_k", INT64_MAX)])
def test_verify_refuses_what_the_model_cannot_honour(field: str, value: int) -> None:
    params = SamplingParams(**{field: value})
    with pytest.raises(InvalidRequest) as info:
        params.verify(MODEL)
    assert info.value.param == field and "640" in info.value.message


def test_verify_refuses_more_logprobs_than_the_vocabulary() -> None:
    tiny = ModelInfo(vocab_size=8, eos_token_ids=frozenset({0}), max_model_len=64)
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(logprobs=9).verify(tiny)
    assert info.value.param == "logprobs"
    SamplingParams(logprobs=8).verify(tiny)


def test_verify_accepts_the_edges() -> None:
    for top_k in (-1, 1, 640):
        SamplingParams(top_k=top_k, logprobs=MAX_LOGPROBS).verify(MODEL)


def test_offline_generate_verifies_against_the_model(tiny_llm) -> None:
    vocab = tiny_llm.engine.model_info.vocab_size
    with pytest.raises(InvalidRequest) as info:
        tiny_llm.generate("hi", SamplingParams(max_tokens=2, top_k=vocab + 1))
    assert info.value.param == "top_k"
    out = tiny_llm.generate("hi", SamplingParams(max_tokens=2, top_k=vocab, seed=INT64_MIN))
    assert len(out[0].outputs[0].token_ids) == 2


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


# -- no accepted value makes the logits non-finite ------------------------------------------

VOCAB = 64
PROMPT = [5, 6, 7, 8]
OUTPUT = [9, 9, 10]


def _extreme_requests() -> list[dict]:
    from freetoken_plugins.logit_bias import BIAS_LIMIT, MAX_ENTRIES
    from freetoken_plugins.penalties import (
        MAX_REPETITION_PENALTY,
        MIN_REPETITION_PENALTY,
        PENALTY_LIMIT,
    )

    many = min(MAX_ENTRIES, VOCAB)
    return [
        {"temperature": GREEDY_TEMPERATURE, "repetition_penalty": MIN_REPETITION_PENALTY,
         "presence_penalty": -PENALTY_LIMIT, "frequency_penalty": -PENALTY_LIMIT,
         "logit_bias": {t: BIAS_LIMIT for t in range(many)}, "min_p": 5e-324,
         "min_tokens": 100, "stop_token_ids": list(range(20, 40)), "top_p": 5e-324},
        {"temperature": 2.0, "repetition_penalty": MAX_REPETITION_PENALTY,
         "presence_penalty": PENALTY_LIMIT, "frequency_penalty": PENALTY_LIMIT,
         "logit_bias": {t: -BIAS_LIMIT for t in range(many)}, "min_p": 1.0, "top_k": 1},
        {"temperature": GREEDY_TEMPERATURE, "repetition_penalty": MAX_REPETITION_PENALTY,
         "logit_bias": {str(t): 10**400 for t in PROMPT}, "min_p": 1e-300, "top_k": VOCAB,
         "top_p": 1.0, "seed": INT64_MIN},
        {"temperature": 1e-50, "repetition_penalty": MIN_REPETITION_PENALTY,
         "seed": INT64_MAX},
    ]


@pytest.mark.parametrize("magnitude", [10.0, 1e4, 1e30])
def test_extreme_valid_values_keep_the_logits_finite(magnitude: float) -> None:
    """Every processor at the ends of its range, with model logits of ``magnitude`` on the
    penalised tokens: the processed logits hold no NaN or +inf, every row keeps a finite
    maximum, and the sampler draws a real token for each row."""
    from freetoken_core.engine.pipeline import ProcessorPipeline
    from freetoken_core.engine.sampler import Sampler, SamplingBatch
    from freetoken_core.engine.sequence import Sequence
    from freetoken_core.plugins import PluginManager
    from freetoken_core.processors import ProcessorContext

    model = ModelInfo(VOCAB, frozenset({2}), 512)
    plugins = PluginManager("all")
    requests = [SamplingParams(max_tokens=200, **kwargs) for kwargs in _extreme_requests()]
    for params in requests:
        params.verify(model)
        plugins.validate(params, model)
    # No request here uses structured_outputs (a mask, with no numeric range), whose backend
    # needs a tokenizer that fits the vocabulary; test_structured_grammar covers it.
    classes = [c for c in plugins.processor_classes() if c.name != "structured_outputs"]
    pipeline = ProcessorPipeline(classes, ProcessorContext(len(requests), model, CPU_DEVICE))
    seqs = []
    for slot, params in enumerate(requests):
        seq = Sequence(slot, str(slot), PROMPT + OUTPUT, len(PROMPT), params,
                       params.seed or slot, 0, 200)
        seq.slot = slot
        pipeline.add_request(slot, seq)
        seqs.append(seq)
    batch = SamplingBatch.from_seqs(seqs, CPU_DEVICE)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(requests), VOCAB, generator=gen) * 10
    logits[:, PROMPT + OUTPUT] = magnitude * torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0])

    # The sampler's own order: pre-temperature processors, temperature, post-temperature.
    processed = logits.clone()
    pipeline.apply(processed, batch.slots, post_temperature=False, all_greedy=False)
    temperature = torch.where(batch.temperature == 0, 1.0, batch.temperature)
    processed = processed / temperature.unsqueeze(1)
    pipeline.apply(processed, batch.slots, post_temperature=True, all_greedy=False)
    assert not processed.isnan().any()
    assert not (processed == float("inf")).any()
    assert torch.isfinite(processed.amax(dim=-1)).all()
    assert torch.isfinite(processed.softmax(dim=-1)).all()

    tokens = Sampler(pipeline)(logits.clone(), batch).token_ids
    assert all(0 <= t < VOCAB for t in tokens), tokens
    # Rows below the greedy epsilon took the argmax of their processed logits.
    for row, params in enumerate(requests):
        if params.is_greedy:
            assert tokens[row] == int(processed[row].argmax())


def test_tiny_temperature_row_is_greedy_in_a_mixed_batch() -> None:
    """Regression: 1e-50 rounds to 0.0 in float32 and was sampled at T = 1."""
    from freetoken_core.engine.sampler import Sampler, SamplingBatch
    from freetoken_core.engine.sequence import Sequence

    params = [SamplingParams(temperature=1e-50), SamplingParams(temperature=1.0, seed=1)]
    seqs = [Sequence(i, str(i), [1, 2], 2, p, 3 + i, 0, 16) for i, p in enumerate(params)]
    batch = SamplingBatch.from_seqs(seqs, CPU_DEVICE)
    assert batch.temperature[0].item() == 0.0 and batch.any_greedy and not batch.all_greedy
    assert batch.filter_rows is None
    flat = torch.zeros(2, 50)
    flat[:, 7] = 0.1  # argmax 7, but a T = 1 draw would almost never pick it
    for seed in range(20):
        seqs[0].seed = seed
        batch = SamplingBatch.from_seqs(seqs, CPU_DEVICE)
        assert Sampler()(flat.clone(), batch).token_ids[0] == 7
