"""docs/plugins.md lists every view a hook or processor method receives with its exact
fields: the ``class`` block of each view in the docs matches the dataclass, field by field
(name and annotation, in order)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from freetoken_core import processors

DOC = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"
VIEWS = [processors.ModelInfo, processors.ProcessorContext, processors.RequestView,
         processors.StopView, processors.PromptView, processors.AnswerStart,
         processors.ResponseView, processors.ChoiceView]


def documented_fields(name: str) -> list[tuple[str, str]]:
    """``(field, annotation)`` pairs of ``class name:`` in the docs' views block."""
    text = DOC.read_text()
    match = re.search(rf"^class {name}:.*?\n((?:    \w+: [^\n]*\n)+)", text, flags=re.MULTILINE)
    assert match is not None, f"docs/plugins.md has no block for class {name}"
    pairs = []
    for line in match.group(1).splitlines():
        field, annotation = line.strip().split(": ", 1)
        pairs.append((field, annotation.split("  #")[0].strip()))
    return pairs


@pytest.mark.parametrize("view", VIEWS, ids=lambda v: v.__name__)
def test_view_is_documented_field_by_field(view: type) -> None:
    actual = [(f.name, str(f.type).replace("SequenceABC", "Sequence"))
              for f in dataclasses.fields(view)]
    assert documented_fields(view.__name__) == actual
