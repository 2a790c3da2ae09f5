"""docs/plugins.md keeps up with the plugin API: every hook with its exact signature, every
built-in plugin named, and the walkthrough's plugin code working as printed."""

from __future__ import annotations

import inspect
import re
import types
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path

import pluggy
import pytest
import torch

from freetoken_core import InvalidRequest, SamplingParams, hookspecs
from freetoken_core.processors import ModelInfo, ProcessorPipeline

DOC = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"


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
    names = set(_hookspecs())
    assert {"freetoken_register_processors", "freetoken_validate_request",
            "freetoken_check_stop", "freetoken_request_fields"} <= names


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
    module = types.ModuleType("freetoken_suppress")
    exec(compile(source, "docs/plugins.md", "exec"), module.__dict__)  # noqa: S102 (our doc)
    return module


def test_walkthrough_plugin_works_as_printed() -> None:
    plugin = _walkthrough_module()
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(plugin, name="suppress")
    pm.check_pending()
    assert pm.hook.freetoken_request_fields() == [["suppress_token_ids"]]
    found: list[type] = []
    pm.hook.freetoken_register_processors(register=found.append)
    assert found == [plugin.Suppress]

    model = ModelInfo(32, frozenset({2}), 128)
    for bad in ([True], [32], [-1], "5", [1.0], list(range(65))):
        with pytest.raises(InvalidRequest) as err:
            pm.hook.freetoken_validate_request(
                request=SamplingParams(suppress_token_ids=bad), model=model)
        assert err.value.param == "suppress_token_ids"

    pipeline = ProcessorPipeline(found, 4, model, torch.device("cpu"))
    pipeline.add_request(2, SamplingParams(suppress_token_ids=[5, 9]), [1, 2], [])
    pipeline.add_request(0, SamplingParams(suppress_token_ids=[7]), [1], [])
    pipeline.remove_request(0)  # slot 0 returns to neutral
    logits = torch.randn(3, 32)
    got = logits.clone()
    pipeline.apply(got, torch.tensor([0, 2, 1]), post_temperature=False, all_greedy=True)
    expected = logits.clone()
    expected[1, [5, 9]] = float("-inf")
    assert torch.equal(got, expected)
