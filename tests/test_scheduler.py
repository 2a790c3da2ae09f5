from __future__ import annotations

import pytest

from freetoken_core.engine.block_manager import BlockManager
from freetoken_core.engine.scheduler import Scheduler
from freetoken_core.engine.sequence import Sequence, SequenceStatus
from freetoken_core.sampling_params import SamplingParams


def make_seq(seq_id: int, num_tokens: int, max_tokens: int = 64) -> Sequence:
    tokens = [seq_id * 1000 + i for i in range(num_tokens)]
    return Sequence(seq_id, str(seq_id), tokens, num_tokens, SamplingParams(), 0, seq_id,
                    max_tokens)


def run_step(sched: Scheduler) -> dict[int, int]:
    """Schedule, pretend the model ran, append one token to sequences that sampled."""
    batch = sched.schedule()
    sched.advance(batch)
    for seq in batch.seqs:
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(1)
    return {s.seq_id: n for s, n in zip(batch.seqs, batch.num_new_tokens)}


def test_chunked_prefill_respects_budget() -> None:
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    sched.add(make_seq(0, 25))
    assert run_step(sched) == {0: 10}
    assert run_step(sched) == {0: 10}
    assert run_step(sched) == {0: 5}
    assert run_step(sched) == {0: 1}  # decoding now


def test_new_requests_join_running_batch() -> None:
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=16)
    sched.add(make_seq(0, 5))
    assert run_step(sched) == {0: 5}
    sched.add(make_seq(1, 7))
    assert run_step(sched) == {0: 1, 1: 7}
    assert run_step(sched) == {0: 1, 1: 1}


def test_max_num_seqs_limits_running() -> None:
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        sched.add(make_seq(i, 3))
    assert set(run_step(sched)) == {0, 1}
    sched.finish(sched.running[0], "stop")
    assert set(run_step(sched)) == {1, 2}


def test_preempts_latest_when_blocks_run_out() -> None:
    # 4 blocks of 4 slots: two sequences of 7 tokens fill 4 blocks; the next decode of
    # the first needs a 5th block, so the latest (seq 1) is preempted.
    sched = Scheduler(BlockManager(4, 4), max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make_seq(0, 7, max_tokens=8), make_seq(1, 7, max_tokens=8)
    sched.add(a)
    sched.add(b)
    assert run_step(sched) == {0: 7, 1: 7}
    assert run_step(sched) == {0: 1, 1: 1}  # both reach 8 tokens: still 2 blocks each
    assert run_step(sched) == {0: 1}
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert b.block_table == [] and sched.num_preemptions == 1
    assert list(sched.waiting) == [b]
    sched.finish(a, "stop")
    assert run_step(sched)[1] >= 1
    assert b.status is SequenceStatus.RUNNING


def test_finish_frees_blocks_wherever_the_sequence_is() -> None:
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make_seq(0, 6, max_tokens=8), make_seq(1, 6, max_tokens=8)
    sched.add(a)
    run_step(sched)
    sched.add(b)
    sched.finish(b, "abort")
    sched.finish(a, "abort")
    assert bm.num_free_blocks == 16 and not sched.has_unfinished
    assert a.finish_reason == "abort"


def test_refuses_a_sequence_that_can_never_fit() -> None:
    """4 blocks of 4 hold 16 slots: 10 + 7 tokens need 16 (the last is never computed) and
    are queued; 10 + 8 would need 17 and preempt themselves forever, so ``add`` refuses."""
    sched = Scheduler(BlockManager(4, 4), max_num_seqs=2, max_num_batched_tokens=100)
    sched.add(make_seq(0, 10, max_tokens=7))
    with pytest.raises(ValueError, match="needs 17 KV slots but the cache has 16"):
        sched.add(make_seq(1, 10, max_tokens=8))
    assert len(sched.waiting) == 1


def test_a_sequence_that_fills_the_whole_cache_finishes() -> None:
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=3)
    seq = make_seq(0, 10, max_tokens=7)
    sched.add(seq)
    for _ in range(20):
        run_step(sched)
        if seq.num_output_tokens == seq.max_tokens:
            sched.finish(seq, "length")
            break
    assert seq.is_finished and bm.num_used_blocks == 0 and sched.num_free_slots == 2
    assert sched.num_preemptions == 0


def test_a_shared_prompt_prefix_is_computed_once_for_sequences_that_arrive_together() -> None:
    """Two prompts with the same 8 leading tokens (2 blocks) arrive in one step: the second
    waits one step and takes both blocks from the prefix cache, while an unrelated sequence
    behind it starts at once."""
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    shared = list(range(500, 508))
    a = make_seq(0, 11)
    a.token_ids[:8] = shared
    b = make_seq(1, 10)
    b.token_ids[:8] = shared
    c = make_seq(2, 5)
    for seq in (a, b, c):
        sched.add(seq)
    assert run_step(sched) == {0: 11, 2: 5}
    assert list(sched.waiting) == [b]
    assert run_step(sched) == {0: 1, 2: 1, 1: 2}
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]


def test_sequences_held_for_a_shared_prefix_are_looked_at_at_most_max_num_seqs_a_step() -> None:
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_num_seqs=3, max_num_batched_tokens=100)
    shared = list(range(500, 508))
    seqs = [make_seq(i, 10) for i in range(4)]
    for seq in seqs:
        seq.token_ids[:8] = shared
    late = make_seq(9, 5)  # shares nothing, but queued behind three held sequences
    for seq in [*seqs, late]:
        sched.add(seq)
    assert run_step(sched) == {0: 10}
    assert list(sched.waiting) == [*seqs[1:], late]
    assert run_step(sched) == {0: 1, 1: 2, 2: 2}  # two seats left: both from the cache
