"""docs/plugins.md keeps up with the plugin API: every hook with its exact signature, every
built-in plugin named, and the walkthrough's plugin code working as printed (installed
through an entry point as its ``pyproject.toml`` block says, validated and run by the core
as a request would be, and measured by ``freetoken bench plugin``)."""

from __future__ import annotations

import inspect
import re
import sys
import types
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

import pytest
import torch

from freetoken_core import InvalidRequest, SamplingParams, hookspecs
from freetoken_core import plugins as plugins_module
from freetoken_core.bench import BenchShape, build_plugin_bench
from freetoken_core.engine.pipeline import ProcessorPipeline
from freetoken_core.engine.sequence import Sequence
from freetoken_core.plugins import PluginManager
from freetoken_core.processors import LogitsProcessor, ModelInfo, ProcessorContext

DOC = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"
WALKTHROUGH_MODULE = "freetoken_suppress"
FIELD = "suppress_token_ids"


class _Verbatim(str):
    """An annotation string that ``inspect`` prints as written, not quoted."""

    def __repr__(self) -> str:
        return str(self)


def _hookspecs() -> dict[str, Callable]:
    marker = f"{hookspecs.PROJECT}_spec"
    return {name: fn for name, fn in vars(hookspecs).items()
            if inspect.isfunction(fn) and hasattr(fn, marker)}


def documented_signature(name: str, fn: Callable) -> str:
    """``def name(arg: type, ...) -> type`` as hookspecs.py writes it (string annotations,
    since it uses ``from __future__ import annotations``)."""
    sig = inspect.signature(fn)

    def verbatim(annotation: object) -> object:
        return annotation if annotation is inspect.Signature.empty else _Verbatim(annotation)

    sig = sig.replace(
        parameters=[p.replace(annotation=verbatim(p.annotation))
                    for p in sig.parameters.values()],
        return_annotation=verbatim(sig.return_annotation))
    return f"def {name}{sig}"


def test_signature_format() -> None:
    def sample(request: SamplingParams, model: ModelInfo) -> None: ...

    assert documented_signature("sample", sample) == (
        "def sample(request: SamplingParams, model: ModelInfo) -> None")


def test_hookspecs_found() -> None:
    assert set(_hookspecs()) == {
        "freetoken_rewrite_prompt", "freetoken_chat_template", "freetoken_check_stop",
        "freetoken_answer_start",
        "freetoken_decorate_response", "freetoken_add_cli_options", "freetoken_configure"}


@pytest.mark.parametrize("name", sorted(_hookspecs()))
def test_hook_is_documented_with_its_exact_signature(name: str) -> None:
    expected = documented_signature(name, _hookspecs()[name])
    lines = {line.strip() for line in DOC.read_text().splitlines()}
    assert expected in lines, f"docs/plugins.md lacks the line: {expected}"


def test_builtin_plugins_are_in_the_table() -> None:
    doc = DOC.read_text()
    section = doc[doc.index("## Built-in plugins"):]
    builtins = sorted(ep.name for ep in entry_points(group=hookspecs.ENTRY_POINT_GROUP)
                      if ep.value.split(".")[0] == "freetoken_plugins")
    assert builtins, "no built-in entry points found: is freetoken installed?"
    for name in builtins:
        assert f"| `{name}` |" in section, f"built-in plugin {name} missing from the table"


def _walkthrough_module() -> types.ModuleType:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    source = next(b for b in blocks if "class Suppress(LogitsProcessor)" in b)
    module = types.ModuleType(WALKTHROUGH_MODULE)
    exec(compile(source, "docs/plugins.md", "exec"), module.__dict__)  # noqa: S102 (our doc)
    return module


def _walkthrough_entry_point() -> EntryPoint:
    """The entry point the walkthrough's ``pyproject.toml`` block declares."""
    header = f'[project.entry-points."{hookspecs.ENTRY_POINT_GROUP}"]'
    blocks = re.findall(r"```toml\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    section = next(b for b in blocks if header in b).split(header, 1)[1]
    entry = re.search(r'^(\w+)\s*=\s*"([^"]+)"', section, flags=re.MULTILINE)
    assert entry is not None, "the toml block declares no entry point"
    return EntryPoint(name=entry[1], value=entry[2], group=hookspecs.ENTRY_POINT_GROUP)


@pytest.fixture
def suppress(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """The walkthrough's module, installed for this test under its documented entry point."""
    module = _walkthrough_module()
    monkeypatch.setitem(sys.modules, WALKTHROUGH_MODULE, module)
    monkeypatch.delenv("FREETOKEN_PLUGINS", raising=False)
    real = list(plugins_module.entry_points(group=hookspecs.ENTRY_POINT_GROUP))
    fake = _walkthrough_entry_point()

    def fake_entry_points(group: str) -> list[EntryPoint]:
        return [*real, fake] if group == hookspecs.ENTRY_POINT_GROUP else []

    monkeypatch.setattr(plugins_module, "entry_points", fake_entry_points)
    return module


def test_walkthrough_entry_point_names_the_class() -> None:
    ep = _walkthrough_entry_point()
    assert ep.name == "suppress"
    assert ep.value == f"{WALKTHROUGH_MODULE}:Suppress"  # v2: the entry point is the class


def test_walkthrough_plugin_works_as_printed(suppress: types.ModuleType) -> None:
    manager = PluginManager(plugins="suppress")
    [info] = [i for i in manager.describe() if i.name == "suppress"]
    assert info.enabled and info.kind == "processor" and info.fields == [FIELD]
    assert manager.processor_classes() == [suppress.Suppress]
    assert issubclass(suppress.Suppress, LogitsProcessor)

    model = ModelInfo(32, frozenset({2}), 128)
    for bad in ([True], [32], [-1], "5", [1.0], list(range(65))):
        with pytest.raises(InvalidRequest) as err:
            manager.validate(SamplingParams(**{FIELD: bad}), model)
        assert err.value.param.split("[")[0] == FIELD, bad

    pipeline = ProcessorPipeline(manager.processor_classes(),
                                 ProcessorContext(4, model, torch.device("cpu")))

    def sequence(slot: int, ids: list[int]) -> Sequence:
        params = SamplingParams(**{FIELD: ids})
        manager.validate(params, model)
        return Sequence(slot, str(slot), [1, 2], 2, params, 0, slot, 8, slot=slot)

    pipeline.add_request(2, sequence(2, [5, 9]))
    pipeline.add_request(0, sequence(0, [7]))
    pipeline.remove_request(0)  # slot 0 returns to neutral
    logits = torch.randn(3, 32)
    got = logits.clone()
    pipeline.apply(got, torch.tensor([0, 2, 1]), post_temperature=False, all_greedy=True)
    expected = logits.clone()
    expected[1, [5, 9]] = float("-inf")
    assert torch.equal(got, expected)
    assert pipeline.take_failures() == {}


def test_walkthrough_bench_command_runs(suppress: types.ModuleType) -> None:
    """``freetoken bench plugin suppress``, as the docs print it, with a small shape."""
    bench = build_plugin_bench("suppress", BenchShape(batch=2, vocab=1024, history=4),
                               num_steps=1)
    assert bench.notes == []
    assert [type(p).name for p in bench.active.pipeline.active()] == ["suppress"]
    bench.active.reset()
    assert len(bench.active.run()) == 2
