from __future__ import annotations

import pytest

from freetoken_core.engine.block_manager import BlockManager
from freetoken_core.engine.sequence import Sequence
from freetoken_core.sampling_params import SamplingParams


def make_seq(tokens: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(seq_id, str(seq_id), list(tokens), len(tokens), SamplingParams(), 0, 0, 16)


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    num = bm.allocate(seq, 10_000)
    assert num is not None
    seq.num_computed_tokens += num
    bm.cache_full_blocks(seq)


def test_allocate_append_free_counts() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(list(range(10)))
    assert bm.allocate(seq, 100) == 10
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    seq.num_computed_tokens = 10
    seq.token_ids.append(99)
    assert bm.can_append(seq, 1)
    bm.append(seq, 1)
    assert len(seq.block_table) == 3  # slot 10 still fits in block 2
    seq.num_computed_tokens = 11
    seq.token_ids.extend([1, 2])
    bm.append(seq, 2)
    assert len(seq.block_table) == 4
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == []


def test_allocate_refuses_without_blocks_and_changes_nothing() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq(list(range(12)))
    assert bm.allocate(seq, 100) is None
    assert bm.num_free_blocks == 2 and seq.block_table == [] and seq.num_computed_tokens == 0
    # A chunk that fits is admitted.
    assert bm.allocate(seq, 8) == 8


def test_prefix_is_shared_and_refcounted() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(list(range(10)), 0)
    compute_all(bm, a)
    b = make_seq(list(range(8)) + [50, 51, 52], 1)
    num = bm.allocate(b, 100)
    assert b.num_computed_tokens == 8 and num == 3
    assert b.block_table[:2] == a.block_table[:2]
    bm.free(a)
    # Shared blocks are still held by b.
    assert bm.num_free_blocks == 16 - len(b.block_table)
    bm.free(b)
    assert bm.num_free_blocks == 16


def test_freed_prefix_is_reused_until_evicted() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq(list(range(9)))
    compute_all(bm, a)
    bm.free(a)
    b = make_seq(list(range(9)), 1)
    bm.allocate(b, 100)
    assert b.num_computed_tokens == 8
    bm.free(b)
    # Fill the whole cache with other tokens: the old prefix is evicted.
    c = make_seq([7] * 16, 2)
    compute_all(bm, c)
    bm.free(c)
    d = make_seq(list(range(9)), 3)
    bm.allocate(d, 100)
    assert d.num_computed_tokens == 0


def test_always_leaves_one_token_to_compute() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(list(range(8)))
    compute_all(bm, a)
    b = make_seq(list(range(8)), 1)
    assert bm.allocate(b, 100) == 4
    assert b.num_computed_tokens == 4


def test_prefix_caching_can_be_disabled() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_seq(list(range(9)))
    compute_all(bm, a)
    b = make_seq(list(range(9)), 1)
    bm.allocate(b, 100)
    assert b.num_computed_tokens == 0


def test_invalid_sizes() -> None:
    with pytest.raises(ValueError):
        BlockManager(0, 16)
