"""The stop_tokens plugin: validation, the stop hook against a reference, engine runs."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from freetoken_core import LLM, InvalidRequest, SamplingParams
from freetoken_core.plugins import PluginManager
from freetoken_core.processors import LogitsProcessor, ModelInfo, StopView
from freetoken_plugins.stop_tokens import MAX_STOP_TOKEN_IDS, StopTokens

VOCAB = 642
EOS = 2
MODEL = ModelInfo(VOCAB, frozenset({EOS}), 2048)
BIG_MODEL = ModelInfo(151_936, frozenset({EOS}), 8192)

# Not here: a Python set, which msgspec takes for an array (offline only: JSON has none).
BAD_VALUES = [
    3, "3", True, {3: 1}, 3.0,                                        # not a list
    [True], [3.0], ["3"], [None], [[3]], [1j],                        # not integers
    [-1], [VOCAB], [5, 10**30],                                       # out of range
    list(range(MAX_STOP_TOKEN_IDS + 1)),                              # too many
]


def bad_id(value: object) -> str:
    text = repr(value)
    return text if len(text) < 40 else f"{type(value).__name__}[{len(value)}]"


def field_of(param: str | None) -> str | None:
    """The top-level field a 400 names: ``stop_token_ids[0]`` (msgspec's path to a bad
    element) names ``stop_token_ids``."""
    return None if param is None else param.split("[")[0]


def validated(params: SamplingParams, model: ModelInfo = MODEL) -> SamplingParams:
    """``params`` after the server's validation (``params.fields`` filled)."""
    PluginManager("stop_tokens").validate(params, model)
    return params


def check_stop(views: list[StopView], tokens: list[int]) -> dict[int, int | str] | None:
    return StopTokens.freetoken_check_stop(sequences=views, token_ids=tokens)


def view(stop_ids: list[int], num_output: int = 3) -> StopView:
    """A sequence as the engine hands it to the hook: its request uses the plugin."""
    params = validated(SamplingParams(stop_token_ids=stop_ids))
    return StopView(params, num_output, [7] * num_output, params.fields["stop_tokens"])


def greedy(**fields) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **fields)


# -- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", BAD_VALUES, ids=bad_id)
def test_validation_rejects_bad_value(value) -> None:
    with pytest.raises(InvalidRequest) as info:
        validated(SamplingParams(stop_token_ids=value))
    assert field_of(info.value.param) == "stop_token_ids"
    assert "stop" in info.value.message


def test_generate_rejects_every_bad_value(tiny_llm: LLM) -> None:
    for value in BAD_VALUES:
        with pytest.raises(InvalidRequest) as info:
            tiny_llm.generate("hello", SamplingParams(stop_token_ids=value, max_tokens=2))
        assert field_of(info.value.param) == "stop_token_ids", value
    assert not tiny_llm.engine.has_unfinished_requests


def test_values_are_normalised() -> None:
    params = validated(SamplingParams(stop_token_ids=(5, 9, 5, 0, VOCAB - 1)))
    ids = params.fields["stop_tokens"].stop_token_ids
    assert ids == [5, 9, 0, VOCAB - 1]
    assert all(type(t) is int for t in ids)
    again = StopTokens.validate(params.fields["stop_tokens"], MODEL, params)  # idempotent
    assert again.stop_token_ids == [5, 9, 0, VOCAB - 1]
    full = validated(SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS))), BIG_MODEL)
    assert len(full.fields["stop_tokens"].stop_token_ids) == MAX_STOP_TOKEN_IDS
    assert validated(SamplingParams()).fields == {}  # absent: fine, and the hook never sees it


def test_it_is_a_stop_hook_not_a_processor() -> None:
    assert not issubclass(StopTokens, LogitsProcessor)
    manager = PluginManager(plugins="stop_tokens")
    assert manager.processor_classes() == []
    assert manager.field_owners() == {"stop_token_ids": "stop_tokens"}
    assert [hook.plugin for hook in manager.stop_hooks()] == ["stop_tokens"]


# -- the hook against a reference ----------------------------------------------------------


def test_check_stop_matches_reference_on_random_batches() -> None:
    rng = random.Random(0)
    for _ in range(20):
        lists = [rng.sample(range(20), rng.randint(0, 4)) for _ in range(rng.randint(1, 16))]
        views = [view(ids) for ids in lists]
        tokens = [rng.randrange(20) for _ in lists]
        expected = {row: token for row, (ids, token) in enumerate(zip(lists, tokens))
                    if token in ids}
        assert check_stop(views, tokens) == (expected or None)


def test_check_stop_reports_the_token_of_each_stopping_row() -> None:
    views = [view([5, 9]), view([]), view([5]), view([9, 11])]
    assert check_stop(views, [9, 5, 4, 11]) == {0: 9, 3: 11}
    assert check_stop(views, [1, 1, 1, 1]) is None
    assert check_stop([], []) is None
    # Through the manager's hook, as the engine calls it.
    (hook,) = PluginManager("stop_tokens").stop_hooks()
    assert hook.check(views, [9, 5, 4, 11]) == {0: 9, 3: 11}


# -- in the engine ------------------------------------------------------------------------


def test_end_to_end_stop_token_ends_the_sequence(tiny_llm: LLM) -> None:
    prompt = "def add(a, b):"
    natural = tiny_llm.generate(prompt, greedy())[0].outputs[0].token_ids
    stop = natural[4]
    first = natural.index(stop)
    outs = tiny_llm.generate([prompt, prompt], [greedy(stop_token_ids=[stop, VOCAB - 1]),
                                                greedy()])
    out = outs[0].outputs[0]
    assert out.token_ids == natural[:first + 1] and out.token_ids[-1] == stop
    assert out.finish_reason == "stop" and out.stop_reason == stop
    # The request without the field in the same batch runs on.
    assert outs[1].outputs[0].token_ids == natural
    assert outs[1].outputs[0].finish_reason == "length"


def test_end_to_end_stop_token_beats_max_tokens_and_n_choices(tiny_llm: LLM) -> None:
    forced = 321
    out = tiny_llm.generate("x", SamplingParams(
        temperature=0, max_tokens=1, stop_token_ids=[forced],
        logit_bias={forced: 100}))[0].outputs[0]
    assert out.token_ids == [forced] and out.finish_reason == "stop"
    assert out.stop_reason == forced
    many = tiny_llm.generate("x", SamplingParams(
        n=3, temperature=1.0, seed=1, max_tokens=40, stop_token_ids=[forced],
        logit_bias={forced: 5}))[0].outputs
    for choice in many:
        assert forced not in choice.token_ids[:-1]
        if choice.finish_reason == "stop":
            assert choice.token_ids[-1] == forced and choice.stop_reason == forced
    assert any(c.finish_reason == "stop" for c in many)


def test_disabled_plugin_is_named(tiny_model_dir: Path, monkeypatch) -> None:
    llm = LLM(str(tiny_model_dir), plugins="none", kv_cache_tokens=4096, progress=False)
    with pytest.raises(InvalidRequest) as info:
        llm.generate("hi", SamplingParams(stop_token_ids=[5]))
    assert info.value.param == "stop_token_ids"
    assert "'stop_tokens'" in info.value.message and "not enabled" in info.value.message

    monkeypatch.setenv("FREETOKEN_PLUGINS", "logit_bias,min_tokens")
    manager = PluginManager()
    assert "stop_tokens" not in manager.enabled and manager.stop_hooks() == []
    with pytest.raises(InvalidRequest, match="plugin 'stop_tokens'"):
        manager.validate(SamplingParams(stop_token_ids=[5]), MODEL)
    monkeypatch.setenv("FREETOKEN_PLUGINS", "stop_tokens")
    assert [hook.plugin for hook in PluginManager().stop_hooks()] == ["stop_tokens"]
