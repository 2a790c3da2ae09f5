"""The fim plugin: FIM token detection, the PSM layout, its 400s, and ``suffix`` end to end
on a real ``freetoken serve`` (tiny model, which has ``<fim_prefix>`` etc.)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from server_fixtures import Server, start_server, stop_server
from server_fixtures import post as _post

from freetoken_core import LLM, InvalidRequest, SamplingParams
from freetoken_core.models.resolve import resolve_model
from freetoken_core.plugins import PluginManager
from freetoken_core.processors import ModelInfo, PromptView
from freetoken_core.tokenizer import load_tokenizer
from freetoken_plugins import fim

GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
MODEL = ModelInfo(642, frozenset({2}), 2048)  # the test tokenizer's vocabulary


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def server(plain_server: Server) -> Server:
    return plain_server  # conftest.py: one server for the modules that need no flags


def _ok(server: Server, body: dict) -> dict:
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def _rewrite(prompt: str | list[int], tokenizer, route: str | None = "completions",
             **fields: object) -> str | list[int] | None:
    """The hook's answer for ``prompt`` and request ``fields``, validated as the server
    validates them (``params.fields["fim"]`` is set only when ``suffix`` was sent)."""
    params = SamplingParams(**fields)
    PluginManager(plugins="fim").validate(params, MODEL, route)
    return fim.Fim.freetoken_rewrite_prompt(PromptView(prompt, params, tokenizer))


# -- the hook, on tokenizers -----------------------------------------------------------


def test_detects_the_starcoder_style_tokens(tokenizer) -> None:
    assert fim.fim_tokens(tokenizer) == ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")


def test_layout_is_psm_and_tokenizes_to_the_fim_ids(tokenizer) -> None:
    text = _rewrite("def add(a, b):\n", tokenizer, suffix="    return a + b\n")
    assert text == "<fim_prefix>def add(a, b):\n<fim_suffix>    return a + b\n<fim_middle>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == 3 and ids[-1] == 4 and ids.count(5) == 1  # prefix, middle, suffix ids
    assert tokenizer.decode(ids[1:ids.index(5)]) == "def add(a, b):\n"


def test_an_empty_suffix_is_a_fim_request(tokenizer) -> None:
    assert _rewrite("x = ", tokenizer, suffix="") == "<fim_prefix>x = <fim_suffix><fim_middle>"


def test_no_suffix_leaves_the_prompt_alone(tokenizer) -> None:
    assert _rewrite("x", tokenizer) is None
    assert _rewrite("x", tokenizer, suffix=None) is None  # null is "not sent"


def test_token_prompt_with_suffix_is_refused(tokenizer) -> None:
    with pytest.raises(InvalidRequest) as info:
        _rewrite([7, 8], tokenizer, suffix="b")
    assert info.value.param == "suffix" and "token ids" in info.value.message


def test_non_string_suffix_is_refused_by_its_type(tokenizer) -> None:
    with pytest.raises(InvalidRequest) as info:
        _rewrite("a", tokenizer, suffix=3)
    assert info.value.param == "suffix" and "str" in info.value.message


def test_suffix_is_a_completions_field_only(tokenizer) -> None:
    assert fim.Fim.routes == {"completions"}
    with pytest.raises(InvalidRequest) as info:
        _rewrite("a", tokenizer, route="chat", suffix="b")
    assert info.value.param == "suffix" and "completions" in info.value.message


def test_default_model_has_no_fim_tokens() -> None:
    tokenizer = load_tokenizer(resolve_model(None, progress=False))
    assert fim.fim_tokens(tokenizer) is None
    with pytest.raises(InvalidRequest) as info:
        _rewrite("a", tokenizer, suffix="b")
    assert info.value.param == "suffix"
    assert "no fill-in-the-middle tokens" in info.value.message


def test_offline_suffix_is_laid_out_like_the_server(tiny_llm: LLM, tokenizer) -> None:
    prefix, suffix = "def add(a, b):\n", "    return c\n"
    params = {**GREEDY, "max_tokens": 4}
    [got] = tiny_llm.generate(prefix, SamplingParams(suffix=suffix, **params))
    [direct] = tiny_llm.generate(fim.fim_prompt(tokenizer, prefix, suffix),
                                 SamplingParams(**params))
    assert got.prompt_token_ids == direct.prompt_token_ids
    assert got.outputs[0].token_ids == direct.outputs[0].token_ids
    with pytest.raises(InvalidRequest) as info:
        tiny_llm.generate([7, 8], SamplingParams(suffix=suffix, **params))
    assert info.value.param == "suffix"


# -- end to end ------------------------------------------------------------------------


def test_suffix_sends_the_fim_layout(server: Server, tokenizer) -> None:
    prefix, suffix = "def add(a, b):\n", "    return c\n"
    body = {"prompt": prefix, "suffix": suffix, **GREEDY}
    got = _ok(server, body)
    layout = fim.fim_prompt(tokenizer, prefix, suffix)
    ids = tokenizer.encode(layout, add_special_tokens=False)
    assert got["usage"]["prompt_tokens"] == len(ids)
    # The same prompt ids sent directly generate the same middle.
    direct = _ok(server, {"prompt": ids, **GREEDY})
    assert got["choices"][0]["text"] == direct["choices"][0]["text"]
    plain = _ok(server, {"prompt": prefix, **GREEDY})
    assert plain["usage"]["prompt_tokens"] < len(ids)
    # Streamed: the same text.
    r = _post(server, "/v1/completions", {**body, "stream": True})
    assert r.status_code == 200, r.text
    lines = [ln[len("data: "):] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    streamed = "".join(c["text"] for ln in lines[:-1] for c in json.loads(ln)["choices"])
    assert streamed == got["choices"][0]["text"]


def test_suffix_with_a_list_of_prompts(server: Server, tokenizer) -> None:
    got = _ok(server, {"prompt": ["a = ", "b = "], "suffix": "\n", **GREEDY})
    expected = sum(len(tokenizer.encode(fim.fim_prompt(tokenizer, p, "\n"),
                                        add_special_tokens=False)) for p in ("a = ", "b = "))
    assert got["usage"]["prompt_tokens"] == expected and len(got["choices"]) == 2


@pytest.mark.parametrize(("route", "body", "words"), [
    ("/v1/completions", {"prompt": [7, 8, 9], "suffix": "x"}, "token ids"),
    ("/v1/completions", {"prompt": [[7, 8], [9]], "suffix": "x"}, "token ids"),
    ("/v1/completions", {"prompt": "a", "suffix": 3}, "str"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "suffix": "x"},
     "completions"),
])
def test_bad_suffix_is_400_naming_it(server: Server, route: str, body: dict,
                                     words: str) -> None:
    r = _post(server, route, {**body, "max_tokens": 2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "suffix" and words in error["message"]


def test_suffix_without_the_plugin_names_it(tiny_model_dir: Path) -> None:
    srv = start_server(tiny_model_dir, "--plugins", "min_p")
    try:
        r = _post(srv, "/v1/completions", {"prompt": "a", "suffix": "b", "max_tokens": 2})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "suffix" and "'fim'" in error["message"]
        assert "--plugins" in error["message"]
    finally:
        stop_server(srv)
