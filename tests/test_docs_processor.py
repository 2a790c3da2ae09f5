"""The processor of ``docs/plugins.md``, taken from the page as a reader would copy it: its
Python block and its ``pyproject.toml`` become a package in a temporary directory,
installed with ``pip``; the test then lists it with ``freetoken plugins``, validates a
request, applies it in a generation and benchmarks it with ``freetoken bench plugin``.
Nothing here adds code the page does not show, so the page cannot drift from a processor
that works."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from pip_packages import pip_installed

from freetoken_core import LLM, InvalidRequest, SamplingParams
from freetoken_core.plugins import PluginManager
from freetoken_core.processors import ModelInfo

DOC = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"
DISTRIBUTION = "freetoken-suppress"
FIELD = "suppress_token_ids"


def _section(title: str) -> str:
    text = DOC.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def _blocks(section: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section, re.DOTALL)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "freetoken_core.cli", *args],
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.fixture(scope="module")
def plugin(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    source = _blocks(_section("A processor in 30 lines"), "python")[0]
    pyproject = next(b for b in _blocks(_section("Package it"), "toml") if "[project]" in b)
    root = tmp_path_factory.mktemp("docs") / DISTRIBUTION
    (root / "freetoken_suppress").mkdir(parents=True)
    (root / "freetoken_suppress" / "__init__.py").write_text(source)
    (root / "pyproject.toml").write_text(pyproject)
    with pip_installed(root, DISTRIBUTION, "freetoken_suppress") as module:
        yield module


def test_the_processor_is_short() -> None:
    source = _blocks(_section("A processor in 30 lines"), "python")[0]
    class_lines = [line for line in source[source.index("\nclass "):].splitlines()
                   if line.strip()]
    assert len(class_lines) <= 30, len(class_lines)  # the class, blank lines aside


def test_freetoken_plugins_lists_it(plugin: ModuleType) -> None:
    done = _cli("plugins", "--json")
    assert done.returncode == 0, done.stderr
    entry = next(p for p in json.loads(done.stdout) if p["name"] == "suppress")
    assert entry == {"name": "suppress", "distribution": DISTRIBUTION, "version": "0.1.0",
                     "enabled": True, "kind": "processor",
                     "description": "suppress_token_ids: tokens the model must never produce.",
                     "hooks": [], "fields": [FIELD]}


@pytest.mark.parametrize(("value", "param"), [
    ([True], f"{FIELD}[0]"), (["5"], f"{FIELD}[0]"), ([1.0], f"{FIELD}[0]"),
    ([-1], f"{FIELD}[0]"), (list(range(65)), FIELD), ("5", FIELD), ([700], FIELD)])
def test_bad_values_are_refused_naming_the_field(plugin: ModuleType, value: object,
                                                 param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        PluginManager().validate(SamplingParams(**{FIELD: value}), ModelInfo(642, frozenset(),
                                                                             2048))
    assert info.value.param == param


def test_it_changes_a_generation(plugin: ModuleType, tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), kv_cache_tokens=2048, progress=False)
    prompt = "The quick brown fox jumps over the lazy dog. The"
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    [plain] = llm.generate([prompt], greedy)
    banned = sorted(set(plain.outputs[0].token_ids))[:8]
    [suppressed] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16,
                                                         ignore_eos=True, **{FIELD: banned}))
    tokens = suppressed.outputs[0].token_ids
    assert len(tokens) == 16 and not set(tokens) & set(banned)
    with pytest.raises(InvalidRequest) as info:  # a token id beyond the vocabulary
        llm.generate([prompt], SamplingParams(max_tokens=2, **{FIELD: [10**6]}))
    assert info.value.param == FIELD


def test_freetoken_bench_plugin_runs_it(plugin: ModuleType) -> None:
    done = _cli("bench", "plugin", "suppress", "--batch", "4", "--vocab", "2048",
                "--history", "16", "--steps", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("plugin suppress: batch 4, vocab 2048")
    assert re.search(r"^\(c\) suppress on every row +[0-9.]+ +[0-9.]+x$", done.stdout, re.MULTILINE)
