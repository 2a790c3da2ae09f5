"""Prompt logprobs: ``prompt_logprobs`` on both routes and offline, and ``echo`` with
``logprobs`` (and ``max_tokens: 0``) on ``/v1/completions``, as lm-evaluation-harness's
loglikelihood tasks send it. The numbers are checked against transformers' log-softmax of
the same prompt (float32), through chunked prefill, the prefix cache and preemption."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from server_fixtures import Server, start_server, stop_server
from server_fixtures import events as _events
from server_fixtures import ok as _ok
from server_fixtures import post as _post
from transformers import AutoModelForCausalLM

from freetoken_core import LLM, SamplingParams
from freetoken_core.engine import model_runner
from freetoken_core.errors import InvalidRequest
from freetoken_core.server.limits import RequestLimits
from freetoken_core.tokenizer import load_tokenizer

CHUNK = 16
"""``--max-num-batched-tokens`` of the test server and engines: prompts span many chunks."""
TOL = 1e-4
LONG = "The quick brown fox jumps over the lazy dog. Once upon a time there was a robot. " * 3
USER = [{"role": "user", "content": "Tell me a story about a robot and a cat"}]


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path):
    """``ids → [len(ids), vocab]`` float32 log-softmax of transformers' logits: row ``k``
    is the distribution of the token after ``ids[:k + 1]``."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)

    def log_softmax(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)

    return log_softmax


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[Server]:
    srv = start_server(tiny_model_dir, "--max-num-batched-tokens", str(CHUNK))
    yield srv
    stop_server(srv)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _rank(row: torch.Tensor, token: int) -> int:
    return int((row > row[token]).sum()) + 1


def _max_diff(token_logprobs: list[float | None], ids: list[int], ref: torch.Tensor) -> float:
    """Largest difference between the echoed prompt's ``token_logprobs`` and the reference."""
    assert token_logprobs[0] is None and len(token_logprobs) == len(ids)
    return max(abs(token_logprobs[k] - ref[k - 1, ids[k]].item()) for k in range(1, len(ids)))


def _loglikelihood(server: Server, prompt, max_tokens: int = 0) -> dict:
    """What lm-evaluation-harness sends for its loglikelihood tasks."""
    return _ok(server, "/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 1,
                                           "max_tokens": max_tokens, "temperature": 0})


# -- echo + logprobs, max_tokens 0 ---------------------------------------------------------


def test_echo_logprobs_of_a_prompt_longer_than_a_chunk_match_transformers(
        server: Server, tokenizer, reference) -> None:
    ids = _ids(tokenizer, LONG)
    assert len(ids) > 3 * CHUNK
    ref = reference(ids)
    out = _loglikelihood(server, LONG)
    choice = out["choices"][0]
    assert choice["text"] == LONG and choice["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 0
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert "prompt_logprobs" not in choice  # only when asked for by name
    lp = choice["logprobs"]
    assert _max_diff(lp["token_logprobs"], ids, ref) < TOL
    assert lp["tokens"] == [tokenizer.decode([t]) for t in ids]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    assert lp["top_logprobs"][0] is None
    for k in range(1, len(ids)):
        top = lp["top_logprobs"][k]
        best = int(ref[k - 1].argmax())
        assert top[tokenizer.decode([best])] == pytest.approx(ref[k - 1].max().item(), abs=TOL)
        assert top[lp["tokens"][k]] == lp["token_logprobs"][k]
        assert 1 <= len(top) <= 2


def test_echo_logprobs_over_a_cached_prefix_match_transformers(server: Server, tokenizer,
                                                               reference) -> None:
    prefix = LONG + "The cat said"
    # Fill the prefix cache with the shared prefix, and show that it is used.
    _ok(server, "/v1/completions", {"prompt": prefix + " hello", "max_tokens": 1})
    warm = _ok(server, "/v1/completions", {"prompt": prefix + " hi there", "max_tokens": 1})
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= 3 * CHUNK
    for prompt in (prefix + " hi there", prefix + " hello", prefix + " hello"):
        ids = _ids(tokenizer, prompt)
        out = _loglikelihood(server, prompt)
        assert _max_diff(out["choices"][0]["logprobs"]["token_logprobs"], ids,
                         reference(ids)) < TOL
        # The scored positions are computed, not read from the cache.
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_lm_eval_token_prompts_and_one_generated_token(server: Server, tokenizer,
                                                       reference) -> None:
    prompts = [_ids(tokenizer, LONG), _ids(tokenizer, "Hello world, this is a test"), [42]]
    out = _loglikelihood(server, prompts)
    assert len(out["choices"]) == 3
    for choice, ids in zip(sorted(out["choices"], key=lambda c: c["index"]), prompts):
        lp = choice["logprobs"]
        assert choice["text"] == tokenizer.decode(ids)
        assert len(lp["tokens"]) == len(ids)
        if len(ids) > 1:
            assert _max_diff(lp["token_logprobs"], ids, reference(ids)) < TOL
        else:
            assert lp["token_logprobs"] == [None] and lp["top_logprobs"] == [None]
    # With max_tokens 1 (older harnesses) the generated token follows the prompt's.
    ids = prompts[1]
    ref = reference(ids)
    lp = _loglikelihood(server, [ids], max_tokens=1)["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1
    assert _max_diff(lp["token_logprobs"][:-1], ids, ref) < TOL
    assert lp["token_logprobs"][-1] == pytest.approx(ref[-1].max().item(), abs=TOL)
    assert lp["tokens"][-1] == tokenizer.decode([int(ref[-1].argmax())])


def test_echo_logprobs_with_generation_and_n(server: Server, tokenizer) -> None:
    body = {"prompt": "Once upon a time", "echo": True, "logprobs": 2, "max_tokens": 4,
            "temperature": 0, "ignore_eos": True, "n": 2}
    out = _ok(server, "/v1/completions", body)
    plain = _ok(server, "/v1/completions", {**body, "echo": False})
    num_prompt = len(_ids(tokenizer, "Once upon a time"))
    for echoed, generated in zip(out["choices"], plain["choices"]):
        lp, gen = echoed["logprobs"], generated["logprobs"]
        assert echoed["text"] == "Once upon a time" + generated["text"]
        assert len(lp["tokens"]) == num_prompt + 4
        assert lp["tokens"][num_prompt:] == gen["tokens"]
        assert lp["token_logprobs"][num_prompt:] == pytest.approx(gen["token_logprobs"])
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i])
                                     for i in range(len(lp["tokens"]))]
    assert out["usage"]["completion_tokens"] == 8


def test_streamed_echo_logprobs_equal_the_whole_response(server: Server) -> None:
    body = {"prompt": ["Once upon a time", LONG], "echo": True, "logprobs": 1, "n": 2,
            "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    full = {c["index"]: c for c in _ok(server, "/v1/completions", body)["choices"]}
    merged = {i: {"text": "", "tokens": [], "token_logprobs": [], "top_logprobs": [],
                  "text_offset": []} for i in full}
    seen: set[int] = set()
    for event in _events(server, "/v1/completions", body):
        for choice in event["choices"]:
            index = choice["index"]
            if index not in seen:  # the first chunk of a choice carries its echo
                seen.add(index)
                assert choice["text"].startswith(full[index]["text"][:10])
                assert choice["logprobs"]["token_logprobs"][0] is None
            merged[index]["text"] += choice["text"]
            for key, values in choice["logprobs"].items():
                merged[index][key] += values
    for index, choice in full.items():
        assert merged[index].pop("text") == choice["text"]
        assert merged[index] == choice["logprobs"]
    # max_tokens 0 streams too: one chunk per choice, the whole prompt.
    events = _events(server, "/v1/completions", {**body, "max_tokens": 0, "n": 1})
    chunks = [c for e in events for c in e["choices"]]
    assert sorted(c["index"] for c in chunks) == [0, 1]
    assert all(c["finish_reason"] == "length" for c in chunks)


# -- prompt_logprobs -----------------------------------------------------------------------


def _check_prompt_logprobs(entries: list, ids: list[int], ref: torch.Tensor, num_top: int,
                           tokenizer) -> None:
    assert entries[0] is None and len(entries) == len(ids)
    for k in range(1, len(ids)):
        entry, row = entries[k], ref[k - 1]
        own = entry[str(ids[k])]
        assert own["logprob"] == pytest.approx(row[ids[k]].item(), abs=TOL)
        assert own["rank"] == _rank(row, ids[k])
        assert own["decoded_token"] == tokenizer.decode([ids[k]])
        top = row.topk(num_top)
        for rank, (value, token) in enumerate(zip(top.values.tolist(), top.indices.tolist()),
                                              1):
            alt = entry[str(token)]
            assert alt["logprob"] == pytest.approx(value, abs=TOL)
            assert alt["rank"] == rank or token == ids[k]
            assert alt["decoded_token"] == tokenizer.decode([token])
        assert len(entry) in (num_top, num_top + 1)


def test_completions_prompt_logprobs_top_n_and_ranks(server: Server, tokenizer,
                                                     reference) -> None:
    body = {"prompt": [LONG, "Hello world"], "prompt_logprobs": 5, "max_tokens": 2,
            "temperature": 0, "n": 2}
    out = _ok(server, "/v1/completions", body)
    assert len(out["choices"]) == 4
    for choice in out["choices"]:
        ids = _ids(tokenizer, body["prompt"][choice["index"] // 2])
        _check_prompt_logprobs(choice["prompt_logprobs"], ids, reference(ids), 5, tokenizer)
        assert choice["logprobs"] is None
    zero = _ok(server, "/v1/completions", {"prompt": "Hello world", "prompt_logprobs": 0,
                                           "max_tokens": 0})
    ids = _ids(tokenizer, "Hello world")
    assert [e if e is None else list(e) for e in zero["choices"][0]["prompt_logprobs"]] == \
        [None, *([str(t)] for t in ids[1:])]
    assert zero["choices"][0]["text"] == "" and zero["usage"]["completion_tokens"] == 0
    plain = _ok(server, "/v1/completions", {"prompt": "Hello world", "max_tokens": 1})
    assert "prompt_logprobs" not in plain["choices"][0]


def test_chat_prompt_logprobs_at_the_top_level(server: Server, tokenizer, reference) -> None:
    body = {"messages": USER, "prompt_logprobs": 3, "max_tokens": 2, "temperature": 0}
    out = _ok(server, "/v1/chat/completions", body)
    ids = _ok(server, "/tokenize", {"messages": USER})["tokens"]
    assert out["usage"]["prompt_tokens"] == len(ids)
    _check_prompt_logprobs(out["prompt_logprobs"], ids, reference(ids), 3, tokenizer)
    assert "prompt_logprobs" not in out["choices"][0]
    scored = _ok(server, "/v1/chat/completions", {**body, "max_tokens": 0})
    assert scored["choices"][0]["message"]["content"] == ""
    assert scored["choices"][0]["finish_reason"] == "length"
    assert scored["prompt_logprobs"] == out["prompt_logprobs"]
    plain = _ok(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 1})
    assert "prompt_logprobs" not in plain


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0, "logprobs": 1}, "max_tokens"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": "1"}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": USER, "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True},
     "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": USER, "prompt_logprobs": 1, "stream": True},
     "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 21, "max_tokens": 0},
     "logprobs"),
])
def test_invalid_requests_are_400_naming_the_field(server: Server, path: str, body: dict,
                                                   param: str) -> None:
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    if param == "max_tokens" and body.get("max_tokens") == 0:
        assert "prompt_logprobs" in error["message"] and "echo" in error["message"]


def test_prompt_logprobs_limit() -> None:
    limits = RequestLimits(max_prompt_logprobs=100)
    limits.check_prompt_logprobs(10, 2, 4, "prompt_logprobs")  # 10 × 5 × 2 = 100
    with pytest.raises(InvalidRequest) as info:
        limits.check_prompt_logprobs(11, 2, 4, "logprobs")
    assert info.value.param == "logprobs" and "100" in info.value.message


# -- offline, preemption, and what a request that does not ask costs ----------------------


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    # Blocks of two chunks: a recompute after preemption starts mid-block, over positions
    # already scored.
    return LLM(str(tiny_model_dir), kv_cache_tokens=4096, max_num_batched_tokens=CHUNK,
               block_size=2 * CHUNK, progress=False)


def test_offline_prompt_logprobs_in_vllm_shape(llm: LLM, reference) -> None:
    ids = _ids(llm.tokenizer, LONG)
    ref = reference(ids)
    out = llm.generate([ids, ids[:5]], SamplingParams(prompt_logprobs=2, max_tokens=3,
                                                      temperature=0, ignore_eos=True))
    for result, prompt in zip(out, (ids, ids[:5])):
        entries = result.prompt_logprobs
        assert entries is not None and entries[0] is None and len(entries) == len(prompt)
        for k in range(1, len(prompt)):
            own = entries[k][prompt[k]]
            assert own.logprob == pytest.approx(ref[k - 1, prompt[k]].item(), abs=TOL)
            assert own.rank == _rank(ref[k - 1], prompt[k])
            assert own.decoded_token == llm.tokenizer.decode([prompt[k]])
            best = int(ref[k - 1].argmax())
            assert entries[k][best].rank == 1 or best == prompt[k]
        assert len(result.outputs[0].token_ids) == 3
    scored = llm.generate([ids], SamplingParams(prompt_logprobs=0, max_tokens=0))[0]
    assert scored.outputs[0].token_ids == [] and scored.outputs[0].finish_reason == "length"
    assert [list(e) for e in scored.prompt_logprobs[1:]] == [[t] for t in ids[1:]]
    assert llm.generate([ids], SamplingParams(max_tokens=1))[0].prompt_logprobs is None


def test_preemption_while_scoring_neither_duplicates_nor_loses(llm: LLM, reference) -> None:
    ids = _ids(llm.tokenizer, LONG)
    ref = reference(ids)
    engine = llm.engine
    engine.add_request("p", ids, SamplingParams(prompt_logprobs=1, max_tokens=2,
                                                temperature=0))
    scheduler = engine.core.scheduler
    outputs, preempted = [], 0
    while engine.has_unfinished_requests:
        outputs += engine.step()
        seq = next(iter(scheduler.running), None)
        if seq is not None and seq.prompt_logprobs is not None and preempted < 2 \
                and seq.num_computed_tokens >= (2 + preempted) * CHUNK:
            scheduler.preempt(seq)  # recomputed: the scored blocks may come from the cache
            preempted += 1
    assert preempted == 2
    entries = outputs[-1].prompt_logprobs
    assert len(entries) == len(ids)
    diff = max(abs(entries[k][ids[k]].logprob - ref[k - 1, ids[k]].item())
               for k in range(1, len(ids)))
    assert diff < TOL


def test_a_request_that_does_not_ask_computes_no_extra_logits(
        llm: LLM, monkeypatch: pytest.MonkeyPatch, reference) -> None:
    model = llm.engine.core.runner.model
    rows: list[int] = []
    compute_logits = model.compute_logits

    def counting(hidden: torch.Tensor) -> torch.Tensor:
        rows.append(hidden.shape[0])
        return compute_logits(hidden)

    monkeypatch.setattr(model, "compute_logits", counting)
    ids = _ids(llm.tokenizer, LONG)
    llm.generate([ids], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert rows == [1, 1, 1, 1]  # one sampled row per step, none for the prompt
    rows.clear()
    # Asked for: one row per prompt position after the first, in slices of at most
    # PROMPT_LOGPROBS_ROWS rows (here smaller than a chunk), never per whole prompt.
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROBS_ROWS", 5)
    out = llm.generate([ids], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                             prompt_logprobs=1))[0]
    assert sum(rows) == len(ids) - 1 + 4 and max(rows) <= 5
    ref = reference(ids)
    assert max(abs(out.prompt_logprobs[k][ids[k]].logprob - ref[k - 1, ids[k]].item())
               for k in range(1, len(ids))) < TOL
