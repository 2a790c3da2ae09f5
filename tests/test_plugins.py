"""The plugin manager: entry points, selection, field ownership, validation."""

from __future__ import annotations

import pytest

from freetoken_core import InvalidRequest, SamplingParams
from freetoken_core.engine.pipeline import ProcessorPipeline
from freetoken_core.plugins import PluginManager, PluginSelectionError, parse_selection
from freetoken_core.processors import ModelInfo, ProcessorContext

MODEL = ModelInfo(vocab_size=1000, eos_token_ids=frozenset({2}), max_model_len=4096)
BUILT_INS = {"penalties", "logit_bias", "min_tokens", "min_p", "stop_tokens"}


def test_parse_selection() -> None:
    assert parse_selection(None) is None and parse_selection("all") is None
    assert parse_selection("none") == set()
    assert parse_selection(" penalties, min_p ,") == {"penalties", "min_p"}


def test_all_built_ins_are_found_through_entry_points(monkeypatch) -> None:
    monkeypatch.delenv("FREETOKEN_PLUGINS", raising=False)
    pm = PluginManager()
    assert BUILT_INS <= pm.enabled
    infos = {i.name: i for i in pm.describe()}
    assert infos["penalties"].distribution == "freetoken"
    assert infos["penalties"].kind == "processor"  # v2: one class, a LogitsProcessor
    assert infos["stop_tokens"].kind == "hooks"
    assert set(infos["penalties"].fields) == {
        "presence_penalty", "frequency_penalty", "repetition_penalty"}
    assert "freetoken_check_stop" in infos["stop_tokens"].hooks


def test_selection_by_argument_and_environment(monkeypatch) -> None:
    assert PluginManager("penalties").enabled == {"penalties"}
    monkeypatch.setenv("FREETOKEN_PLUGINS", "min_p")
    assert PluginManager().enabled == {"min_p"}
    assert PluginManager("none").enabled == set()  # the argument wins over the environment


def test_unknown_plugin_name_lists_installed() -> None:
    with pytest.raises(PluginSelectionError) as exc:
        PluginManager("penalties,nope").enabled  # noqa: B018
    assert "nope" in str(exc.value) and "penalties" in str(exc.value)


def test_fields_of_disabled_and_unknown_plugins_are_refused() -> None:
    pm = PluginManager("penalties")
    pm.validate(SamplingParams(repetition_penalty=1.2), MODEL)
    for field, value in (("min_p", 0.1), ("logit_bias", {1: 2.0})):
        with pytest.raises(InvalidRequest) as exc:
            pm.validate(SamplingParams(**{field: value}), MODEL)
        assert exc.value.param == field and f"plugin {field!r}" in exc.value.message
        assert "--plugins" in exc.value.message
    with pytest.raises(InvalidRequest) as exc:
        pm.validate(SamplingParams(no_such_field=1), MODEL)
    assert exc.value.param == "no_such_field"


def test_validation_hook_runs_for_enabled_plugins() -> None:
    pm = PluginManager("penalties,min_p")
    with pytest.raises(InvalidRequest) as exc:
        pm.validate(SamplingParams(presence_penalty=3.0), MODEL)
    assert exc.value.param == "presence_penalty"
    with pytest.raises(InvalidRequest) as exc:
        pm.validate(SamplingParams(min_p=1.5), MODEL)
    assert exc.value.param == "min_p"


def test_processors_come_from_enabled_plugins_only() -> None:
    names = {c.name for c in PluginManager("min_p").processor_classes()}
    assert names == {"min_p"}
    assert PluginManager("none").processor_classes() == []


def _tensor_bytes(obj: object) -> int:
    return sum(v.numel() * v.element_size() for v in vars(obj).values()
               if hasattr(v, "element_size"))


def test_state_of_all_built_ins_for_256_slots_fits_256_mb(tmp_path) -> None:
    import torch
    from tiny_models import build_tokenizer

    model = ModelInfo(vocab_size=151_936, eos_token_ids=frozenset({2}), max_model_len=32_768)
    classes = PluginManager("all").processor_classes()
    assert {c.name for c in classes} >= {"penalties", "logit_bias", "min_tokens", "min_p"}
    # structured_outputs builds its grammar backend from the tokenizer.
    ctx = ProcessorContext(256, model, torch.device("cpu"), build_tokenizer(tmp_path))
    pipeline = ProcessorPipeline(classes, ctx)  # with the token history penalties read
    assert pipeline.history is not None
    total = (sum(_tensor_bytes(p) for p in pipeline.processors)
             + _tensor_bytes(pipeline.history))
    assert 0 < total < 256 * 2**20
