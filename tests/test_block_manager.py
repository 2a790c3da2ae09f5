from __future__ import annotations

import hashlib
import random

import pytest

from freetoken_core.engine import block_manager
from freetoken_core.engine.block_manager import BlockManager
from freetoken_core.engine.sequence import Sequence
from freetoken_core.sampling_params import SamplingParams


def make_seq(tokens: list[int], seq_id: int = 0, salt: str | None = None) -> Sequence:
    return Sequence(seq_id, str(seq_id), list(tokens), len(tokens),
                    SamplingParams(cache_salt=salt), 0, 0, 16)


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


# -- keys: collision-safe, salted ------------------------------------------------------


def test_keys_are_sha256_chains_over_packed_tokens() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    seq = make_seq([1, 2, 3, 4, 5])
    compute_all(bm, seq)
    first = hashlib.sha256(bytes(32) + (1).to_bytes(8, "little") + (2).to_bytes(8, "little"))
    second = hashlib.sha256(first.digest() + (3).to_bytes(8, "little")
                            + (4).to_bytes(8, "little"))
    assert [k.digest for k in seq.block_keys] == [first.digest(), second.digest()]


def test_a_constant_digest_never_shares_another_prompts_blocks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block collides: a hit still needs the same tokens after the same verified
    parent, so another prompt misses, and the colliding digest passes to the newest."""
    monkeypatch.setattr(block_manager, "_digest", lambda parent, tokens: b"same")
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq([1, 2, 3, 4, 9], 0)
    compute_all(bm, a)
    b = make_seq([5, 6, 7, 8, 9], 1)
    assert bm.allocate(b, 100) == 5 and b.num_computed_tokens == 0
    b.num_computed_tokens = 5
    bm.cache_full_blocks(b)
    c = make_seq([5, 6, 7, 8, 10], 2)
    bm.allocate(c, 100)
    assert c.num_computed_tokens == 4 and c.block_table[0] == b.block_table[0]
    d = make_seq([1, 2, 3, 4, 10], 3)
    bm.allocate(d, 100)
    assert d.num_computed_tokens == 0


def test_a_digest_blind_to_the_prefix_cannot_serve_a_block_after_another_prefix(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks with equal tokens after different prefixes hold different KV. With a digest
    that ignores the parent they collide; the parent check keeps them apart."""
    monkeypatch.setattr(block_manager, "_digest",
                        lambda parent, tokens: hashlib.sha256(tokens).digest())
    bm = BlockManager(num_blocks=16, block_size=2)
    a = make_seq([1, 1, 7, 7, 0], 0)  # 7 7 after 1 1
    compute_all(bm, a)
    c = make_seq([2, 2, 3, 3, 0], 1)  # caches the block 2 2
    compute_all(bm, c)
    b = make_seq([2, 2, 7, 7, 0], 2)  # 7 7 after 2 2: only the first block is shared
    bm.allocate(b, 100)
    assert b.num_computed_tokens == 2 and b.block_table[0] == c.block_table[0]
    assert b.block_table[1] != a.block_table[1]


def _colliding_digest(parent: bytes, tokens: bytes) -> bytes:
    return bytes([(sum(parent) + sum(tokens)) % 2])


@pytest.mark.parametrize("digest", [None, _colliding_digest])
def test_every_hit_holds_exactly_the_sequences_prefix(
        digest: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random prompts over 2 tokens share prefixes and, with a 1-bit digest, collide all
    the time; the KV each block was computed from is tracked and every hit is checked."""
    if digest is not None:
        monkeypatch.setattr(block_manager, "_digest", digest)
    rng = random.Random(5)
    bm = BlockManager(num_blocks=24, block_size=2)
    computed_from: dict[int, tuple[str | None, tuple[int, ...]]] = {}
    live: list[Sequence] = []
    num_hits = 0
    for i in range(400):
        salt = rng.choice([None, "x"])
        seq = make_seq([rng.randrange(2) for _ in range(rng.randint(3, 9))], i, salt)
        if bm.allocate(seq, 100) is None:
            bm.free(live.pop(0))
            continue
        for j, block in enumerate(seq.block_table[:seq.num_computed_tokens // 2]):
            assert computed_from[block] == (salt, tuple(seq.token_ids[:2 * (j + 1)]))
            num_hits += 1
        for j in range(seq.num_computed_tokens // 2, len(seq.block_table)):
            computed_from[seq.block_table[j]] = (salt, tuple(seq.token_ids[:2 * (j + 1)]))
        seq.num_computed_tokens = seq.num_tokens
        bm.cache_full_blocks(seq)
        live.append(seq)
        if len(live) > 3:
            bm.free(live.pop(rng.randrange(len(live))))
    # A 1-bit digest leaves two index entries: few hits, but each one checked.
    assert num_hits > (100 if digest is None else 10)


def test_salts_keep_prefixes_apart() -> None:
    bm = BlockManager(num_blocks=32, block_size=4)
    prompt = list(range(9))
    compute_all(bm, make_seq(prompt, 0, salt="tenant-a"))
    for i, salt in enumerate([None, "tenant-b", "tenant-a "], 1):
        other = make_seq(prompt, i, salt)
        bm.allocate(other, 100)
        assert other.num_computed_tokens == 0, salt
    same = make_seq(prompt, 9, salt="tenant-a")
    bm.allocate(same, 100)
    assert same.num_computed_tokens == 8


def test_requests_without_a_salt_share() -> None:
    bm = BlockManager(num_blocks=32, block_size=4)
    compute_all(bm, make_seq(list(range(9)), 0))
    b = make_seq(list(range(9)), 1)
    bm.allocate(b, 100)
    assert b.num_computed_tokens == 8
    salted = make_seq(list(range(9)), 2, salt="s")
    bm.allocate(salted, 100)
    assert salted.num_computed_tokens == 0


def test_a_salt_that_is_not_valid_utf8_still_keys() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    compute_all(bm, make_seq([1, 2, 3], 0, salt="\ud800"))
    b = make_seq([1, 2, 3], 1, salt="\ud800")
    bm.allocate(b, 100)
    assert b.num_computed_tokens == 2


def test_a_prefix_in_flight_is_known_until_it_is_keyed_or_freed() -> None:
    bm = BlockManager(num_blocks=32, block_size=4)
    a = make_seq(list(range(14)), 0)
    assert bm.allocate(a, 6) == 6  # chunked: blocks 0-1 of 3 full ones computed this step
    sharing = make_seq(list(range(10)) + [70, 71], 1)  # shares blocks 0 and 1, not 2
    late = make_seq(list(range(8)) + [80] * 6, 2)  # shares blocks 0 and 1 only
    other = make_seq([90] + list(range(1, 14)), 3)
    salted = make_seq(list(range(14)), 4, salt="s")
    assert bm.waits_for_prefix(sharing) and bm.waits_for_prefix(late)
    assert not bm.waits_for_prefix(other) and not bm.waits_for_prefix(salted)
    a.num_computed_tokens = 6
    bm.cache_full_blocks(a)  # block 0 keyed, block 1 (tokens 4-7) still in flight
    assert bm.waits_for_prefix(sharing) and bm.waits_for_prefix(late)
    bm.append(a, 8)
    a.num_computed_tokens = 14
    bm.cache_full_blocks(a)  # blocks 0-2 keyed: nothing in flight
    assert not bm.waits_for_prefix(sharing) and not bm.waits_for_prefix(late)
    assert bm.allocate(sharing, 100) == 4 and sharing.num_computed_tokens == 8
    # Freed before its blocks were keyed: nothing is in flight any more.
    b = make_seq([5] * 9, 5)
    bm.allocate(b, 100)
    assert bm.waits_for_prefix(make_seq([5] * 6, 6))
    bm.free(b)
    assert not bm.waits_for_prefix(make_seq([5] * 6, 6))


def test_nothing_is_in_flight_without_the_prefix_cache() -> None:
    bm = BlockManager(num_blocks=32, block_size=4, enable_prefix_caching=False)
    bm.allocate(make_seq(list(range(9)), 0), 100)
    assert not bm.waits_for_prefix(make_seq(list(range(9)), 1))
