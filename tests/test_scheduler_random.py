"""Random schedules: the scheduler and the block manager never spin, never serve wrong KV,
and give every block and slot back.

Pure Python (no model, no tensors). Each case draws an engine configuration (block size,
cache size often not a multiple of it, ``max_num_seqs``, ``max_num_batched_tokens``, prefix
caching on or off), takes its limits from ``compute_limits``, and feeds a random mix of
requests through the same submission check as the engine (``effective_max_tokens``):
prompts with shared prefixes, ``n > 1`` fan-outs, salts, ``max_tokens`` or none, EOS,
``ignore_eos`` and aborts. The model is simulated as ``EngineCore.step`` and
``ModelRunner.execute`` drive it: a sequence samples a token when the step computes its
last token. The simulated KV cache records, for every slot it writes, an id of the whole
(salted) prefix that slot was computed from, and every step checks that each scheduled
sequence reads exactly its own prefix: a prefix-cache hit on the wrong content, a salt
shared across tenants, or a shared block overwritten would all fail here.
"""

from __future__ import annotations

import hashlib
import random
from types import SimpleNamespace

import pytest

from freetoken_core.config import EngineConfig, EngineLimits
from freetoken_core.engine import block_manager
from freetoken_core.engine.block_manager import BlockManager
from freetoken_core.engine.core import effective_max_tokens
from freetoken_core.engine.llm_engine import compute_limits
from freetoken_core.engine.scheduler import Scheduler
from freetoken_core.engine.sequence import Sequence
from freetoken_core.errors import InvalidRequest
from freetoken_core.sampling_params import SamplingParams

VOCAB = 40
EOS = 0
NUM_CASES = 400


def draw_config(rng: random.Random) -> tuple[EngineConfig, EngineLimits]:
    block_size = rng.choice([1, 2, 3, 4, 8, 16])
    config = EngineConfig(
        max_model_len=rng.choice([None, rng.randint(2, 120)]),
        max_num_seqs=rng.randint(1, 6),
        max_num_batched_tokens=rng.randint(1, 48),
        # Often tight (a request can need the whole cache), rarely a multiple of the block.
        kv_cache_tokens=rng.randint(block_size, rng.choice([8, 40]) * block_size + block_size - 1),
        block_size=block_size,
        enable_prefix_caching=rng.random() < 0.75,
    )
    model = SimpleNamespace(max_position_embeddings=rng.randint(2, 140),
                            sliding_window=rng.choice([None, None, rng.randint(2, 140)]),
                            vocab_size=VOCAB)
    return config, compute_limits(config, model, frozenset({EOS}))  # type: ignore[arg-type]


class SimulatedEngine:
    """The engine core's loop around a ``Scheduler``, with a fake model that checks its KV."""

    def __init__(self, config: EngineConfig, limits: EngineLimits, rng: random.Random) -> None:
        self.rng = rng
        self.limits = limits
        self.block_size = limits.block_size
        self.bm = BlockManager(limits.num_kv_blocks, limits.block_size,
                               config.enable_prefix_caching)
        self.scheduler = Scheduler(self.bm, config.max_num_seqs,
                                   config.max_num_batched_tokens)
        self.requests: dict[str, list[Sequence]] = {}
        self.all_seqs: list[Sequence] = []
        self.num_refused = 0
        self.num_steps = 0
        self._ids = 0
        # kv[block][offset]: id of the salted prefix whose last token that slot holds.
        self.kv: list[list[int | None]] = [[None] * self.block_size
                                           for _ in range(limits.num_kv_blocks)]
        self._prefix_ids: dict[tuple[object, int], int] = {}
        self._expected: dict[int, list[int]] = {}

    def submit(self, prompt: list[int], params: SamplingParams) -> bool:
        """Add a request as ``EngineCore.add_request`` does; False when it is refused."""
        try:
            max_tokens = effective_max_tokens(len(prompt), params, self.limits.max_model_len)
        except InvalidRequest:
            self.num_refused += 1
            return False
        request_id = f"r{self._ids}"
        self._ids += 1
        seqs = [Sequence(len(self.all_seqs) + i, request_id, list(prompt), len(prompt), params,
                         0, self._ids, max_tokens, index=i) for i in range(params.n)]
        self.requests[request_id] = seqs
        self.all_seqs.extend(seqs)
        for seq in seqs:
            self.scheduler.add(seq)
        return True

    def abort_random(self) -> None:
        if self.requests:
            request_id = self.rng.choice(sorted(self.requests))
            for seq in self.requests.pop(request_id):
                self.scheduler.finish(seq, "abort")

    def expected(self, seq: Sequence) -> list[int]:
        ids = self._expected.setdefault(seq.seq_id, [])
        parent: object = ids[-1] if ids else ("root", seq.params.cache_salt)
        for token in seq.token_ids[len(ids):]:
            parent = self._prefix_ids.setdefault((parent, token), len(self._prefix_ids))
            ids.append(parent)  # type: ignore[arg-type]
        return ids

    def step(self) -> None:
        """``EngineCore.step``: schedule, run the fake model, advance, sample, stop."""
        self.num_steps += 1
        batch = self.scheduler.schedule()
        sampled = []
        for seq, num in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            assert num >= 1 and start + num <= seq.num_tokens
            expected = self.expected(seq)
            bs = self.block_size
            assert len(seq.block_table) >= -(-(start + num) // bs)
            # Attention reads every earlier slot: they must hold this sequence's prefix.
            read = [self.kv[seq.block_table[p // bs]][p % bs] for p in range(start)]
            assert read == expected[:start], f"seq {seq.seq_id} reads another prefix's KV"
            for p in range(start, start + num):
                self.kv[seq.block_table[p // bs]][p % bs] = expected[p]
            if start + num == seq.num_tokens:
                sampled.append(seq)
        self.scheduler.advance(batch)
        for seq in sampled:
            token = EOS if self.rng.random() < 0.04 else self.rng.randrange(1, VOCAB)
            seq.token_ids.append(token)
            if not seq.params.ignore_eos and token == EOS:
                self.scheduler.finish(seq, "stop")
            elif seq.num_output_tokens >= seq.max_tokens:
                self.scheduler.finish(seq, "length")
            if all(s.is_finished for s in self.requests.get(seq.request_id, [])):
                self.requests.pop(seq.request_id, None)


def draw_params(rng: random.Random, max_model_len: int) -> SamplingParams:
    return SamplingParams(
        n=rng.choice([1, 1, 1, 2, 3]),
        max_tokens=rng.choice([None, rng.randint(1, 12), rng.randint(1, max_model_len)]),
        ignore_eos=rng.random() < 0.3,
        cache_salt=rng.choice([None, None, "tenant-a", "tenant-b"]),
    )


def run_case(seed: int) -> None:
    rng = random.Random(seed)
    config, limits = draw_config(rng)
    assert limits.max_model_len <= limits.num_kv_blocks * limits.block_size
    engine = SimulatedEngine(config, limits, rng)
    max_len = limits.max_model_len
    stems = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, max_len))] for _ in range(3)]
    arrivals = sorted(rng.randrange(30) for _ in range(rng.randint(1, 14)))
    last_arrival = arrivals[-1]
    budget = last_arrival + 1  # steps allowed: grows by each accepted sequence's length
    while arrivals or engine.scheduler.has_unfinished:
        while arrivals and arrivals[0] <= engine.num_steps:
            arrivals.pop(0)
            stem = rng.choice(stems)
            length = rng.randint(1, min(max_len, rng.choice([8, 40, max_len])) + 1)
            prompt = stem[:rng.randint(0, min(len(stem), length))]
            prompt += [rng.randrange(1, VOCAB) for _ in range(length - len(prompt))]
            params = draw_params(rng, max_len)
            if engine.submit(prompt, params):
                seq = engine.requests[f"r{engine._ids - 1}"][0]
                budget += params.n * (seq.num_prompt_tokens + seq.max_tokens)
        if rng.random() < 0.03:
            engine.abort_random()
        engine.step()
        assert engine.num_steps <= budget, f"case {seed}: the scheduler spins ({config})"

    assert not engine.requests
    for seq in engine.all_seqs:
        assert seq.is_finished and seq.block_table == [] and seq.slot is None
        assert seq.num_tokens <= limits.max_model_len
        if seq.finish_reason == "length":
            assert seq.num_output_tokens == seq.max_tokens
        else:
            assert seq.finish_reason in ("stop", "abort")
    assert engine.bm.num_used_blocks == 0 and engine.bm.num_free_blocks == limits.num_kv_blocks
    assert engine.scheduler.num_free_slots == config.max_num_seqs
    # Nothing is left in flight for a later request to wait on.
    assert engine.bm.num_blocks_in_flight == 0
    assert not engine.scheduler.running and not engine.scheduler.waiting


def _prefix_blind_digest(parent: bytes, tokens: bytes) -> bytes:
    return hashlib.sha256(tokens).digest()


def _tiny_digest(parent: bytes, tokens: bytes) -> bytes:
    return bytes([(sum(parent) + sum(tokens)) % 3])


@pytest.mark.parametrize("digest", ["sha256", "prefix_blind", "three_values"])
def test_random_schedules_finish_and_free_everything(
        digest: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the real digest and with digests that collide all the time, every accepted
    request finishes within a bounded number of steps, each step reads only its own KV,
    and the cache and the slots end empty."""
    if digest == "prefix_blind":
        monkeypatch.setattr(block_manager, "_digest", _prefix_blind_digest)
    elif digest == "three_values":
        monkeypatch.setattr(block_manager, "_digest", _tiny_digest)
    for case in range(NUM_CASES):
        run_case(1000 * len(digest) + case)


def test_the_random_mix_exercises_what_it_claims() -> None:
    """The cases above are not vacuous: they preempt, hit the prefix cache, refuse requests
    and finish requests by length, stop and abort."""
    totals = {"preemptions": 0, "cached": 0, "refused": 0}
    reasons: set[str | None] = set()
    for case in range(NUM_CASES // 2):
        rng = random.Random(case)
        config, limits = draw_config(rng)
        engine = SimulatedEngine(config, limits, rng)
        prompt = [rng.randrange(1, VOCAB) for _ in range(40)]
        for i in range(6):
            engine.submit(prompt[:rng.randint(1, 40)], draw_params(rng, limits.max_model_len))
            if i == 3:
                engine.abort_random()
            for _ in range(5):
                engine.step()
        while engine.scheduler.has_unfinished:
            engine.step()
        totals["preemptions"] += engine.scheduler.num_preemptions
        totals["cached"] += sum(s.num_cached_tokens for s in engine.all_seqs)
        totals["refused"] += engine.num_refused
        reasons.update(s.finish_reason for s in engine.all_seqs)
    assert all(totals.values()), totals
    assert reasons == {"stop", "length", "abort"}


def test_cache_not_a_multiple_of_the_block_size_caps_the_context() -> None:
    """100 tokens of cache in blocks of 16 hold 96 slots: a 90 + 10 request is refused at
    submission instead of preempting itself forever."""
    config = EngineConfig(kv_cache_tokens=100, block_size=16)
    model = SimpleNamespace(max_position_embeddings=4096, sliding_window=None,
                            vocab_size=VOCAB)
    limits = compute_limits(config, model, frozenset({EOS}))  # type: ignore[arg-type]
    assert limits.num_kv_blocks == 6 and limits.max_model_len == 96
    engine = SimulatedEngine(config, limits, random.Random(0))
    assert not engine.submit([1] * 90, SamplingParams(max_tokens=10, ignore_eos=True))
    assert engine.submit([1] * 90, SamplingParams(max_tokens=6, ignore_eos=True))
    assert engine.submit([2] * 90, SamplingParams(max_tokens=None, ignore_eos=True))
    for _ in range(200):
        if not engine.scheduler.has_unfinished:
            break
        engine.step()
    assert not engine.scheduler.has_unfinished
    assert [s.finish_reason for s in engine.all_seqs] == ["length", "length"]
    assert engine.bm.num_used_blocks == 0
