"""Generation defaults (``--generation-config``, ``--override-generation-config``): a
model's ``generation_config.json`` fills the sampling fields a request leaves unset, and
nothing else; offline, through ``freetoken serve`` and in the start-up checks and log."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from server_fixtures import free_port, ok, serve_cmd, start_server, stop_server
from tiny_models import make_tiny_model

from freetoken_core import LLM
from freetoken_core.cli import _engine_options, build_parser
from freetoken_core.config import EngineConfig
from freetoken_core.engine.generation_defaults import (
    GenerationConfigError,
    GenerationDefaults,
    read_sources,
)
from freetoken_core.sampling_params import SamplingParams

FILE_DEFAULTS = {"temperature": 0.2, "top_k": 5, "repetition_penalty": 1.3}
"""What the test generation config sets (beside keys that do not apply)."""
GEN_CONFIG = {**FILE_DEFAULTS, "do_sample": True, "bos_token_id": 0, "pad_token_id": 2,
              "transformers_version": "5.0.0", "no_such_key": 3}
EXPLICIT = {"temperature": 0.2, "top_k": 5, "repetition_penalty": 1.3}
NEUTRAL = {"temperature": 1.0, "top_k": -1, "repetition_penalty": 1.0}
PROMPT = "hello world"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(a tiny model whose generation_config.json sets ``GEN_CONFIG``, the same model with
    the tiny model's own generation_config.json (token ids only), a directory holding only
    a generation_config.json with ``GEN_CONFIG``)."""
    plain = make_tiny_model(tmp_path_factory.mktemp("plain"), "llama")
    with_defaults = tmp_path_factory.mktemp("with-defaults")
    for path in plain.iterdir():
        if path.name != "generation_config.json":
            (with_defaults / path.name).symlink_to(path)
    own = json.loads((plain / "generation_config.json").read_text())
    (with_defaults / "generation_config.json").write_text(json.dumps({**own, **GEN_CONFIG}))
    config_only = tmp_path_factory.mktemp("config-only")
    (config_only / "generation_config.json").write_text(json.dumps(GEN_CONFIG))
    return with_defaults, plain, config_only


def _llm(model: Path, **options: object) -> LLM:
    return LLM(str(model), kv_cache_tokens=2048, max_num_seqs=8, progress=False, **options)


def _tokens(llm: LLM, **params: object) -> list[int]:
    out = llm.generate(PROMPT, SamplingParams(seed=7, max_tokens=16, **params))[0]
    return out.outputs[0].token_ids


# -- SamplingParams: set and unset ---------------------------------------------------------


def test_sampling_params_tell_set_from_unset() -> None:
    unset = SamplingParams()
    assert not unset.is_set("temperature") and unset.temperature == 1.0
    assert not unset.is_set("repetition_penalty")
    explicit = SamplingParams(temperature=1.0, repetition_penalty=1.0, max_tokens=None)
    assert explicit.is_set("temperature") and explicit.is_set("repetition_penalty")
    assert explicit.is_set("max_tokens") and explicit.max_tokens is None
    assert not SamplingParams(repetition_penalty=None).is_set("repetition_penalty")


def test_with_defaults_fills_only_what_is_unset() -> None:
    params = SamplingParams(temperature=1.0, seed=3)
    got = params.with_defaults({"temperature": 0.2, "top_k": 5, "repetition_penalty": 1.3})
    assert (got.temperature, got.top_k, got.seed) == (1.0, 5, 3)
    assert got.extra == {"repetition_penalty": 1.3}
    assert got.is_set("top_k") and params.top_k == -1  # the caller's object is unchanged
    assert params.with_defaults({"temperature": 0.5}) is params
    with pytest.raises(Exception) as info:
        SamplingParams().with_defaults({"temperature": 5})
    assert getattr(info.value, "param", None) == "temperature"


def test_plugin_defaults_apply_only_on_routes_their_plugin_serves() -> None:
    defaults = GenerationDefaults(values={"suffix": "x", "temperature": 0.5},
                                  routes={"suffix": ["completions"]})
    chat = defaults.apply(SamplingParams(), "chat")
    assert chat.temperature == 0.5 and not chat.is_set("suffix")
    assert defaults.apply(SamplingParams(), "completions").extra == {"suffix": "x"}
    assert defaults.apply(SamplingParams(), None).extra == {"suffix": "x"}
    fallback = defaults.apply(SamplingParams(), "chat", {"max_tokens": None, "temperature": 1})
    assert fallback.max_tokens is None and fallback.temperature == 0.5


def test_sources(model_dirs: tuple[Path, Path, Path], tmp_path: Path) -> None:
    with_defaults, plain, config_only = model_dirs
    auto = EngineConfig(model=str(with_defaults))
    sources, why = read_sources(auto, with_defaults, is_gguf=False)
    assert [name for name, _ in sources] == [str(with_defaults / "generation_config.json")]
    assert why is None
    sources, why = read_sources(auto, with_defaults, is_gguf=True)
    assert sources == [] and "GGUF" in why
    sources, why = read_sources(auto, tmp_path, is_gguf=False)
    assert sources == [] and "has no generation_config.json" in why
    none = EngineConfig(generation_config="none", override_generation_config={"top_p": 0.5})
    sources, why = read_sources(none, with_defaults, is_gguf=False)
    assert sources == [("--override-generation-config", {"top_p": 0.5})]
    for path in (config_only, config_only / "generation_config.json"):
        sources, _ = read_sources(EngineConfig(generation_config=path), plain, False)
        assert sources[0][1] == GEN_CONFIG
    with pytest.raises(GenerationConfigError, match="no such file"):
        read_sources(EngineConfig(generation_config=str(tmp_path)), plain, False)
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(GenerationConfigError, match="not a JSON object"):
        read_sources(EngineConfig(generation_config=str(tmp_path)), plain, False)


def test_cli_flags() -> None:
    args = build_parser().parse_args(
        ["serve", "--generation-config", "none", "--override-generation-config",
         '{"temperature": 0.5}'])
    options = _engine_options(args)
    assert options["generation_config"] == "none"
    assert options["override_generation_config"] == {"temperature": 0.5}
    defaults = _engine_options(build_parser().parse_args(["generate", "hi"]))
    assert (defaults["generation_config"], defaults["override_generation_config"]) == ("auto", {})
    for bad in ("[1]", "{nope"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--override-generation-config", bad])


# -- offline -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llms(model_dirs: tuple[Path, Path, Path]) -> dict[str, LLM]:
    with_defaults, plain, _ = model_dirs
    return {"auto": _llm(with_defaults), "none": _llm(with_defaults, generation_config="none"),
            "plain": _llm(plain)}


def test_offline_defaults_change_only_unset_fields(llms: dict[str, LLM]) -> None:
    auto, none = llms["auto"], llms["none"]
    assert auto.engine.generation_defaults.values == FILE_DEFAULTS
    assert none.engine.generation_defaults.values == {}
    assert _tokens(auto) != _tokens(none)
    assert _tokens(auto) == _tokens(none, **EXPLICIT)
    # Sent explicitly, the neutral values win over the defaults.
    assert _tokens(auto, **NEUTRAL) == _tokens(none, **NEUTRAL) == _tokens(none)
    assert _tokens(auto, temperature=1.0) == _tokens(none, temperature=1.0, top_k=5,
                                                     repetition_penalty=1.3)
    # The caller's SamplingParams is left as it was.
    params = SamplingParams(seed=7, max_tokens=4)
    auto.generate(PROMPT, params)
    assert not params.is_set("temperature") and params.extra == {}


def test_model_without_sampling_keys_changes_nothing(llms: dict[str, LLM]) -> None:
    plain = llms["plain"]
    assert plain.engine.generation_defaults.values == {}
    assert _tokens(plain) == _tokens(llms["none"])


def test_override_wins_over_the_file_and_works_with_none(
        model_dirs: tuple[Path, Path, Path], llms: dict[str, LLM]) -> None:
    with_defaults, _, _ = model_dirs
    llm = _llm(with_defaults, override_generation_config={"top_k": 2, "max_new_tokens": 3})
    defaults = llm.engine.generation_defaults
    assert defaults.values == {**FILE_DEFAULTS, "top_k": 2, "max_tokens": 3}
    assert defaults.sources["top_k"] == "--override-generation-config"
    assert defaults.sources["temperature"].endswith("generation_config.json")
    out = llm.generate(PROMPT, SamplingParams(seed=7))[0].outputs[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"
    assert _tokens(llm) == _tokens(llms["none"], **{**EXPLICIT, "top_k": 2})
    only = _llm(with_defaults, generation_config="none",
                override_generation_config={"temperature": 0.0})
    assert only.engine.generation_defaults.values == {"temperature": 0.0}
    assert _tokens(only) == _tokens(llms["none"], temperature=0.0)


def test_eos_token_id_stops_generation(model_dirs: tuple[Path, Path, Path],
                                       llms: dict[str, LLM]) -> None:
    with_defaults, _, _ = model_dirs
    greedy = _tokens(llms["none"], temperature=0.0, ignore_eos=True)
    at = next(i for i in range(1, len(greedy)) if greedy[i] not in greedy[:i])
    stop_id = greedy[at]
    llm = _llm(with_defaults, generation_config="none",
               override_generation_config={"eos_token_id": [stop_id]})
    assert stop_id in llm.engine.model_info.eos_token_ids
    assert llm.engine.generation_defaults.eos_token_ids == [stop_id]
    out = llm.generate(PROMPT, SamplingParams(seed=7, max_tokens=16, temperature=0.0))[0]
    assert out.outputs[0].token_ids == greedy[:at + 1]
    assert out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize(("override", "key"), [
    ({"temperature": 5}, "temperature"),
    ({"top_k": 10**6}, "top_k"),
    ({"max_new_tokens": 0}, "max_tokens"),
    ({"repetition_penalty": "high"}, "repetition_penalty"),
    ({"min_p": 2.0}, "min_p"),
    ({"eos_token_id": [10**6]}, "eos_token_id"),
])
def test_bad_override_is_a_start_up_error(model_dirs: tuple[Path, Path, Path],
                                          override: dict, key: str) -> None:
    _, plain, _ = model_dirs
    with pytest.raises(GenerationConfigError) as info:
        _llm(plain, override_generation_config=override)
    assert key in str(info.value) and "--override-generation-config" in str(info.value)


def test_bad_file_default_names_the_file(model_dirs: tuple[Path, Path, Path],
                                         tmp_path: Path) -> None:
    _, plain, _ = model_dirs
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"temperature": 5}))
    with pytest.raises(GenerationConfigError) as info:
        _llm(plain, generation_config=str(path))
    assert "temperature" in str(info.value) and str(path) in str(info.value)


def test_keys_not_applied_are_logged(model_dirs: tuple[Path, Path, Path],
                                     caplog: pytest.LogCaptureFixture) -> None:
    with_defaults, _, _ = model_dirs
    with caplog.at_level(logging.INFO, logger="freetoken"):
        llm = _llm(with_defaults, plugins="none", override_generation_config={"n": 2})
    defaults = llm.engine.generation_defaults
    assert defaults.values == {"temperature": 0.2, "top_k": 5}
    text = caplog.text
    assert "generation defaults from" in text and "temperature=0.2" in text
    notes = [r.getMessage() for r in caplog.records if "not applied (no meaning" in r.getMessage()]
    assert len(notes) == 1, caplog.text
    for key in ("do_sample", "bos_token_id", "pad_token_id", "transformers_version"):
        assert key in notes[0]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("repetition_penalty" in w and "penalties" in w for w in warnings), warnings
    assert any("no_such_key" in w for w in warnings), warnings
    assert any("n=2" in w and "per request" in w for w in warnings), warnings
    # Unserved, a field is left out: the defaults pass validation with the plugins off.
    assert _tokens(llm) == _tokens(llm, temperature=0.2, top_k=5)


# -- freetoken serve -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers(model_dirs: tuple[Path, Path, Path], tmp_path_factory: pytest.TempPathFactory):
    with_defaults, plain, config_only = model_dirs
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    with_file = start_server(plain, "--generation-config", str(config_only),
                             "--override-generation-config", '{"top_k": 7}',
                             "--log-level", "info", log_file=log)
    try:
        without = start_server(with_defaults, "--generation-config", "none")
    except BaseException:
        stop_server(with_file)
        raise
    yield with_file, without, log
    stop_server(with_file)
    stop_server(without)


def _served(server, chat: bool, **fields: object) -> str:
    body = {"model": server.model, "max_tokens": 16, "seed": 7, **fields}
    if chat:
        out = ok(server, "/v1/chat/completions",
                 {**body, "messages": [{"role": "user", "content": PROMPT}]})
        return out["choices"][0]["message"]["content"]
    return ok(server, "/v1/completions", {**body, "prompt": PROMPT})["choices"][0]["text"]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_server_applies_defaults_to_unset_fields_only(servers, chat: bool) -> None:
    with_file, without, _ = servers
    effective = {**EXPLICIT, "top_k": 7}
    assert _served(with_file, chat) == _served(without, chat, **effective)
    assert _served(with_file, chat) != _served(without, chat)
    assert _served(with_file, chat, **NEUTRAL) == _served(without, chat, **NEUTRAL)
    # null is unset, as an absent field.
    nulls = dict.fromkeys(["temperature", "top_k", "repetition_penalty"])
    assert _served(with_file, chat, **nulls) == _served(with_file, chat)


def test_server_shows_defaults_and_logs_them(servers) -> None:
    with_file, without, log = servers
    card = with_file.http.get("/v1/models").json()["data"][0]
    assert card["generation_defaults"] == {**FILE_DEFAULTS, "top_k": 7}
    one = with_file.http.get(f"/v1/models/{with_file.model}").json()
    assert one["generation_defaults"] == card["generation_defaults"]
    assert without.http.get("/v1/models").json()["data"][0]["generation_defaults"] == {}
    text = log.read_text()
    lines = [ln for ln in text.splitlines() if "generation defaults from" in ln]
    assert len(lines) == 1 and "--override-generation-config" in lines[0], text
    assert "top_k=7" in lines[0] and "temperature=0.2" in lines[0]
    assert "do_sample" in text and "no_such_key" in text


def test_server_bad_default_is_a_start_up_error(model_dirs: tuple[Path, Path, Path]) -> None:
    _, plain, _ = model_dirs
    cmd = serve_cmd(str(plain), free_port(), "--override-generation-config",
                    '{"temperature": 5}')
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("freetoken: error:")]
    assert len(errors) == 1, proc.stderr
    assert "temperature" in errors[0] and "--override-generation-config" in errors[0]


def test_server_bad_flag_is_a_usage_error() -> None:
    proc = subprocess.run([sys.executable, "-m", "freetoken_core.cli", "serve",
                           "--override-generation-config", "[1]"],
                          check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--override-generation-config" in proc.stderr
