"""The fim plugin: FIM token detection, the PSM layout, its 400s, and ``suffix`` end to end
on a real ``freetoken serve`` (tiny model, which has ``<fim_prefix>`` etc.)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from server_fixtures import Server, start_server, stop_server
from server_fixtures import post as _post

from freetoken_core import LLM, InvalidRequest, SamplingParams
from freetoken_core.models.resolve import resolve_model
from freetoken_core.tokenizer import load_tokenizer
from freetoken_plugins import fim

GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[Server]:
    srv = start_server(tiny_model_dir)
    yield srv
    stop_server(srv)



def _ok(server: Server, body: dict) -> dict:
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


# -- the hook, on tokenizers -----------------------------------------------------------


def test_detects_the_starcoder_style_tokens(tokenizer) -> None:
    assert fim.fim_tokens(tokenizer) == ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")


def test_layout_is_psm_and_tokenizes_to_the_fim_ids(tokenizer) -> None:
    request = SimpleNamespace(suffix="    return a + b\n")
    text = fim.freetoken_rewrite_prompt(request=request, prompt="def add(a, b):\n",
                                        tokenizer=tokenizer)
    assert text == "<fim_prefix>def add(a, b):\n<fim_suffix>    return a + b\n<fim_middle>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == 3 and ids[-1] == 4 and ids.count(5) == 1  # prefix, middle, suffix ids
    assert tokenizer.decode(ids[1:ids.index(5)]) == "def add(a, b):\n"


def test_no_suffix_leaves_the_prompt_alone(tokenizer) -> None:
    request = SimpleNamespace(suffix=None)
    assert fim.freetoken_rewrite_prompt(request=request, prompt="x", tokenizer=tokenizer) is None


def test_token_prompt_with_suffix_is_refused(tokenizer) -> None:
    with pytest.raises(InvalidRequest) as info:
        fim.freetoken_rewrite_prompt(request=SimpleNamespace(suffix="b"), prompt=[7, 8],
                                     tokenizer=tokenizer)
    assert info.value.param == "suffix" and "token ids" in info.value.message


def test_non_string_suffix_is_refused(tokenizer) -> None:
    with pytest.raises(InvalidRequest) as info:
        fim.freetoken_rewrite_prompt(request=SimpleNamespace(suffix=3), prompt="a",
                                     tokenizer=tokenizer)
    assert info.value.param == "suffix"


def test_default_model_has_no_fim_tokens() -> None:
    tokenizer = load_tokenizer(resolve_model(None, progress=False))
    assert fim.fim_tokens(tokenizer) is None
    with pytest.raises(InvalidRequest) as info:
        fim.freetoken_rewrite_prompt(request=SimpleNamespace(suffix="b"), prompt="a",
                                     tokenizer=tokenizer)
    assert info.value.param == "suffix"
    assert "no fill-in-the-middle tokens" in info.value.message


def test_offline_suffix_points_at_fim_prompt(tiny_llm: LLM) -> None:
    with pytest.raises(InvalidRequest) as info:
        tiny_llm.generate("a", SamplingParams(suffix="b", max_tokens=2))
    assert info.value.param == "suffix" and "fim_prompt" in info.value.message


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


@pytest.mark.parametrize(("body", "words"), [
    ({"prompt": [7, 8, 9], "suffix": "x"}, "token ids"),
    ({"prompt": [[7, 8], [9]], "suffix": "x"}, "token ids"),
    ({"prompt": "a", "suffix": 3}, "str"),
])
def test_bad_suffix_is_400_naming_it(server: Server, body: dict, words: str) -> None:
    r = _post(server, "/v1/completions", {**body, "max_tokens": 2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "suffix" and words in error["message"]


def test_suffix_without_the_plugin_names_it(tiny_model_dir: Path) -> None:
    srv = start_server(tiny_model_dir, "--plugins", "penalties")
    try:
        r = _post(srv, "/v1/completions", {"prompt": "a", "suffix": "b", "max_tokens": 2})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "suffix" and "'fim'" in error["message"]
        assert "--plugins" in error["message"]
    finally:
        stop_server(srv)
