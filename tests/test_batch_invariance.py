"""Seeds hold at every batch size: on the default model, a seeded request draws the same
tokens alone, among 8, 24 or 48 other sequences, with its prompt cut into prefill chunks,
and with its prompt prefix served from the prefix cache.

Sampling is per row by construction (counter-based draws, ``engine/sampler.py``); what this
holds is the model's numerics: the GGUF-block linears sum every row in one order whatever
the row count, and the native attention computes every token, decoding or prefilling, as
one query over its own keys. A difference of one ulp in a logit can flip a draw near a tie,
so the logprobs of the drawn tokens are compared exactly too.
"""

from __future__ import annotations

import pytest
import torch

from freetoken_core import LLM, SamplingParams
from freetoken_core.tokenizer import apply_chat_template

QUESTIONS = ["Tell me a story about a dragon who learns to cook.",
             "Describe the ocean at night.", "What makes a good friend?",
             "Write a short poem about autumn leaves.", "How do volcanoes form?",
             "Give three tips for learning a new language.", "Why is the sky blue?",
             "Explain how a bicycle works."]
SEEDED = SamplingParams(seed=7, temperature=1.0, max_tokens=24, ignore_eos=True, logprobs=0)


def chat(llm: LLM, text: str) -> list[int]:
    prompt = apply_chat_template(llm.tokenizer, [{"role": "user", "content": text}])
    return llm.tokenizer.encode(prompt, add_special_tokens=False)


def run(llm: LLM, prompt: list[int], others: int, join_after_steps: int = 0,
        tag: str = "", cached: int = 0) -> tuple[list[int], list[float]]:
    """The seeded request's tokens and their logprobs (its prompt had ``cached`` tokens
    from the prefix cache), with ``others`` sequences (their own
    prompts, seeds and lengths) added first and ``join_after_steps`` engine steps run before
    the seeded request joins them."""
    engine = llm.engine
    for i in range(others):
        text = f"{QUESTIONS[i % len(QUESTIONS)]} (variant {i})"
        engine.add_request(f"{tag}o{i}", chat(llm, text),
                           SamplingParams(seed=100 + i, temperature=0.9,
                                          max_tokens=8 + 5 * (i % 7), ignore_eos=True))
    for _ in range(join_after_steps):
        engine.step()
    engine.add_request(f"{tag}seeded", prompt, SEEDED)
    result = None
    while engine.has_unfinished_requests:
        for output in engine.step():
            if output.request_id == f"{tag}seeded" and output.finished:
                assert output.num_cached_tokens == cached
                result = output.outputs[0]
    assert result is not None
    return result.token_ids, [lp.logprob for lp in result.logprobs]


@pytest.fixture(scope="module")
def llm() -> LLM:
    llm = LLM(None, dtype="float32", kv_cache_tokens=16384, max_num_seqs=64,
              max_num_batched_tokens=256, enable_prefix_caching=False, progress=False)
    assert llm.engine.core.runner.model.uses_gguf_blocks
    assert llm.engine.core.runner.model.native
    return llm


@pytest.fixture(scope="module")
def alone(llm: LLM) -> tuple[list[int], list[float]]:
    return run(llm, chat(llm, "Invent a name for a new colour and describe it."), 0,
               tag="alone")


@pytest.mark.parametrize(("others", "join_after_steps"), [(8, 0), (24, 2), (48, 1)])
def test_seeded_request_draws_the_same_tokens_in_any_batch(
        llm: LLM, alone: tuple[list[int], list[float]], others: int,
        join_after_steps: int) -> None:
    """With 256 batched tokens a step, 48 others fill the first steps: the seeded prompt
    joins decoding rows and is cut into chunks; with 24 it joins two steps in."""
    prompt = chat(llm, "Invent a name for a new colour and describe it.")
    got = run(llm, prompt, others, join_after_steps, tag=f"b{others}")
    assert got == alone


def test_seeded_request_draws_the_same_tokens_after_a_prefix_cache_hit(
        alone: tuple[list[int], list[float]]) -> None:
    """The second run of a prompt prefills only its last block's tokens: fewer rows per
    step, same tokens."""
    llm = LLM(None, dtype="float32", kv_cache_tokens=4096, enable_prefix_caching=True,
              progress=False)
    prompt = chat(llm, "Invent a name for a new colour and describe it.")
    assert run(llm, prompt, 0, tag="p1") == alone
    block = llm.engine.core.scheduler.block_manager.block_size
    assert run(llm, prompt, 3, tag="p2", cached=(len(prompt) - 1) // block * block) == alone


def test_the_block_in_one_native_call_computes_what_the_python_path_computes(
        llm: LLM, alone: tuple[list[int], list[float]], monkeypatch: pytest.MonkeyPatch) -> None:
    """``llama_layer`` runs a block's kernels from C++ in the order DecoderLayer.__call__
    runs them from Python: the same tokens and logprobs, to the bit."""
    layers = llm.engine.core.runner.model.layers
    assert all(layer.one_call is not None for layer in layers)
    for layer in layers:
        monkeypatch.setattr(layer, "one_call", None)
    prompt = chat(llm, "Invent a name for a new colour and describe it.")
    assert run(llm, prompt, 8, tag="python") == alone


def test_the_blocks_one_call_at_a_time_compute_what_all_in_one_call_computes(
        llm: LLM, alone: tuple[list[int], list[float]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step runs every block in one ``llama_layers`` call; with one block on the
    Python path the others run one ``llama_layer`` call each: the same tokens and logprobs."""
    layers = llm.engine.core.runner.model.layers
    calls = []
    real = torch.ops.freetoken.llama_layer
    monkeypatch.setattr(layers[-1], "one_call", None)
    monkeypatch.setattr(torch.ops.freetoken, "llama_layer",
                        lambda *args: calls.append(1) or real(*args), raising=False)
    prompt = chat(llm, "Invent a name for a new colour and describe it.")
    assert run(llm, prompt, 8, tag="per-block") == alone
    assert calls, "the per-block native call did not run"


def test_q8_activations_hold_seeds_too_and_differ_from_the_exact_path(
        alone: tuple[list[int], list[float]], monkeypatch: pytest.MonkeyPatch) -> None:
    """``--activations q8`` (llama.cpp's arithmetic, opt-in): each row quantized on its own
    and summed in one order, so a seeded request draws the same tokens alone and among 8
    others (prompt chunked), in the one-call block and in the Python path; its logprobs are
    not the exact path's."""
    llm = LLM(None, dtype="float32", activations="q8", kv_cache_tokens=8192, max_num_seqs=16,
              max_num_batched_tokens=64, enable_prefix_caching=False, progress=False)
    model = llm.engine.core.runner.model
    assert all(layer.one_call is not None for layer in model.layers)
    prompt = chat(llm, "Invent a name for a new colour and describe it.")
    q8_alone = run(llm, prompt, 0, tag="q8a")
    assert q8_alone[1] != alone[1]
    assert run(llm, prompt, 8, tag="q8b") == q8_alone
    for layer in model.layers:
        monkeypatch.setattr(layer, "one_call", None)
    assert run(llm, prompt, 3, tag="q8c") == q8_alone


def linear_types(llm: LLM) -> set[int]:
    model = llm.engine.core.runner.model
    return {lin.blocks[0] for layer in model.layers for lin in layer.linears}


def test_the_default_arithmetic_is_int24_where_the_cpu_has_it(llm: LLM) -> None:
    from freetoken_core.models.block_layout import ACTIVATIONS_INT24, int_linear_available

    flags = {t & ACTIVATIONS_INT24 for t in linear_types(llm)}
    assert flags == ({ACTIVATIONS_INT24} if int_linear_available() else {0})


@pytest.mark.parametrize("mode", ["float32", "int24"])
def test_each_exact_kernel_holds_seeds(mode: str) -> None:
    """Both exact kernels, whichever ``auto`` picks on this CPU: a seeded request draws the
    same tokens, with the same logprobs, alone and among 8 others (its prompt cut into
    chunks)."""
    from freetoken_core.models.block_layout import ACTIVATIONS_INT24, int_linear_available

    if mode == "int24" and not int_linear_available():
        pytest.skip("the int24 kernel needs AVX-512 VNNI")
    llm = LLM(None, dtype="float32", activations=mode, kv_cache_tokens=8192, max_num_seqs=16,
              max_num_batched_tokens=64, enable_prefix_caching=False, progress=False)
    flags = {t & ACTIVATIONS_INT24 for t in linear_types(llm)}
    assert flags == ({ACTIVATIONS_INT24} if mode == "int24" else {0})
    prompt = chat(llm, "Invent a name for a new colour and describe it.")
    first = run(llm, prompt, 0, tag=f"{mode}a")
    assert run(llm, prompt, 8, tag=f"{mode}b") == first


def test_q8_activations_need_gguf_blocks_and_name_the_option() -> None:
    from freetoken_core.errors import InvalidRequest, ModelLoadError

    with pytest.raises(InvalidRequest, match="activations"):
        LLM(None, activations="int4", progress=False)
    with pytest.raises(ModelLoadError, match="--activations q8"):
        LLM(None, dtype="bfloat16", activations="q8", progress=False)
    with pytest.raises(ModelLoadError, match="--activations int24"):
        LLM(None, dtype="bfloat16", activations="int24", progress=False)


FIRST_STEPS = """
import json
from freetoken_core import LLM, SamplingParams
llm = LLM(None, progress=False, kv_cache_tokens=4096)
params = SamplingParams(temperature=0, max_tokens=6, logprobs=0)
prompts = [[504, 3458, 314], [1205, 253, 2030]]  # shorter than a cache block: never cached
def draws(outs):
    return [[list(o.outputs[0].token_ids), [lp.logprob for lp in o.outputs[0].logprobs]]
            for o in outs]
together = draws(llm.generate(prompts, params))  # the process's first team of threads
alone = [draws(llm.generate([p], params))[0] for p in prompts]
print(json.dumps({"together": together, "alone": alone}))
"""


def test_a_fresh_process_first_steps_compute_what_later_steps_compute() -> None:
    """The first steps of a process run on threads that have just joined the kernels' team:
    ATen told such a thread it was alone (a per-thread count, set on first use), and
    attention split its work by that count, so the two members could split one step's
    queries two ways (two sequences: whole sequences on one, per-KV-head pieces on the
    other) and leave some uncomputed (NaN logits in 2 of 8 fresh runs of a prefill). Work
    splitting inside a team now follows the team's size."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", FIRST_STEPS], check=True, capture_output=True,
                         text=True, timeout=300).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["together"] == result["alone"]
