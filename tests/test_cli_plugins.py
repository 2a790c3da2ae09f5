"""The command line for plugins: ``freetoken plugins``, ``--plugins``, ``bench plugin``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
from importlib.metadata import EntryPoint, version

import pytest

from freetoken_core import bench as bench_module
from freetoken_core import plugins as plugins_module
from freetoken_core.bench import BenchShape, build_plugin_bench
from freetoken_core.cli import main
from freetoken_core.hookspecs import ENTRY_POINT_GROUP

BUILTIN_FIELDS = {
    "penalties": ["frequency_penalty", "presence_penalty", "repetition_penalty"],
    "logit_bias": ["logit_bias"],
    "min_tokens": ["min_tokens"],
    "min_p": ["min_p"],
    "stop_tokens": ["stop_token_ids"],
}
KEYS = ["name", "distribution", "version", "enabled", "hooks", "processors", "fields"]
SMALL = ["--batch", "4", "--vocab", "1024", "--history", "16", "--steps", "3"]


def freetoken(*args: str) -> subprocess.CompletedProcess:
    """Run the real command line in a fresh process (each costs a torch import: keep few)."""
    env = {k: v for k, v in os.environ.items() if k != "FREETOKEN_PLUGINS"}
    return subprocess.run([sys.executable, "-m", "freetoken_core.cli", *args], check=False,
                          capture_output=True, text=True, env=env, timeout=120)


def by_name(json_text: str) -> dict[str, dict]:
    infos = json.loads(json_text)
    assert all(list(info) == KEYS for info in infos)
    return {info["name"]: info for info in infos}


def listed(capsys: pytest.CaptureFixture, *args: str) -> dict[str, dict]:
    """``freetoken plugins --json ARGS`` in this process."""
    assert main(["plugins", "--json", *args]) == 0
    return by_name(capsys.readouterr().out)


@pytest.fixture
def bare_plugin(monkeypatch: pytest.MonkeyPatch) -> str:
    """Install, for this test, a plugin ``bare`` with no hooks and no BENCH_PARAMS."""
    monkeypatch.setitem(sys.modules, "ft_test_bare_plugin",
                        types.ModuleType("ft_test_bare_plugin"))
    monkeypatch.delenv("FREETOKEN_PLUGINS", raising=False)
    real = list(plugins_module.entry_points(group=ENTRY_POINT_GROUP))
    fake = EntryPoint(name="bare", value="ft_test_bare_plugin", group=ENTRY_POINT_GROUP)

    def entry_points(group: str) -> list[EntryPoint]:
        return [*real, fake] if group == ENTRY_POINT_GROUP else []

    monkeypatch.setattr(plugins_module, "entry_points", entry_points)
    monkeypatch.setattr(bench_module, "entry_points", entry_points)
    return "bare"


# -- freetoken plugins --------------------------------------------------------------------


def test_plugins_json_lists_the_builtins() -> None:
    result = freetoken("plugins", "--json")
    assert result.returncode == 0, result.stderr
    infos = by_name(result.stdout)
    assert set(BUILTIN_FIELDS) <= set(infos)
    for name, fields in BUILTIN_FIELDS.items():
        info = infos[name]
        assert info["enabled"] is True
        assert info["distribution"] == "freetoken" and info["version"] == version("freetoken")
        assert info["fields"] == fields
        assert {"freetoken_request_fields", "freetoken_validate_request"} <= set(info["hooks"])
    assert infos["min_p"]["processors"] == ["min_p"]
    for name in ("penalties", "logit_bias", "min_tokens"):
        assert infos[name]["processors"] and "freetoken_register_processors" in infos[name]["hooks"]
    assert infos["stop_tokens"]["processors"] == []
    assert "freetoken_check_stop" in infos["stop_tokens"]["hooks"]


def test_plugins_flag_enables_only_those_named(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture) -> None:
    monkeypatch.delenv("FREETOKEN_PLUGINS", raising=False)
    infos = listed(capsys, "--plugins", "penalties")
    assert {n for n, i in infos.items() if i["enabled"]} == {"penalties"}
    # A disabled plugin is still described with what it would handle.
    assert infos["min_p"]["fields"] == ["min_p"] and infos["min_p"]["processors"] == ["min_p"]


def test_environment_selects_when_the_flag_is_absent(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("FREETOKEN_PLUGINS", "min_p,stop_tokens")
    infos = listed(capsys)
    assert {n for n, i in infos.items() if i["enabled"]} == {"min_p", "stop_tokens"}
    infos = listed(capsys, "--plugins", "none")
    assert not any(i["enabled"] for i in infos.values())


def assert_unknown_plugin_error(stderr: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("freetoken: error: ")
    assert "bogus" in lines[0]
    assert all(name in lines[0].split("installed:")[1] for name in BUILTIN_FIELDS)


def test_unknown_plugin_is_a_start_up_error_listing_installed_ones(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    result = freetoken("plugins", "--plugins", "min_p,bogus")
    assert result.returncode == 2 and result.stdout == ""
    assert_unknown_plugin_error(result.stderr)
    # The plugins are checked before the model is even looked for.
    assert main(["generate", "hi", "--model", "/nonexistent", "--plugins", "bogus"]) == 2
    assert_unknown_plugin_error(capsys.readouterr().err)
    monkeypatch.setenv("FREETOKEN_PLUGINS", "bogus")
    assert main(["plugins"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert_unknown_plugin_error(captured.err)


def test_plugins_table(bare_plugin: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["plugins", "--plugins", "min_p,bare"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "ENABLED", "DISTRIBUTION", "PROCESSORS", "FIELDS",
                                "HOOKS"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert set(BUILTIN_FIELDS) | {"bare"} <= set(rows)
    assert rows["min_p"].split()[:5] == ["min_p", "yes", "freetoken", version("freetoken"),
                                         "min_p"]
    assert "validate_request" in rows["min_p"]
    assert rows["penalties"].split()[1] == "no"
    assert rows["bare"].split() == ["bare", "yes", "-", "-", "-", "-"]


# -- generate --plugins / --param ---------------------------------------------------------


def test_generate_plugins_and_param(tiny_model_dir, capsys: pytest.CaptureFixture) -> None:
    base = ["generate", "Once upon a time", "--raw", "--model", str(tiny_model_dir),
            "--max-tokens", "12", "--kv-cache-tokens", "4096"]
    hot = ["--temperature", "2", "--seed", "5"]
    texts = []
    for extra in ([], hot, [*hot, "--plugins", "min_p", "--param", "min_p=1"]):
        assert main(base + extra) == 0
        texts.append(capsys.readouterr().out)
    greedy, sampled, cut = texts
    assert sampled != greedy and cut == greedy  # min_p = 1 reached the engine
    assert main([*base, *hot, "--plugins", "none", "--param", "min_p=0.5"]) == 2
    err = capsys.readouterr().err
    assert "'min_p'" in err and "not enabled" in err
    assert main([*base, "--param", "min_p=1.5"]) == 2
    assert "min_p must be" in capsys.readouterr().err
    assert main([*base, "--param", "top_p=0.5"]) == 2
    assert "use --top-p" in capsys.readouterr().err


# -- freetoken bench plugin ---------------------------------------------------------------

ROW = re.compile(r"^\((a|b|c)\) (.+?)\s+(\d+\.\d+)\s+(\d+\.\d+)x$")


def table_rows(text: str) -> dict[str, tuple[str, float, float]]:
    rows = {}
    for line in text.splitlines():
        match = ROW.match(line)
        if match:
            rows[match[1]] = (match[2], float(match[3]), float(match[4]))
    return rows


def test_bench_plugin_min_p_prints_three_rows() -> None:
    result = freetoken("bench", "plugin", "min_p", "--batch", "4", "--vocab", "512",
                       "--history", "16", "--steps", "3")
    assert result.returncode == 0, result.stderr
    rows = table_rows(result.stdout)
    assert set(rows) == {"a", "b", "c"}, result.stdout
    assert rows["a"][0] == "plain sampler" and rows["a"][2] == 1.0
    assert rows["b"][0] == "min_p enabled, no row uses it"
    assert rows["c"][0] == "min_p on every row"
    for _, ms, ratio in rows.values():
        assert ms > 0 and ratio > 0
    assert "batch 4, vocab 512, history 16" in result.stdout


def test_bench_setups_run_what_they_claim() -> None:
    bench = build_plugin_bench("min_p", BenchShape(batch=3, vocab=64, history=5), num_steps=1)
    assert bench.plain.pipeline.processors == []
    assert [type(p).name for p in bench.idle.pipeline.processors] == ["min_p"]
    assert bench.idle.pipeline.active() == []
    assert [type(p).name for p in bench.active.pipeline.active()] == ["min_p"]
    assert bench.active.pipeline.processors[0].log_min_p.tolist() == pytest.approx(
        [-2.9957323] * 3)  # log(BENCH_PARAMS["min_p"]) in every slot
    for step in (bench.plain, bench.idle, bench.active):
        assert [len(s.token_ids) for s in step.seqs] == [5, 5, 5]
        step.reset()
        assert len(step.run()) == 3
        step.reset()
        assert [len(s.token_ids) for s in step.seqs] == [6, 6, 6]


def test_bench_stop_hook_plugin_times_the_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = build_plugin_bench("stop_tokens", BenchShape(batch=3, vocab=64, history=5),
                               num_steps=1)
    assert bench.active.pipeline.processors == []
    assert bench.plain.check_stop is None and bench.idle.stop_rows == []
    assert bench.active.stop_rows == [0, 1, 2]
    seen: list[list[int]] = []
    inner = bench.active.check_stop
    monkeypatch.setattr(bench.active, "check_stop",
                        lambda views, tokens: seen.append(tokens) or inner(views, tokens))
    bench.active.reset()
    tokens = bench.active.run()
    assert seen == [tokens]


def test_bench_all_merges_every_plugin(bare_plugin: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "plugin", "all", *SMALL]) == 0
    out = capsys.readouterr().out
    assert set(table_rows(out)) == {"a", "b", "c"}
    assert "note: skipped bare: no BENCH_PARAMS" in out
    bench = build_plugin_bench("all", BenchShape(batch=2, vocab=1024, history=4), num_steps=1)
    active = {type(p).name for p in bench.active.pipeline.active()}
    assert {"min_p", "penalties", "logit_bias", "min_tokens"} <= active
    assert bench.active.stop_rows == [0, 1]


def test_bench_errors_exit_2(bare_plugin: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "plugin", "bare", *SMALL]) == 2
    err = capsys.readouterr().err
    assert "'bare'" in err and "BENCH_PARAMS" in err
    assert main(["bench", "plugin", "bogus", *SMALL]) == 2
    err = capsys.readouterr().err
    assert "bogus" in err and "min_p" in err.split("installed:")[1]
    assert main(["bench", "plugin", "min_p", "--batch", "0"]) == 2
    assert "--batch" in capsys.readouterr().err
    assert main(["bench", "plugin", "min_p", *SMALL[:-1], "0"]) == 2
    assert "--steps" in capsys.readouterr().err
