"""The structured_outputs plugin end to end, on both grammar backends.

Offline ``LLM.generate`` on the tiny model (greedy, seeded, ``n > 1``, a mixed batch,
preemption, ``max_tokens`` cuts, ``ignore_eos``, refusals and a compile timeout); a real
``freetoken serve`` through the official ``openai`` client (chat and completions, streamed
and not, ``response_format`` and ``structured_outputs``, every 400 with its exact
``param``, plain streams beside a constrained one); the processor under a fake
``freetoken_answer_start`` and the reasoning plugin over the server (the ``<think>``
preamble is free, the answer is constrained); and the real default model (``slow``).

The tiny model's random weights like whitespace, which JSON allows anywhere: its JSON
requests push whitespace tokens down with ``logit_bias`` (the mask runs first, so a biased
token is still allowed where the grammar needs it) and bound every string with a pattern,
so that documents end well within ``max_tokens``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from server_fixtures import Server, ok, start_server, stop_server

from freetoken_core import LLM, InvalidRequest, SamplingParams
from freetoken_core.outputs import CompletionOutput
from freetoken_core.processors import AnswerStart, ModelInfo, ProcessorContext, RequestView
from freetoken_core.tokenizer import apply_chat_template, load_tokenizer
from freetoken_plugins.structured_outputs.backends import BACKENDS
from freetoken_plugins.structured_outputs.processor import StructuredOutputs

jsonschema = pytest.importorskip("jsonschema")

EOS, OPEN, CLOSE = 2, 640, 641
TINY_VOCAB = 642
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "minItems": 1,
                 "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
EMAIL = r"[a-z]{3,8}@[a-z]{2,6}\.(com|org)"
CHOICES = ["red", "green", "blue", 'a "quoted" one']
SUM_GRAMMAR = 'start: expr "=" NUMBER\nexpr: NUMBER | NUMBER OP NUMBER\n' \
              'NUMBER: /[0-9]{1,3}/\nOP: "+" | "-"\n'
SUM = r"[0-9]{1,3}([+-][0-9]{1,3})?=[0-9]{1,3}"
SLOW_TO_COMPILE: dict[str, Any] = {
    "type": "object",
    "properties": {f"k{i}": {"type": "string", "pattern": f"^[a-z]{{1,{i % 7 + 2}}}[0-9]{{2}}$"}
                   for i in range(400)},
}
"""Tens of milliseconds to compile on both backends: a 1 µs compile timeout cannot lose the
race to it (a schema that compiles in 1 ms might, on a loaded machine)."""
PROMPTS = ["hello", "The quick brown fox", "def add(a, b):"]


def as_schema_format(schema: dict[str, Any], name: str = "person") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                   "strict": True}}


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def check_json(text: str, schema: dict[str, Any]) -> Any:
    document = json.loads(text)
    jsonschema.validate(document, schema)
    return document


def check_complete(out: CompletionOutput, max_tokens: int) -> None:
    assert out.finish_reason == "stop", (out.finish_reason, out.text)
    assert len(out.token_ids) < max_tokens


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def no_space(tokenizer: Any) -> dict[int, float]:
    """``logit_bias`` pushing every whitespace-only token of the tiny vocabulary down."""
    ids = [i for i in range(len(tokenizer))
           if tokenizer.decode([i]) and not tokenizer.decode([i]).strip()]
    assert len(ids) >= 5
    return {i: -100.0 for i in ids}


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    pytest.importorskip(request.param)
    return request.param


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path, backend: str) -> LLM:
    return LLM(str(tiny_model_dir), kv_cache_tokens=8192, max_num_seqs=16, progress=False,
               plugin_options={"structured_outputs_backend": backend})


# -- offline, tiny model --------------------------------------------------------------------


def test_json_schema_greedy_and_seeded(llm: LLM, no_space: dict[int, float]) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=96, logit_bias=no_space,
                            structured_outputs={"json": PERSON})
    seeded = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=96, logit_bias=no_space,
                            response_format=as_schema_format(PERSON))
    outs = llm.generate(PROMPTS, [greedy, seeded, greedy])
    choices = [c for o in outs for c in o.outputs]
    assert len(choices) == 5 and all(o.error is None for o in outs)
    for choice in choices:
        check_complete(choice, 96)
        check_json(choice.text, PERSON)
        # Complete, and nothing but EOS may follow: it ends at once, without drawing EOS.
        assert EOS not in choice.token_ids and choice.text.endswith("}")
    # The same request again draws the same tokens: greedy, and per choice under a seed.
    again = llm.generate(PROMPTS[:2], [greedy, seeded])
    assert again[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert [c.token_ids for c in again[1].outputs] == [c.token_ids for c in outs[1].outputs]
    # The schema's key order is the order the document spells.
    keys = [list(json.loads(c.text)) for c in choices]
    assert all(k == ["name", "age", "tags", "ok"] for k in keys)


def test_json_object(llm: LLM, no_space: dict[int, float]) -> None:
    for fields in ({"response_format": {"type": "json_object"}},
                   {"structured_outputs": {"json_object": True}}):
        outs = llm.generate(PROMPTS, SamplingParams(
            temperature=1.0, seed=3, n=2, max_tokens=160, logit_bias=no_space, **fields))
        choices = [c for o in outs for c in o.outputs]
        for choice in choices:
            if choice.finish_reason == "stop":
                assert isinstance(json.loads(choice.text), dict)
            else:  # free keys and values may run long on random weights
                assert choice.finish_reason == "length" and len(choice.token_ids) == 160
                assert choice.text.startswith("{")
        assert any(c.finish_reason == "stop" for c in choices)


def test_regex_choice_and_grammar(llm: LLM) -> None:
    cases = [({"regex": EMAIL}, EMAIL), ({"grammar": SUM_GRAMMAR}, SUM),
             ({"choice": CHOICES}, "|".join(re.escape(c) for c in CHOICES))]
    for fields, pattern in cases:
        params = [SamplingParams(temperature=0, max_tokens=32, structured_outputs=fields),
                  SamplingParams(temperature=1.0, seed=11, n=4, max_tokens=32,
                                 structured_outputs=fields)]
        outs = llm.generate(PROMPTS[:2], params)
        for choice in (c for o in outs for c in o.outputs):
            check_complete(choice, 32)
            assert re.fullmatch(pattern, choice.text), (fields, choice.text)


def test_max_tokens_cuts_with_length(llm: LLM, no_space: dict[int, float]) -> None:
    outs = llm.generate(PROMPTS, SamplingParams(
        temperature=0, max_tokens=6, logit_bias=no_space, structured_outputs={"json": PERSON}))
    for out in outs:
        choice = out.outputs[0]
        assert choice.finish_reason == "length" and len(choice.token_ids) == 6
        assert choice.text.startswith("{")
        with pytest.raises(ValueError):
            json.loads(choice.text)
    cut = llm.generate("hi", SamplingParams(temperature=0, max_tokens=2,
                                            structured_outputs={"regex": "abcdefgh"}))
    assert cut[0].outputs[0].finish_reason == "length"
    assert "abcdefgh".startswith(cut[0].outputs[0].text) and cut[0].outputs[0].text


def test_ignore_eos_runs_on_with_eos_only(llm: LLM) -> None:
    out = llm.generate("hi", SamplingParams(temperature=1.0, seed=1, max_tokens=12,
                                            ignore_eos=True, structured_outputs={"regex": "abc"}))
    choice = out[0].outputs[0]
    assert choice.finish_reason == "length" and len(choice.token_ids) == 12
    assert choice.text == "abc"
    first_eos = choice.token_ids.index(EOS)
    assert choice.token_ids[first_eos:] == [EOS] * (12 - first_eos)


def test_text_format_is_no_constraint(llm: LLM) -> None:
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    text = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                          response_format={"type": "text"})
    assert not StructuredOutputs.uses(StructuredOutputs.Fields(response_format={"type": "text"}))
    outs = llm.generate([PROMPTS[0], PROMPTS[0]], [plain, text])
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert not re.fullmatch(EMAIL, outs[0].outputs[0].text)  # the natural text is unconstrained


def test_plain_rows_beside_constrained_ones_are_unchanged(llm: LLM,
                                                          no_space: dict[int, float]) -> None:
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, plain)]
    constrained = SamplingParams(temperature=0, max_tokens=96, logit_bias=no_space,
                                 structured_outputs={"json": PERSON})
    mixed = llm.generate([*PROMPTS, *PROMPTS], [plain] * 3 + [constrained] * 3)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    for out in mixed[3:]:
        check_json(out.outputs[0].text, PERSON)


def test_preempted_sequences_replay_into_their_matchers(tiny_model_dir: Path, backend: str,
                                                        llm: LLM,
                                                        no_space: dict[int, float]) -> None:
    params = SamplingParams(temperature=0, max_tokens=96, logit_bias=no_space,
                            structured_outputs={"json": PERSON})
    prompts = [f"{p} number {i}" for i in range(4) for p in PROMPTS]
    roomy = [o.outputs[0].text for o in llm.generate(prompts, params)]
    small = LLM(str(tiny_model_dir), kv_cache_tokens=256, block_size=16, max_num_seqs=12,
                progress=False, plugin_options={"structured_outputs_backend": backend})
    cramped = [o.outputs[0].text for o in small.generate(prompts, params)]
    assert small.engine.core.scheduler.num_preemptions > 0
    assert cramped == roomy
    for text in cramped:
        check_json(text, PERSON)


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs.regex", "invalid regex"),
    ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs.grammar",
     "invalid Lark grammar"),
    ({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs.json",
     "invalid JSON schema"),
    ({"response_format": as_schema_format({"type": "integer", "minimum": 5, "maximum": 1})},
     "response_format.json_schema.schema", "invalid JSON schema"),
], ids=["regex", "grammar", "json", "response_format"])
def test_invalid_constraint_fails_only_its_request(llm: LLM, fields: dict, param: str,
                                                   message: str) -> None:
    outs = llm.generate(["hi", "hi"], [SamplingParams(max_tokens=4, **fields),
                                       SamplingParams(temperature=0, max_tokens=4)])
    assert outs[0].error is not None and message in outs[0].error
    assert outs[0].outputs[0].finish_reason == "error"
    assert outs[1].error is None and outs[1].outputs[0].finish_reason == "length"


MALFORMED = [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "a", "schema": {}, "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"response_format": "json"}, "response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex"),
    ({"structured_outputs": {"disable_any_whitespace": True, "regex": "a"}},
     "structured_outputs.disable_any_whitespace"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs"),
]


@pytest.mark.parametrize(("fields", "param"), MALFORMED)
def test_malformed_fields_are_refused_by_name(llm: LLM, fields: dict, param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        llm.generate("hi", SamplingParams(max_tokens=4, **fields))
    assert info.value.param == param
    assert not llm.engine.has_unfinished_requests


def test_compile_timeout_fails_the_request_then_the_cached_grammar_serves(
        tiny_model_dir: Path, backend: str, no_space: dict[int, float]) -> None:
    hasty = LLM(str(tiny_model_dir), kv_cache_tokens=4096, progress=False, plugin_options={
        "structured_outputs_backend": backend, "structured_outputs_compile_timeout": 1e-6})
    params = SamplingParams(temperature=0, max_tokens=8, logit_bias=no_space,
                            structured_outputs={"json": SLOW_TO_COMPILE})
    first = hasty.generate("hi", params)[0]
    assert first.error is not None and "took longer than 1e-06 s to compile" in first.error
    assert first.outputs[0].finish_reason == "error"
    # The compile went on in the background and stayed cached: a later request uses it.
    for _ in range(50):
        later = hasty.generate("hi", params)[0]
        if later.error is None:
            break
        time.sleep(0.1)
    assert later.error is None and later.outputs[0].text.startswith("{")


# -- the processor under a fake freetoken_answer_start ------------------------------------


class FakeHooks:
    """Stands in for ``pm.hook``: every sequence's answer starts at ``start``."""

    def __init__(self, start: AnswerStart | None) -> None:
        self.start = start

    def freetoken_answer_start(self, request: RequestView, tokenizer: Any) -> AnswerStart | None:
        return self.start


def open_slot(backend: str, tokenizer: Any, start: AnswerStart | None,
              fields: dict[str, Any]) -> StructuredOutputs:
    ctx = ProcessorContext(4, ModelInfo(TINY_VOCAB, frozenset({EOS}), 2048),
                           torch.device("cpu"), tokenizer,
                           {"structured_outputs_backend": backend}, FakeHooks(start))
    proc = StructuredOutputs(ctx)
    view = RequestView("r", 0, StructuredOutputs.Fields(**fields), SamplingParams(), [5, 6],
                       [], is_chat=True)
    compiled = proc.prepare_request(view).result(timeout=30)
    proc.add_request(2, dataclasses.replace(view, prepared=compiled))
    return proc


def allowed_ids(proc: StructuredOutputs, slot: int = 2) -> set[int]:
    """The ids ``apply`` leaves finite in the row of ``slot`` (row 1 of a two-row batch
    whose row 0 belongs to a slot without a constraint)."""
    proc.prepare_step([0, slot])
    logits = torch.zeros(2, TINY_VOCAB)
    proc.apply(logits, torch.tensor([0, slot]))
    assert torch.equal(logits[0], torch.zeros(TINY_VOCAB))
    return set(torch.isfinite(logits[1]).nonzero().flatten().tolist())


def step(proc: StructuredOutputs, token: int, slot: int = 2) -> bool:
    """Accept ``token`` in ``slot``; whether the sequence must end now."""
    return slot in (proc.accept_tokens([slot], [token]) or [])


def test_answer_after_an_open_preamble_is_constrained(backend: str, tokenizer: Any) -> None:
    proc = open_slot(backend, tokenizer, AnswerStart(CLOSE, inside=True, open_token_id=OPEN),
                     {"structured_outputs": {"choice": ["yes", "no"]}})
    every = set(range(TINY_VOCAB))
    for token in [*encode(tokenizer, "not a choice {"), OPEN, EOS]:
        assert allowed_ids(proc) == every  # the preamble is free
        assert not step(proc, token)
    assert allowed_ids(proc) == every
    assert not step(proc, CLOSE)  # the answer starts after </think>
    allowed = allowed_ids(proc)
    assert CLOSE not in allowed and EOS not in allowed
    assert allowed and all("yes".startswith(tokenizer.decode([t]))
                           or "no".startswith(tokenizer.decode([t])) for t in allowed)
    answer = encode(tokenizer, "no")
    for token in answer[:-1]:
        assert not step(proc, token)
    assert step(proc, answer[-1])  # complete: the sequence ends at once


@pytest.mark.parametrize("opens", [True, False], ids=["model_opens", "answers_at_once"])
def test_the_model_may_open_a_preamble_with_its_first_token(backend: str, tokenizer: Any,
                                                            opens: bool) -> None:
    proc = open_slot(backend, tokenizer, AnswerStart(CLOSE, inside=False, open_token_id=OPEN),
                     {"structured_outputs": {"regex": "[0-9]+"}})
    first = allowed_ids(proc)
    assert OPEN in first and CLOSE not in first and encode(tokenizer, "7")[0] in first
    assert encode(tokenizer, "x")[0] not in first
    if opens:
        assert not step(proc, OPEN)
        assert allowed_ids(proc) == set(range(TINY_VOCAB))
        assert not step(proc, encode(tokenizer, "x")[0])
        assert not step(proc, CLOSE)
    else:
        assert not step(proc, encode(tokenizer, "7")[0])
    after = allowed_ids(proc)
    assert OPEN not in after and CLOSE not in after and encode(tokenizer, "x")[0] not in after
    assert encode(tokenizer, "8")[0] in after and (EOS in after) is not opens


def test_no_answer_start_constrains_from_the_first_token(backend: str, tokenizer: Any) -> None:
    proc = open_slot(backend, tokenizer, None, {"response_format": {"type": "json_object"}})
    first = allowed_ids(proc)
    assert OPEN not in first and all(tokenizer.decode([t]).lstrip().startswith("{")
                                     or not tokenizer.decode([t]).strip() for t in first)
    proc.remove_request(2)
    assert allowed_ids(proc) == set(range(TINY_VOCAB))  # a freed slot is unconstrained


# -- through a running server ---------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, backend: str) -> Iterator[Server]:
    srv = start_server(tiny_model_dir, "--structured-outputs-backend", backend)
    yield srv
    stop_server(srv)


def bias_of(no_space: dict[int, float]) -> dict[str, float]:
    """``no_space`` as JSON, and no ``<think>``: on the chat route the reasoning plugin lets
    the first token open a preamble, which random weights never close."""
    return {**{str(k): v for k, v in no_space.items()}, str(OPEN): -100.0}


def test_chat_and_completions_through_the_openai_client(server: Server,
                                                        no_space: dict[int, float]) -> None:
    client, bias = server.client, bias_of(no_space)
    chat = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Describe a person"}],
        temperature=0, max_tokens=96, logit_bias=bias,
        response_format=as_schema_format(PERSON))
    assert chat.choices[0].finish_reason == "stop"
    check_json(chat.choices[0].message.content, PERSON)

    chat_n = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Pick a colour"}],
        temperature=1.0, seed=5, n=3, max_tokens=32,
        extra_body={"structured_outputs": {"choice": CHOICES}})
    assert [c.message.content in CHOICES for c in chat_n.choices] == [True] * 3
    assert {c.finish_reason for c in chat_n.choices} == {"stop"}

    completion = client.completions.create(
        model=server.model, prompt=PROMPTS, temperature=0, max_tokens=96, logit_bias=bias,
        extra_body={"structured_outputs": {"json": json.dumps(PERSON)}})
    assert len(completion.choices) == 3
    for choice in completion.choices:
        assert choice.finish_reason == "stop"
        check_json(choice.text, PERSON)

    regex = client.completions.create(model=server.model, prompt="mail:", temperature=0,
                                      max_tokens=32, n=2, seed=3,
                                      extra_body={"structured_outputs": {"regex": EMAIL}})
    assert all(re.fullmatch(EMAIL, c.text) for c in regex.choices)
    cut = client.completions.create(model=server.model, prompt="x", temperature=0, max_tokens=4,
                                    logit_bias=bias,
                                    extra_body={"response_format": as_schema_format(PERSON)})
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 4


def test_streams_concatenate_to_a_valid_document(server: Server,
                                                 no_space: dict[int, float]) -> None:
    client, bias = server.client, bias_of(no_space)
    stream = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Describe a person"}],
        temperature=1.0, seed=9, n=2, max_tokens=96, logit_bias=bias, stream=True,
        response_format=as_schema_format(PERSON))
    texts, finishes = ["", ""], [None, None]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert finishes == ["stop", "stop"]
    for text in texts:
        check_json(text, PERSON)

    stream = client.completions.create(
        model=server.model, prompt="x = ", temperature=0, max_tokens=32, stream=True,
        extra_body={"structured_outputs": {"grammar": SUM_GRAMMAR}})
    pieces = [(c.choices[0].text, c.choices[0].finish_reason) for c in stream if c.choices]
    assert re.fullmatch(SUM, "".join(text for text, _ in pieces))
    assert pieces[-1][1] == "stop" and len(pieces) > 1


def test_text_format_through_the_server_is_no_constraint(server: Server) -> None:
    body = {"prompt": PROMPTS[2], "temperature": 0, "max_tokens": 12, "ignore_eos": True}
    plain = ok(server, "/v1/completions", body)
    text = ok(server, "/v1/completions", {**body, "response_format": {"type": "text"}})
    assert plain["choices"][0]["text"] == text["choices"][0]["text"]


INVALID = [
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": {"type": "object",
                                      "properties": {"a": {"type": "nonsense"}}}}},
     "structured_outputs.json"),
    ({"response_format": as_schema_format({"$ref": "#/nowhere"})},
     "response_format.json_schema.schema"),
]


@pytest.mark.parametrize(("route", "stream"), [("chat", False), ("chat", True),
                                               ("completions", False), ("completions", True)])
def test_every_refusal_is_a_400_naming_its_field(server: Server, route: str,
                                                 stream: bool) -> None:
    for fields, param in [*INVALID, *MALFORMED]:
        with pytest.raises(openai.BadRequestError) as info:
            if route == "chat":
                server.client.chat.completions.create(
                    model=server.model, messages=[{"role": "user", "content": "hi"}],
                    max_tokens=4, stream=stream, extra_body=fields)
            else:
                server.client.completions.create(model=server.model, prompt="hi", max_tokens=4,
                                                 stream=stream, extra_body=fields)
        assert info.value.status_code == 400, fields
        assert info.value.param == param, (fields, info.value.body)
        assert info.value.type == "invalid_request_error"


def test_compile_timeout_is_a_400(tiny_model_dir: Path, backend: str) -> None:
    srv = start_server(tiny_model_dir, "--structured-outputs-backend", backend,
                       "--structured-outputs-compile-timeout", "0.000001")
    try:
        schema = SLOW_TO_COMPILE
        for stream, fields, param in [
                (False, {"structured_outputs": {"json": schema}}, "structured_outputs.json"),
                (True, {"response_format": as_schema_format({**schema, "title": "t2"})},
                 "response_format.json_schema.schema")]:
            with pytest.raises(openai.BadRequestError) as info:
                srv.client.completions.create(model=srv.model, prompt="hi", max_tokens=4,
                                              stream=stream, extra_body=fields)
            assert info.value.param == param
            assert "took longer than 1e-06 s to compile" in info.value.message
        assert ok(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 2})["choices"]
    finally:
        stop_server(srv)


def test_plain_streams_beside_a_constrained_request_are_unaffected(
        server: Server, no_space: dict[int, float]) -> None:
    def plain(i: int) -> str:
        stream = server.client.completions.create(
            model=server.model, prompt=f"Story {i}: once upon a time", temperature=0,
            max_tokens=48, stream=True, extra_body={"ignore_eos": True})
        return "".join(c.choices[0].text for c in stream if c.choices)

    alone = [plain(i) for i in range(4)]
    results: dict[str, Any] = {}

    def run(name: str, fn: Any) -> None:
        try:
            results[name] = fn()
        except Exception as exc:  # noqa: BLE001 (recorded and asserted below)
            results[name] = exc

    def constrained() -> str:
        stream = server.client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "A person"}],
            temperature=0, max_tokens=96, logit_bias=bias_of(no_space), stream=True,
            response_format=as_schema_format(PERSON))
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    def invalid() -> Any:
        return server.client.completions.create(
            model=server.model, prompt="hi", max_tokens=4,
            extra_body={"structured_outputs": {"grammar": "start: ("}})

    threads = [threading.Thread(target=run, args=(f"plain{i}", lambda i=i: plain(i)))
               for i in range(4)]
    threads += [threading.Thread(target=run, args=("constrained", constrained)),
                threading.Thread(target=run, args=("invalid", invalid))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert [results[f"plain{i}"] for i in range(4)] == alone
    check_json(results["constrained"], PERSON)
    assert isinstance(results["invalid"], openai.BadRequestError)
    assert results["invalid"].param == "structured_outputs.grammar"
    assert server.http.get("/health").status_code == 200


USER = [{"role": "user", "content": "Tell me a story"}]
OPENED = [*USER, {"role": "assistant", "content": "<think>"}]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


def test_reasoning_preamble_is_free_and_the_answer_constrained(server: Server) -> None:
    """The prompt leaves ``<think>`` open; a ``logit_bias`` on ``</think>`` closes it after a
    few tokens (the bias is searched on the unconstrained raw text, so the test does not
    hang on the random weights' exact values)."""
    prompt = ok(server, "/tokenize", {"messages": OPENED, **CONTINUE})["tokens"]
    yes_no = {"structured_outputs": {"choice": ["yes", "no"]}}
    for bias in [6.0, 6.5, 7.0, 7.5, 8.0, 9.0, 10.0]:
        greedy = {"temperature": 0, "max_tokens": 24, "logit_bias": {str(CLOSE): bias}}
        raw = ok(server, "/v1/completions", {"prompt": prompt, **greedy})["choices"][0]["text"]
        preamble, closed, _ = raw.partition("</think>")
        if closed and preamble:
            break
    else:  # the tiny model's weights are seeded: one of these biases closes it
        pytest.fail("no bias closed the preamble after a few tokens: logit_bias or the "
                    "completions route changed")
    assert not ("yes".startswith(preamble) or "no".startswith(preamble))
    chat = ok(server, "/v1/chat/completions", {"messages": OPENED, **CONTINUE, **greedy,
                                               **yes_no})
    message = chat["choices"][0]["message"]
    assert message["reasoning_content"] == preamble  # unconstrained: the raw text's
    assert message["content"] in ("yes", "no")
    assert chat["choices"][0]["finish_reason"] == "stop"
    # The same prompt on completions has no reasoning: constrained from the first token.
    flat = ok(server, "/v1/completions", {"prompt": prompt, **greedy, **yes_no})
    assert flat["choices"][0]["text"] in ("yes", "no")

    stream = server.client.chat.completions.create(
        model=server.model, messages=OPENED, stream=True, extra_body={
            **CONTINUE, **greedy, **yes_no})
    reasoning, content = "", ""
    for chunk in stream:
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            reasoning += extra.get("reasoning_content") or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (preamble, message["content"])


# -- the default model (SmolLM2, 49,152 tokens) ---------------------------------------------

EVENT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "pattern": "^[A-Za-z ]{1,40}$"},
        "date": {"type": "string", "format": "date"},
        "attendees": {"type": "array", "minItems": 1, "maxItems": 3,
                      "items": {"type": "string", "pattern": "^[A-Za-z]{1,20}$"}},
        "online": {"type": "boolean"},
    },
    "required": ["title", "date", "attendees", "online"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def default_llm(backend: str) -> LLM:
    return LLM(None, kv_cache_tokens=8192, max_num_seqs=8, progress=False,
               plugin_options={"structured_outputs_backend": backend})


def chat_prompt(llm: LLM, content: str) -> str:
    return apply_chat_template(llm.tokenizer, [{"role": "user", "content": content}])


@pytest.mark.slow
def test_default_model_writes_valid_documents(default_llm: LLM) -> None:
    prompt = chat_prompt(default_llm, "Plan a team meeting. Answer in JSON with a title, a "
                                      "date, the attendees and whether it is online.")
    outs = default_llm.generate([prompt, prompt], [
        SamplingParams(temperature=0, max_tokens=128, response_format=as_schema_format(EVENT)),
        SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=128,
                       structured_outputs={"json": EVENT})])
    choices = [c for o in outs for c in o.outputs]
    for choice in choices:
        check_complete(choice, 128)
        document = check_json(choice.text, EVENT)
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", document["date"])
    cut = default_llm.generate(prompt, SamplingParams(
        temperature=0, max_tokens=5, response_format=as_schema_format(EVENT)))[0].outputs[0]
    assert cut.finish_reason == "length" and choices[0].text.startswith(cut.text)


@pytest.mark.slow
def test_default_model_regex_choice_and_grammar(default_llm: LLM) -> None:
    cases = [
        ("What is today's date? Answer as YYYY-MM-DD.", {"regex": r"\d{4}-\d{2}-\d{2}"},
         r"\d{4}-\d{2}-\d{2}"),
        ("What is the capital of France?", {"choice": ["Paris", "London", "Berlin"]},
         "Paris|London|Berlin"),
        ("What is 12 plus 7? Write the sum.", {"grammar": SUM_GRAMMAR}, SUM),
    ]
    prompts = [chat_prompt(default_llm, question) for question, _, _ in cases]
    params = [SamplingParams(temperature=t, seed=2, n=2, max_tokens=24,
                             structured_outputs=fields)
              for _, fields, _ in cases for t in (0.0, 1.0)]
    outs = default_llm.generate([p for p in prompts for _ in range(2)], params)
    for out, (_, _, pattern) in zip(outs, [c for c in cases for _ in range(2)]):
        for choice in out.outputs:
            check_complete(choice, 24)
            assert re.fullmatch(pattern, choice.text), (pattern, choice.text)
