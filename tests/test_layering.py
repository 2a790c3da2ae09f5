"""The layout shows the layers: imports inside ``freetoken_core`` flow one way, and the core
never names a built-in plugin or one of its request or response fields."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "freetoken_core"

# Lowest first; a module may import its own layer and the layers below it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("errors", "faults", "config", "tokenizer", "affinity", "hugepages", "lazy")),
    ("contract", ("sampling_params", "processors", "hookspecs", "plugins", "outputs",
                  "history")),
    ("kernels", ("kernels",)),
    ("distributed", ("distributed",)),
    ("models", ("models",)),
    ("engine", ("engine",)),
    ("server", ("server",)),
    ("entry", ("llm", "cli", "bench", "testing", "__init__")),
]


def _layer(module: str) -> int:
    """The layer of ``freetoken_core.<module>`` (its first component decides)."""
    head = module.split(".")[0]
    for index, (_, members) in enumerate(LAYERS):
        if head in members:
            return index
    raise AssertionError(f"freetoken_core.{module} is in no layer of tests/test_layering.py")


def _module_of(path: Path) -> str:
    rel = path.relative_to(CORE).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" and len(rel.parts) > 1 else rel.parts
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every ``freetoken_core.X`` (and ``freetoken_plugins``) a module imports, anywhere in it,
    with its line; ``from freetoken_core import X`` counts as importing X."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == "freetoken_core":
                names = [f"freetoken_core.{alias.name}" for alias in node.names]
        else:
            continue
        found.extend((node.lineno, name) for name in names
                     if name.split(".")[0] in ("freetoken_core", "freetoken_plugins"))
    return found


CORE_FILES = sorted(CORE.rglob("*.py"))


def test_every_module_has_a_layer() -> None:
    for path in CORE_FILES:
        module = _module_of(path)
        if module:
            _layer(module)


@pytest.mark.parametrize("path", CORE_FILES, ids=lambda p: str(p.relative_to(CORE)))
def test_imports_flow_down(path: Path) -> None:
    module = _module_of(path)
    own = _layer(module) if module else len(LAYERS) - 1
    climbing = []
    for line, name in _imports(path):
        assert not name.startswith("freetoken_plugins"), (
            f"{path.relative_to(ROOT)}:{line} imports {name}: the core finds plugins through"
            " entry points only")
        target = name.removeprefix("freetoken_core").lstrip(".")
        if target and _layer(target) > own:
            climbing.append(f"{path.relative_to(ROOT)}:{line} ({LAYERS[own][0]}) imports {name}"
                            f" ({LAYERS[_layer(target)][0]})")
    assert not climbing, "imports that climb a layer:\n" + "\n".join(climbing)


def _built_in_names() -> set[str]:
    """The built-in plugins' names and every request and response field they declare."""
    import importlib

    from freetoken_core.processors import Plugin

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    entry_points = pyproject["project"]["entry-points"]["freetoken.plugins"]
    names: set[str] = set()
    for name, target in entry_points.items():
        assert target.startswith("freetoken_plugins."), target
        names.add(name)
        module, _, attr = target.partition(":")
        cls = getattr(importlib.import_module(module), attr)
        assert issubclass(cls, Plugin)
        for fields in (cls.Fields, cls.ChatMessageFields, cls.MessageFields, cls.UsageFields):
            if fields is not None:
                names.update(fields.__struct_encode_fields__)
        if cls.UsageFields is not None:
            names.update(_nested_field_names(cls.UsageFields))
    return names


def _nested_field_names(struct: type) -> set[str]:
    """Field names of structs nested in a response-field struct (usage details)."""
    import msgspec

    out: set[str] = set()
    for info in msgspec.inspect.type_info(struct).fields:
        for sub in _structs_in(info.type):
            out.update(f.encode_name for f in sub.fields)
    return out


def _structs_in(type_info: object) -> list:
    import msgspec.inspect as mi

    if isinstance(type_info, mi.StructType):
        return [type_info]
    found = []
    for attr in ("types", "item_type", "value_type"):
        inner = getattr(type_info, attr, None)
        for each in inner if isinstance(inner, tuple) else (inner,) if inner else ():
            found.extend(_structs_in(each))
    return found


def test_core_names_no_built_in_plugin_or_field() -> None:
    names = _built_in_names()
    # Sanity: the scan looks for what it should (a scan for nothing passes anything).
    assert {"penalties", "logit_bias", "suffix", "reasoning_content", "response_format",
            "structured_outputs", "min_p", "tools", "tool_choice", "tool_call_id",
            "reasoning_tokens"} <= names, names
    # (A name right after "<" is a special token's text, which the core's vocabulary
    # handling may spell: llama.cpp's "<fim-pad>" ends generation, whatever plugins run.)
    pattern = re.compile(r"(?<![A-Za-z0-9_<])(" + "|".join(map(re.escape, sorted(names)))
                         + r")(?![A-Za-z0-9_])", re.IGNORECASE)
    hits = []
    for path in sorted(p for p in CORE.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for match in pattern.finditer(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r} in {line.strip()}")
    assert not hits, "freetoken_core names built-in plugins or their fields:\n" + "\n".join(hits)
