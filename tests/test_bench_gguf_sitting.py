"""bench/gguf_sitting.py's table: figures of vs_llamacpp.py runs into rows, bars marked."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "bench" / "gguf_sitting.py"
_spec = importlib.util.spec_from_file_location("gguf_sitting", _PATH)
sitting = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sitting)


def _run(ours: dict[int, float], theirs: dict[int, float]) -> dict:
    return {"meta": {}, "freetoken": [{"clients": c, "tok_s": t} for c, t in ours.items()],
            "llamacpp": [{"clients": c, "tok_s": t} for c, t in theirs.items()]}


def test_rows_ratios_and_the_bars():
    results = {
        "default": {"exact": _run({1: 240.0, 16: 800.0}, {1: 160.0, 16: 320.0}),
                    "q8": _run({1: 150.0, 16: 450.0}, {1: 160.0, 16: 320.0})},
        "F16": {"exact": _run({1: 150.0}, {1: 120.0, 16: 500.0})},
    }
    lines = sitting.table(results, [1, 16]).splitlines()
    assert lines[0].startswith("| file | arithmetic | 1 client: ")
    assert "16 clients: " in lines[0]
    assert lines[2] == "| default | exact | 240.0 / 160.0 (1.50) | 800.0 / 320.0 (2.50) |"
    # under 1.0 at one client and under 1.5 at 16 are marked
    assert lines[3] == "| default | q8 | 150.0 / 160.0 (0.94*) | 450.0 / 320.0 (1.41*) |"
    # a client count one side lacks is a dash, not a ratio
    assert lines[4] == "| F16 | exact | 150.0 / 120.0 (1.25) | - |"


def test_a_failed_side_gives_no_ratio():
    assert sitting.cells(_run({1: 100.0}, {})) == {}
    assert sitting.cells({"freetoken": [], "llamacpp": [{"clients": 1, "tok_s": 9.0}]}) == {}


@pytest.mark.parametrize("argv, named", [(["--files", "Q3_K"], "--files"),
                                         (["--files", ""], "--files"),
                                         (["--arithmetics", "int8"], "--arithmetics")])
def test_bad_arguments_are_refused(argv, named, capsys):
    with pytest.raises(SystemExit) as exc:
        sitting.main(argv)
    assert exc.value.code == 2
    assert named in capsys.readouterr().err
