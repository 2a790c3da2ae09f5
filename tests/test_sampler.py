"""The sampler on random logits: greedy, temperature, top-k, top-p, seeded draws, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from freetoken_core.engine.sampler import Sampler, SamplingBatch, counter_uniform
from freetoken_core.engine.sequence import Sequence
from freetoken_core.kernels import cpu_kernels_available
from freetoken_core.sampling_params import SamplingParams

CPU = torch.device("cpu")
_M64 = (1 << 64) - 1


@pytest.fixture(autouse=True, params=["native", "torch"])
def draw_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test on both draws: the native kernel (CPU float32) and the torch operators."""
    if request.param == "torch":
        monkeypatch.setattr(Sampler, "_native_draw", staticmethod(lambda logits: False))
    elif not cpu_kernels_available():
        pytest.skip("native CPU kernels unavailable")
    return request.param


def make_seq(params: SamplingParams, seed: int = 0, counter: int = 0, seq_id: int = 0
             ) -> Sequence:
    """A sequence with a 3-token prompt and ``counter`` generated tokens."""
    tokens = [1, 2, 3] + [4] * counter
    return Sequence(seq_id, str(seq_id), tokens, 3, params, seed, 0, 16)


def batch_of(params: list[SamplingParams], seeds: list[int] | None = None,
             counters: list[int] | None = None) -> SamplingBatch:
    seeds = seeds if seeds is not None else [0] * len(params)
    counters = counters if counters is not None else [0] * len(params)
    seqs = [make_seq(p, s, c, i) for i, (p, s, c) in enumerate(zip(params, seeds, counters))]
    return SamplingBatch.from_seqs(seqs, CPU)


def random_logits(rows: int, vocab: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g, dtype=torch.float32) * scale


def draws(row: torch.Tensor, params: SamplingParams, num: int, seed_base: int = 0
          ) -> torch.Tensor:
    """``num`` draws of one logits row: one batch row per seed (counters vary too)."""
    logits = row.unsqueeze(0).expand(num, -1).contiguous()
    batch = batch_of([params] * num, seeds=[seed_base + i for i in range(num)],
                     counters=[i % 7 for i in range(num)])
    return torch.tensor(Sampler()(logits, batch).token_ids)


def assert_matches(samples: torch.Tensor, probs: torch.Tensor) -> None:
    """Empirical frequencies of ``samples`` match ``probs`` (per token and by chi-square)."""
    n = samples.numel()
    probs = probs.double()
    freq = torch.bincount(samples, minlength=probs.numel()).double() / n
    sigma = (probs * (1 - probs) / n).sqrt()
    worst = ((freq - probs).abs() - 5 * sigma).max().item()
    assert worst < 1e-3, f"frequency off by more than 5 sigma: {worst}"
    support = probs > 0
    assert (freq[~support] == 0).all(), "drew a token of probability 0"
    chi2 = (((freq - probs)[support] ** 2) / probs[support]).sum().item() * n
    dof = int(support.sum()) - 1
    # Mean dof, sd sqrt(2 dof); 6 sd is far beyond chance for these fixed seeds.
    assert chi2 < dof + 6 * math.sqrt(2 * dof), f"chi2 {chi2:.1f} with {dof} dof"


def nucleus(row: torch.Tensor, top_p: float, temperature: float = 1.0) -> set[int]:
    """Smallest set of most likely tokens whose probability reaches ``top_p``."""
    probs = (row.double() / temperature).softmax(-1)
    ordered, order = probs.sort(descending=True)
    before = ordered.cumsum(-1) - ordered  # mass of the more likely tokens
    return set(order[before < top_p].tolist())


# --------------------------------------------------------------------------- greedy


def test_all_greedy_batch_is_argmax() -> None:
    logits = random_logits(32, 120, seed=1)
    batch = batch_of([SamplingParams(temperature=0)] * 32, seeds=list(range(32)))
    assert batch.all_greedy and batch.filter_rows is None
    out = Sampler()(logits, batch)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 32


def test_greedy_rows_in_mixed_batch_are_argmax() -> None:
    logits = random_logits(24, 80, seed=2, scale=0.3)  # flat: sampling rarely hits argmax
    params = [SamplingParams(temperature=0) if i % 3 == 0 else
              SamplingParams(temperature=1.5, top_p=0.9 if i % 3 == 1 else 1.0, top_k=-1)
              for i in range(24)]
    batch = batch_of(params, seeds=list(range(100, 124)), counters=list(range(24)))
    assert not batch.all_greedy
    tokens = Sampler()(logits, batch).token_ids
    argmax = logits.argmax(-1).tolist()
    for i in range(0, 24, 3):
        assert tokens[i] == argmax[i]
    # The sampled rows really sample: they are not all the argmax.
    assert sum(tokens[i] != argmax[i] for i in range(24) if i % 3) >= 4


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.0, top_p=1e-6),
    SamplingParams(temperature=2.0, top_k=1, top_p=0.3),
    SamplingParams(temperature=1.0, top_k=1, top_p=1.0),
], ids=["top_k=1", "tiny-top_p", "top_k=1,T=2", "top_k=1,top_p=1"])
def test_degenerate_filters_give_argmax(params: SamplingParams) -> None:
    logits = random_logits(64, 150, seed=3, scale=0.5)
    batch = batch_of([params] * 64, seeds=list(range(64)), counters=list(range(64)))
    assert batch.filter_rows is not None and batch.filter_rows.tolist() == list(range(64))
    assert Sampler()(logits, batch).token_ids == logits.argmax(-1).tolist()


# --------------------------------------------------------------------------- top-k / top-p


@pytest.mark.parametrize("k", [2, 5, 17])
def test_top_k_draws_stay_in_top_k_and_follow_renormalised_softmax(k: int) -> None:
    row = random_logits(1, 60, seed=10 + k, scale=1.0)[0]
    samples = draws(row, SamplingParams(temperature=1.0, top_k=k), 8000)
    top = set(row.topk(k).indices.tolist())
    assert set(samples.tolist()) == top  # within the set, and every member gets drawn
    probs = torch.zeros_like(row, dtype=torch.float64)
    idx = torch.tensor(sorted(top))
    probs[idx] = row[idx].double().softmax(-1)
    assert_matches(samples, probs)


@pytest.mark.parametrize("p", [0.3, 0.6, 0.9])
def test_top_p_draws_stay_in_nucleus_and_follow_renormalised_softmax(p: float) -> None:
    row = random_logits(1, 100, seed=20 + int(p * 10), scale=1.5)[0]
    kept = nucleus(row, p)
    assert 1 < len(kept) < 100
    samples = draws(row, SamplingParams(temperature=1.0, top_p=p), 8000)
    assert set(samples.tolist()) <= kept
    idx = torch.tensor(sorted(kept))
    probs = torch.zeros_like(row, dtype=torch.float64)
    probs[idx] = row[idx].double().softmax(-1)
    assert_matches(samples, probs)


@pytest.mark.parametrize(("p", "kept"), [(0.5, {0}), (0.75, {0, 1}), (0.76, {0, 1, 2}),
                                         (0.875, {0, 1, 2}), (0.9, {0, 1, 2, 3, 4})])
def test_top_p_mass_exactly_reaching_p_is_enough(p: float, kept: set[int]) -> None:
    """Probabilities that are exact in float32: the nucleus stops as soon as its mass is p."""
    row = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625]).log()
    assert row.softmax(-1).tolist() == [0.5, 0.25, 0.125, 0.0625, 0.0625]
    samples = draws(row, SamplingParams(temperature=1.0, top_p=p), 2000)
    assert set(samples.tolist()) == kept


def test_top_p_nucleus_is_taken_after_temperature() -> None:
    row = random_logits(1, 100, seed=31, scale=1.0)[0]
    kept = nucleus(row, 0.5, temperature=0.5)
    samples = draws(row, SamplingParams(temperature=0.5, top_p=0.5), 4000)
    assert set(samples.tolist()) <= kept
    assert len(set(samples.tolist())) > 1


def test_top_k_and_top_p_together_keep_the_smaller_set() -> None:
    row = random_logits(1, 100, seed=32, scale=1.5)[0]
    kept_p = nucleus(row, 0.9)
    assert len(kept_p) > 4
    top4 = set(row.topk(4).indices.tolist())
    samples = draws(row, SamplingParams(temperature=1.0, top_k=4, top_p=0.9), 3000)
    assert set(samples.tolist()) == top4
    small_p = nucleus(row, 0.2)
    assert len(small_p) < 30
    samples = draws(row, SamplingParams(temperature=1.0, top_k=30, top_p=0.2), 3000)
    assert set(samples.tolist()) <= small_p


def test_filters_on_every_row_of_a_large_vocab_batch() -> None:
    vocab, rows = 49152, 16
    logits = random_logits(rows, vocab, seed=40, scale=3.0)
    params = []
    for i in range(rows):
        kind = i % 4
        params.append([SamplingParams(temperature=0),
                       SamplingParams(temperature=1.0, top_k=1 + i),
                       SamplingParams(temperature=0.8, top_p=0.05 + 0.01 * i),
                       SamplingParams(temperature=1.0)][kind])
    sampler = Sampler()
    argmax = logits.argmax(-1).tolist()
    topk_sets = [set(logits[i].topk(1 + i).indices.tolist()) for i in range(rows)]
    nuclei = {i: nucleus(logits[i], 0.05 + 0.01 * i, temperature=0.8)
              for i in range(2, rows, 4)}
    seen: dict[int, set[int]] = {i: set() for i in range(rows)}
    for counter in range(10):
        batch = batch_of(params, seeds=[7 * i + 1 for i in range(rows)], counters=[counter] * rows)
        tokens = sampler(logits, batch).token_ids
        for i, tok in enumerate(tokens):
            assert 0 <= tok < vocab
            seen[i].add(tok)
            if i % 4 == 0:
                assert tok == argmax[i]
            elif i % 4 == 1:
                assert tok in topk_sets[i]
            elif i % 4 == 2:
                assert tok in nuclei[i]
    # Unfiltered rows over a 49k vocabulary draw (almost) a new token every time.
    assert all(len(seen[i]) >= 6 for i in range(3, rows, 4))
    assert all(len(seen[i]) >= 2 for i in range(5, rows, 4))  # top_k >= 6


# --------------------------------------------------------------------------- distribution


def test_unfiltered_draws_follow_softmax_at_temperature_1() -> None:
    row = random_logits(1, 50, seed=50, scale=1.5)[0]
    probs = row.double().softmax(-1)
    samples = draws(row, SamplingParams(temperature=1.0), 20000)
    assert_matches(samples, probs)


def test_unfiltered_draws_follow_tempered_softmax_at_temperature_half() -> None:
    row = random_logits(1, 64, seed=51, scale=1.0)[0]
    tempered = (row.double() / 0.5).softmax(-1)
    samples = draws(row, SamplingParams(temperature=0.5), 20000, seed_base=10**6)
    assert_matches(samples, tempered)
    # The check can tell the temperatures apart: plain softmax would fail it.
    with pytest.raises(AssertionError):
        assert_matches(samples, row.double().softmax(-1))


def test_high_temperature_flattens_the_distribution() -> None:
    row = random_logits(1, 40, seed=52, scale=1.0)[0]
    samples = draws(row, SamplingParams(temperature=2.0), 20000, seed_base=5 * 10**6)
    assert_matches(samples, (row.double() / 2.0).softmax(-1))


def test_draws_do_not_depend_on_the_vocabulary_order() -> None:
    """A permuted row draws the permuted token with the same frequencies."""
    row = random_logits(1, 30, seed=53, scale=1.0)[0]
    perm = torch.randperm(30, generator=torch.Generator().manual_seed(0))
    samples = draws(row[perm], SamplingParams(temperature=1.0), 20000)
    assert_matches(samples, row[perm].double().softmax(-1))


# --------------------------------------------------------------------------- seeds


def test_same_seed_and_counter_give_same_token_whatever_the_batch() -> None:
    vocab = 200
    mixed = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_p=0.8),
             SamplingParams(temperature=1.3, top_k=5), SamplingParams(temperature=1.0),
             SamplingParams(temperature=0.9, top_k=20, top_p=0.5, logprobs=3)]
    others = random_logits(15, vocab, seed=61, scale=1.0)
    sampler = Sampler()
    targets = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_p=0.85),
               SamplingParams(temperature=1.2, top_k=10), SamplingParams(temperature=1.0,
                                                                         top_p=0.95, top_k=40)]
    for t, target in enumerate(targets):
        row = random_logits(1, vocab, seed=70 + t, scale=0.5)
        for seed, counter in [(0, 0), (1, 0), (12345, 3), (2**62 + 5, 17), (2**63 - 1, 1000)]:
            alone = sampler(row, batch_of([target], [seed], [counter])).token_ids[0]
            for pos in (0, 7, 15):
                params = [mixed[i % len(mixed)] for i in range(15)]
                params.insert(pos, target)
                seeds = list(range(1000, 1015))
                seeds.insert(pos, seed)
                counters = [3 * i for i in range(15)]
                counters.insert(pos, counter)
                logits = torch.cat([others[:pos], row, others[pos:]])
                batch = batch_of(params, seeds, counters)
                assert batch.filter_rows is not None
                assert sampler(logits, batch).token_ids[pos] == alone, (t, seed, counter, pos)


def test_draws_change_with_seed_and_counter() -> None:
    row = random_logits(1, 100, seed=80, scale=0.2)
    sampler = Sampler()
    params = SamplingParams(temperature=1.0)
    by_seed = {sampler(row, batch_of([params], [s], [0])).token_ids[0] for s in range(40)}
    by_counter = {sampler(row, batch_of([params], [9], [c])).token_ids[0] for c in range(40)}
    assert len(by_seed) > 10 and len(by_counter) > 10
    again = [sampler(row, batch_of([params], [s], [0])).token_ids[0] for s in range(40)]
    first = [sampler(row, batch_of([params], [s], [0])).token_ids[0] for s in range(40)]
    assert again == first


def test_counter_is_the_number_of_generated_tokens() -> None:
    params = SamplingParams(temperature=1.0)
    seqs = [make_seq(params, seed=5, counter=c, seq_id=c) for c in (0, 1, 9)]
    batch = SamplingBatch.from_seqs(seqs, CPU)
    assert batch.counters.tolist() == [0, 1, 9]
    assert batch.seeds.tolist() == [5, 5, 5]
    assert batch.counters.dtype == torch.long and batch.seeds.dtype == torch.long


def test_from_seqs_fields() -> None:
    params = [SamplingParams(temperature=0, logprobs=2), SamplingParams(top_k=3),
              SamplingParams(top_p=0.5, logprobs=7), SamplingParams(),
              SamplingParams(temperature=0, top_k=4)]
    batch = batch_of(params)
    assert batch.filter_rows is not None and batch.filter_rows.tolist() == [1, 2]
    assert batch.max_logprobs == 7
    assert batch.num_logprobs == [2, None, 7, None, None]
    assert batch.temperature.tolist() == [0.0, 1.0, 1.0, 1.0, 0.0]
    assert batch.top_k.tolist() == [-1, 3, -1, -1, 4]
    assert not batch.all_greedy
    assert batch_of([SamplingParams()]).filter_rows is None


# --------------------------------------------------------------------------- counter_uniform


def splitmix64(seed: int, counter: int) -> float:
    """Reference: splitmix64 of state seed * golden + counter, top 53 bits as a float."""
    z = (seed * 0x9E3779B97F4A7C15 + counter) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    z = z ^ (z >> 31)
    return (z >> 11) / float(1 << 53)


def test_counter_uniform_matches_reference_splitmix64() -> None:
    pairs = [(0, 0), (0, 1), (1, 0), (42, 7), (2**63 - 1, 0), (2**63 - 1, 2**40),
             (123456789, 987654321), (2**62, 3)]
    seeds = torch.tensor([s for s, _ in pairs], dtype=torch.long)
    counters = torch.tensor([c for _, c in pairs], dtype=torch.long)
    got = counter_uniform(seeds, counters)
    assert got.dtype == torch.float64
    assert got.tolist() == [splitmix64(s, c) for s, c in pairs]


def test_counter_uniform_range_determinism_and_uniformity() -> None:
    n = 200_000
    seeds = torch.arange(n, dtype=torch.long) // 100 * 7919
    counters = torch.arange(n, dtype=torch.long) % 100
    u = counter_uniform(seeds, counters)
    assert u.shape == (n,)
    assert (u >= 0).all() and (u < 1).all()
    assert torch.equal(u, counter_uniform(seeds.clone(), counters.clone()))
    assert abs(u.mean().item() - 0.5) < 0.005
    assert abs(u.var().item() - 1 / 12) < 0.002
    assert u.unique().numel() == n
    hist = torch.histc(u.float(), bins=20, min=0.0, max=1.0)
    assert ((hist - n / 20).abs() < 0.05 * n / 20).all()
    # Element-wise: a row's value does not depend on its neighbours.
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    assert torch.equal(counter_uniform(seeds[perm], counters[perm]), u[perm])
    # Consecutive counters of one seed are not correlated.
    one = counter_uniform(torch.full((n,), 99, dtype=torch.long), torch.arange(n))
    corr = torch.corrcoef(torch.stack([one[:-1], one[1:]]))[0, 1].item()
    assert abs(corr) < 0.01


# --------------------------------------------------------------------------- logprobs


def test_logprobs_of_sampled_token_and_top_n_per_row() -> None:
    vocab = 90
    logits = random_logits(6, vocab, seed=90, scale=2.0)
    params = [SamplingParams(temperature=0.7, logprobs=5),
              SamplingParams(temperature=1.0),
              SamplingParams(temperature=0, logprobs=0),
              SamplingParams(temperature=1.3, top_k=3, logprobs=20),
              SamplingParams(temperature=0.5, top_p=0.5, logprobs=1),
              SamplingParams(temperature=1.0, logprobs=2)]
    out = Sampler()(logits, batch_of(params, seeds=list(range(6)), counters=[4] * 6))
    raw = logits.double().log_softmax(-1)
    assert out.logprobs[1] is None
    for row, p in enumerate(params):
        lp = out.logprobs[row]
        if p.logprobs is None:
            assert lp is None
            continue
        assert lp is not None
        tok = out.token_ids[row]
        assert lp.token_id == tok
        # The raw model distribution, not the tempered / filtered one.
        assert lp.logprob == pytest.approx(raw[row, tok].item(), abs=1e-5)
        assert len(lp.top) == p.logprobs
        want = raw[row].topk(p.logprobs)
        assert [t for t, _ in lp.top] == want.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(want.values.tolist(), abs=1e-5)
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert all(isinstance(t, int) and isinstance(v, float) for t, v in lp.top)
    assert out.logprobs[2] is not None and out.logprobs[2].top == []
    assert out.logprobs[2].token_id == logits[2].argmax().item()
    assert out.logprobs[2].logprob == pytest.approx(raw[2].max().item(), abs=1e-5)


def test_logprobs_in_an_all_greedy_batch_and_do_not_change_tokens() -> None:
    logits = random_logits(4, 60, seed=91)
    params = [SamplingParams(temperature=0, logprobs=n) for n in (None, 0, 3, 20)]
    out = Sampler()(logits, batch_of(params))
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs[0] is None
    assert [len(lp.top) for lp in out.logprobs[1:]] == [0, 3, 20]  # type: ignore[union-attr]
    top1 = out.logprobs[3].top[0]  # type: ignore[union-attr]
    assert top1[0] == out.token_ids[3]
    assert top1[1] == pytest.approx(out.logprobs[3].logprob)  # type: ignore[union-attr]
    # Asking for logprobs does not change what is drawn, nor the logits it was given.
    mixed = [SamplingParams(temperature=0.9, top_p=0.7, logprobs=n) for n in (None, 1, 5, None)]
    plain = [SamplingParams(temperature=0.9, top_p=0.7)] * 4
    before = logits.clone()
    a = Sampler()(logits, batch_of(mixed, seeds=[1, 2, 3, 4])).token_ids
    assert torch.equal(logits, before)
    b = Sampler()(logits, batch_of(plain, seeds=[1, 2, 3, 4])).token_ids
    assert a == b


def test_logprobs_on_large_vocab() -> None:
    logits = random_logits(3, 49152, seed=92, scale=3.0)
    params = [SamplingParams(temperature=1.0, logprobs=20), SamplingParams(temperature=0),
              SamplingParams(temperature=0.8, top_k=50, logprobs=4)]
    out = Sampler()(logits, batch_of(params, seeds=[3, 4, 5]))
    raw = logits.double().log_softmax(-1)
    for row in (0, 2):
        lp = out.logprobs[row]
        assert lp is not None
        assert lp.logprob == pytest.approx(raw[row, out.token_ids[row]].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == raw[row].topk(len(lp.top)).indices.tolist()
    assert out.logprobs[1] is None
    assert out.token_ids[1] == logits[1].argmax().item()
