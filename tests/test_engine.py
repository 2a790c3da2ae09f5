"""Engine behaviour on a tiny model: continuous batching, prefix cache, preemption, seeds."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from freetoken_core import LLM, InvalidRequest, SamplingParams


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(7, vocab) for _ in range(length)]


def test_continuous_batching_matches_solo_runs(tiny_llm: LLM) -> None:
    rng = random.Random(0)
    vocab = len(tiny_llm.tokenizer)
    lengths = [5, 1500] + [rng.randint(5, 1500) for _ in range(62)]
    requests = [(random_prompt(rng, n, vocab), rng.randint(1, 256)) for n in lengths]
    requests[0] = (requests[0][0], 256)
    requests[1] = (requests[1][0], 1)

    solo = [tiny_llm.generate([p], greedy(m))[0].outputs[0].token_ids for p, m in requests]

    engine = tiny_llm.engine
    results: dict[str, list[int]] = {}
    pending = list(enumerate(requests))
    steps = 0
    while pending or engine.has_unfinished_requests:
        # Submit a few new requests every other step, while earlier ones are running.
        if pending and steps % 2 == 0:
            for _ in range(min(3, len(pending))):
                i, (prompt, max_tokens) = pending.pop(0)
                engine.add_request(f"cb-{i}", prompt, greedy(max_tokens))
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        steps += 1
    assert len(results) == 64
    for i, (_, max_tokens) in enumerate(requests):
        assert len(results[f"cb-{i}"]) == max_tokens
        assert results[f"cb-{i}"] == solo[i], f"request {i} differs from its solo run"


def test_prefix_cache_reports_cached_tokens_and_same_output(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), kv_cache_tokens=8192, progress=False)
    prompt = random_prompt(random.Random(1), 300, len(llm.tokenizer))
    first = llm.generate([prompt], greedy(32))[0]
    second = llm.generate([prompt], greedy(32))[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= 256
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_preemption_with_small_cache_gives_same_tokens(tiny_model_dir: Path) -> None:
    rng = random.Random(2)
    big = LLM(str(tiny_model_dir), kv_cache_tokens=16384, progress=False)
    vocab = len(big.tokenizer)
    prompts = [random_prompt(rng, rng.randint(60, 140), vocab) for _ in range(16)]
    params = [greedy(rng.randint(80, 120)) for _ in prompts]
    demand = sum(len(p) + sp.max_tokens for p, sp in zip(prompts, params))
    expected = [o.outputs[0].token_ids for o in big.generate(prompts, params)]

    small = LLM(str(tiny_model_dir), kv_cache_tokens=demand // 4, max_model_len=256,
                progress=False)
    outs = small.generate(prompts, params)
    assert small.engine.core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert small.engine.core.scheduler.block_manager.num_used_blocks == 0


def test_seed_reproduces_alone_and_in_a_batch(tiny_llm: LLM) -> None:
    prompt = "Once upon a time there was"
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=32, ignore_eos=True)
    alone = tiny_llm.generate([prompt], seeded)[0].outputs[0].token_ids
    rng = random.Random(3)
    others = [f"prompt number {i} " * rng.randint(1, 20) for i in range(16)]
    other_params = [SamplingParams(temperature=rng.choice([0.0, 0.7, 1.0]), max_tokens=40,
                                   top_p=rng.choice([1.0, 0.9]), ignore_eos=True)
                    for _ in others]
    outs = tiny_llm.generate(others[:8] + [prompt] + others[8:],
                             other_params[:8] + [seeded] + other_params[8:])
    assert outs[8].outputs[0].token_ids == alone
    # A different seed draws a different continuation.
    other_seed = SamplingParams(temperature=1.0, seed=8, max_tokens=32, ignore_eos=True)
    assert tiny_llm.generate([prompt], other_seed)[0].outputs[0].token_ids != alone


def test_n_choices_share_prompt_and_differ_when_sampling(tiny_llm: LLM) -> None:
    out = tiny_llm.generate("The robot", SamplingParams(n=3, temperature=1.0, seed=1,
                                                        max_tokens=16, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    greedy_out = tiny_llm.generate("The robot", SamplingParams(n=2, temperature=0,
                                                               max_tokens=8))[0]
    assert greedy_out.outputs[0].token_ids == greedy_out.outputs[1].token_ids


def test_eos_stops_unless_ignored(tiny_llm: LLM) -> None:
    eos = tiny_llm.tokenizer.eos_token_id
    # Find a prompt whose greedy continuation hits EOS, by forcing it into the prompt
    # pattern: repeat "... <eos>" so the model has seen it; fall back to checking lengths.
    free = tiny_llm.generate("x", SamplingParams(temperature=0, max_tokens=200))[0].outputs[0]
    if free.finish_reason == "stop":
        assert free.token_ids[-1] == eos and eos not in free.token_ids[:-1]
    else:
        assert free.finish_reason == "length" and eos not in free.token_ids
    forced = tiny_llm.generate("x", SamplingParams(temperature=0, max_tokens=200,
                                                   ignore_eos=True))[0].outputs[0]
    assert len(forced.token_ids) == 200 and forced.finish_reason == "length"


def test_stop_strings_are_cut_or_kept(tiny_llm: LLM) -> None:
    base = tiny_llm.generate("The quick brown", greedy(48))[0].outputs[0].text
    stop = base[20:24]
    assert stop and base.find(stop) == 20
    cut = tiny_llm.generate("The quick brown", SamplingParams(
        temperature=0, max_tokens=48, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert cut.text == base[:20]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = tiny_llm.generate("The quick brown", SamplingParams(
        temperature=0, max_tokens=48, ignore_eos=True, stop=stop,
        include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == base[:24]


def test_logprobs_of_sampled_and_top_tokens(tiny_llm: LLM) -> None:
    out = tiny_llm.generate("Hello", SamplingParams(temperature=0, max_tokens=5, logprobs=3,
                                                    ignore_eos=True))[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 5
    for token_id, entry in zip(out.token_ids, out.logprobs):
        assert entry.token_id == token_id
        assert len(entry.top) == 3
        # Greedy: the sampled token is the most likely one.
        assert entry.top[0][0] == token_id and entry.top[0][1] == pytest.approx(entry.logprob)
        assert entry.top[0][1] >= entry.top[1][1] >= entry.top[2][1]
        assert entry.logprob <= 0


def test_requests_that_cannot_fit_are_refused(tiny_llm: LLM) -> None:
    too_long = [10] * 2048
    with pytest.raises(InvalidRequest) as exc:
        tiny_llm.generate([too_long], greedy(1))
    assert exc.value.param == "prompt" and "2048" in exc.value.message
    with pytest.raises(InvalidRequest) as exc:
        tiny_llm.generate([[10] * 100], greedy(2000))
    assert exc.value.param == "max_tokens"
    with pytest.raises(InvalidRequest) as exc:
        tiny_llm.generate([[]], greedy(1))
    assert exc.value.param == "prompt"
    with pytest.raises(InvalidRequest) as exc:
        tiny_llm.generate([[10**6]], greedy(1))
    assert exc.value.param == "prompt"
    # Nothing was left behind.
    assert not tiny_llm.engine.has_unfinished_requests
    assert tiny_llm.generate("ok", greedy(2))[0].outputs[0].finish_reason == "length"


def test_max_tokens_none_runs_to_the_context_end(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), kv_cache_tokens=4096, max_model_len=64, progress=False)
    out = llm.generate([[10] * 50], SamplingParams(temperature=0, max_tokens=None,
                                                   ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 14 and out.outputs[0].finish_reason == "length"


def test_later_choices_reuse_the_prompt_of_the_first(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), kv_cache_tokens=8192, progress=False)
    prompt = random_prompt(random.Random(5), 100, len(llm.tokenizer))
    out = llm.generate([prompt], SamplingParams(n=3, temperature=0, max_tokens=4,
                                                ignore_eos=True))[0]
    assert out.num_cached_tokens == 96  # 6 full blocks of 16, computed once
    assert len({tuple(c.token_ids) for c in out.outputs}) == 1
