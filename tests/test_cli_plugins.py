"""The command line for plugins: ``freetoken plugins``, ``--plugins``, ``bench plugin``."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import types
from importlib.metadata import EntryPoint, entry_points, version

import pytest
import torch

from freetoken_core import plugins as plugins_module
from freetoken_core.bench import (
    BenchError,
    BenchShape,
    build_plugin_bench,
    plugin_bench_params,
)
from freetoken_core.cli import main
from freetoken_core.hookspecs import ENTRY_POINT_GROUP
from freetoken_core.processors import LogitsProcessor, Plugin, RequestFields, RequestView

BUILTIN_FIELDS = {
    "penalties": ["frequency_penalty", "presence_penalty", "repetition_penalty"],
    "logit_bias": ["logit_bias"],
    "min_tokens": ["min_tokens"],
    "min_p": ["min_p"],
    "stop_tokens": ["stop_token_ids"],
    "fim": ["suffix"],
    "reasoning": ["messages[].reasoning", "messages[].reasoning_content", "reasoning_effort"],
}
PROCESSORS = {"penalties", "logit_bias", "min_tokens", "min_p"}
HOOKS = {"stop_tokens": ["freetoken_check_stop"], "fim": ["freetoken_rewrite_prompt"],
         "reasoning": ["freetoken_answer_start", "freetoken_chat_template",
                       "freetoken_decorate_response"]}
KEYS = ["name", "distribution", "version", "enabled", "kind", "description", "hooks",
        "fields"]
SMALL = ["--batch", "4", "--vocab", "1024", "--history", "16", "--steps", "3"]
# The vocabulary of the default model, whose tokenizer the bench hands the processors:
# structured_outputs needs logits at least that wide.
DEFAULT_VOCAB = 49_152


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


def install_plugin(monkeypatch: pytest.MonkeyPatch, name: str, cls: type[Plugin],
                   **module_attrs: object) -> None:
    """Install, for this test, plugin class ``cls`` under the entry point ``name``, in a
    module of its own holding ``module_attrs`` (e.g. ``BENCH_PARAMS``)."""
    module = types.ModuleType(f"ft_test_{name}_plugin")
    cls.__module__ = module.__name__
    vars(module).update(module_attrs, **{cls.__name__: cls})
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.delenv("FREETOKEN_PLUGINS", raising=False)
    real = list(plugins_module.entry_points(group=ENTRY_POINT_GROUP))
    fake = EntryPoint(name=name, value=f"{module.__name__}:{cls.__name__}",
                      group=ENTRY_POINT_GROUP)

    def entry_points(group: str) -> list[EntryPoint]:
        return [*real, fake] if group == ENTRY_POINT_GROUP else []

    monkeypatch.setattr(plugins_module, "entry_points", entry_points)


@pytest.fixture
def bare_plugin(monkeypatch: pytest.MonkeyPatch) -> str:
    """A plugin ``bare``: a ``Plugin`` with no fields, no hooks and no BENCH_PARAMS."""
    install_plugin(monkeypatch, "bare", type("Bare", (Plugin,), {}))
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
        assert sorted(info["fields"]) == fields
        assert info["kind"] == ("processor" if name in PROCESSORS else "hooks")
        assert info["hooks"] == HOOKS.get(name, [])
        assert info["description"]  # the first line of the class docstring


def test_plugins_flag_enables_only_those_named(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture) -> None:
    monkeypatch.delenv("FREETOKEN_PLUGINS", raising=False)
    infos = listed(capsys, "--plugins", "penalties")
    assert {n for n, i in infos.items() if i["enabled"]} == {"penalties"}
    # A disabled plugin is still described with what it would handle.
    assert infos["min_p"]["fields"] == ["min_p"] and infos["min_p"]["kind"] == "processor"


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
    assert lines[0].split() == ["NAME", "ENABLED", "DISTRIBUTION", "KIND", "FIELDS", "HOOKS"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert set(BUILTIN_FIELDS) | {"bare"} <= set(rows)
    assert rows["min_p"].split() == ["min_p", "yes", "freetoken", version("freetoken"),
                                     "processor", "min_p", "-"]
    assert rows["stop_tokens"].split()[1:] == ["no", "freetoken", version("freetoken"),
                                               "hooks", "stop_token_ids", "check_stop"]
    assert rows["bare"].split() == ["bare", "yes", "-", "hooks", "-", "-"]


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
    err = capsys.readouterr().err
    assert "$.min_p" in err and "<= 1.0" in err  # the type of MinP.Fields refused it
    assert main([*base, "--param", "top_p=0.5"]) == 2
    assert "use --top-p" in capsys.readouterr().err


def test_generate_block_size_reaches_the_engine(tiny_model_dir,
                                               capsys: pytest.CaptureFixture) -> None:
    """--block-size sizes the KV cache's blocks: a bad one is the engine config's error, and
    the text is the same at any size (attention sums each key in its position's order)."""
    base = ["generate", "Once upon a time", "--raw", "--model", str(tiny_model_dir),
            "--max-tokens", "12", "--kv-cache-tokens", "4096"]
    texts = []
    for size in ("4", "16"):
        assert main([*base, "--block-size", size]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].strip()
    assert main([*base, "--block-size", "0"]) != 0
    assert "block_size: must be >= 1" in capsys.readouterr().err


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
        tokens = step.run()
        assert [s.token_ids[-1] for s in step.seqs] == tokens  # the step appends them


def test_bench_stop_hook_plugin_times_the_hook() -> None:
    bench = build_plugin_bench("stop_tokens", BenchShape(batch=3, vocab=64, history=5),
                               num_steps=1)
    assert bench.active.pipeline.processors == []
    assert bench.plain.stop_checks == [] and bench.idle.stop_checks == []
    [(hook, rows)] = bench.active.stop_checks
    assert hook.plugin == "stop_tokens" and rows == [0, 1, 2]
    seen: list[tuple[list, list[int]]] = []
    bench.active.stop_checks = [(dataclasses.replace(
        hook, check=lambda views, tokens: seen.append((views, tokens)) or hook.check(
            views, tokens)), rows)]
    bench.active.reset()
    tokens = bench.active.run()
    [(views, checked)] = seen
    assert checked == tokens
    assert [v.fields.stop_token_ids for v in views] == [[3, 4, 5, 6]] * 3  # validated fields
    assert [v.num_output_tokens for v in views] == [1, 1, 1]


@pytest.mark.parametrize("name", sorted(
    ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)
    if ep.value.startswith("freetoken_plugins.")))
def test_bench_runs_every_builtin_with_bench_params(name: str) -> None:
    """Each built-in plugin with BENCH_PARAMS runs in (c), as a processor or a stop hook."""
    cls = next(ep.load() for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name)
    if plugin_bench_params(cls) is None:
        pytest.skip(f"{name} has no BENCH_PARAMS")
    bench = build_plugin_bench(name, BenchShape(batch=2, vocab=DEFAULT_VOCAB, history=4),
                               num_steps=1)
    assert bench.notes == []
    ran = {type(p).name for p in bench.active.pipeline.active()}
    ran |= {hook.plugin for hook, _ in bench.active.stop_checks}
    assert ran == {name}
    assert bench.idle.pipeline.active() == [] and bench.idle.stop_checks == []
    bench.active.reset()
    assert len(bench.active.run()) == 2


def test_bench_all_merges_every_plugin(bare_plugin: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "plugin", "all", *SMALL[:2], "--vocab", str(DEFAULT_VOCAB),
                 *SMALL[4:]]) == 0
    out = capsys.readouterr().out
    assert set(table_rows(out)) == {"a", "b", "c"}
    assert "note: skipped bare: no BENCH_PARAMS" in out
    bench = build_plugin_bench("all", BenchShape(batch=2, vocab=DEFAULT_VOCAB, history=4),
                               num_steps=1)
    active = {type(p).name for p in bench.active.pipeline.active()}
    assert {"min_p", "penalties", "logit_bias", "min_tokens", "structured_outputs"} <= active
    assert [(h.plugin, rows) for h, rows in bench.active.stop_checks] == [("stop_tokens",
                                                                          [0, 1])]


def test_bench_structured_outputs_masks_with_the_models_tokenizer() -> None:
    """The processors get the default model's tokenizer and EOS ids: structured_outputs
    compiles BENCH_PARAMS' schema for it, and the active rows draw only what the schema
    allows, while the idle rows draw freely."""
    shape = BenchShape(batch=3, vocab=DEFAULT_VOCAB + 64, history=4)  # padded, as models are
    bench = build_plugin_bench("structured_outputs", shape, num_steps=1)
    tokenizer = bench.model.tokenizer
    assert bench.model.name == "SmolLM2-135M-Instruct" and len(tokenizer) == DEFAULT_VOCAB
    [proc] = bench.active.pipeline.active()
    # (the ids llama.cpp ends generation on: <|im_end|>, <|endoftext|>, <reponame>)
    assert proc.ctx.tokenizer is tokenizer and proc.ctx.model.eos_token_ids == frozenset({0, 2, 4})
    texts, free = ["", "", ""], ["", "", ""]
    for _ in range(6):
        for step, out in ((bench.active, texts), (bench.idle, free)):
            step.reset()
            for row, token in enumerate(step.run()):
                out[row] += tokenizer.decode([token])
    for text in texts:  # {"name": ..., "age": ...}, JSON's whitespace allowed anywhere
        compact = re.sub(r"\s", "", text)
        assert compact.startswith("{"), texts
        assert any(key.startswith(compact[1:]) or compact[1:].startswith(key)
                   for key in ('"name"', '"age"')), texts
    assert all(not t.lstrip().startswith("{") for t in free), free


def test_bench_model_option_chooses_the_tokenizer(tiny_model_dir) -> None:
    bench = build_plugin_bench("structured_outputs", BenchShape(batch=2, vocab=1024, history=4),
                               num_steps=1, model=str(tiny_model_dir))
    assert len(bench.model.tokenizer) == 642 and bench.model.vocab_size == 642
    bench.active.reset()
    assert len(bench.active.run()) == 2
    # A vocabulary narrower than the tokenizer is refused, saying why.
    with pytest.raises(BenchError) as err:
        build_plugin_bench("structured_outputs", BenchShape(batch=2, vocab=512, history=4),
                           num_steps=1, model=str(tiny_model_dir))
    message = str(err.value)
    assert "--vocab 512" in message and "642 tokens" in message
    with pytest.raises(BenchError, match="--model"):
        build_plugin_bench("min_p", BenchShape(batch=2, vocab=64, history=4), num_steps=1,
                           model="/nonexistent/model")


def test_bench_stops_at_a_processor_that_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken(LogitsProcessor):
        class Fields(RequestFields):
            broken: bool | None = None

        def add_request(self, slot: int, request: RequestView) -> None:
            pass

        def remove_request(self, slot: int) -> None:
            pass

        def apply(self, logits: torch.Tensor, slots: torch.Tensor) -> None:
            raise RuntimeError("boom")

    install_plugin(monkeypatch, "broken", Broken, BENCH_PARAMS={"broken": True})
    bench = build_plugin_bench("broken", BenchShape(batch=2, vocab=64, history=4), num_steps=1)
    bench.idle.reset()
    assert len(bench.idle.run()) == 2  # no row uses it: it never runs
    bench.active.reset()
    with pytest.raises(BenchError) as err:
        bench.active.run()
    assert "'broken'" in str(err.value) and "apply" in str(err.value)


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
