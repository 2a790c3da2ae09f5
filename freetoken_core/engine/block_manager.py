"""Paged KV-cache bookkeeping in pure Python: blocks, reference counts and the prefix cache.

The KV cache is ``num_blocks`` blocks of ``block_size`` token slots. A sequence owns an
ordered block table; slot ``p`` of a sequence lives at
``block_table[p // block_size] * block_size + p % block_size``.

Prefix cache: once a block is full of computed tokens it gets a ``BlockKey``. Its
``digest`` is a SHA-256 chain, ``sha256(parent digest ‖ the block's token ids as
little-endian int64)``, whose root is 32 zero bytes, or a digest of the request's
``cache_salt``; so a digest names the whole salted prefix up to that block, and it indexes
the cache. The index is not trusted: a hit also compares the block's packed tokens, the
salt (first block) and the serial number of the parent key the walk has already verified.
Serials are never reused, so by induction a matched block holds exactly the sequence's
leading tokens, whatever the hash does (a collision costs a cache miss, never another
prompt's KV; vLLM's CVE-2025-25183 was the unverified kind). Requests with different salts
never share blocks; requests without a salt share among themselves.

A later sequence whose leading blocks match shares them (reference count +1). A block whose
count drops to 0 goes to the back of the free queue but keeps its key until it is handed
out again, so recently freed prefixes stay reusable (LRU eviction).

Blocks in flight: from ``allocate`` until they are keyed (or the sequence is freed), the
digests of the full blocks a sequence is about to compute are known too, so the scheduler
can hold back a waiting sequence that shares one of them (``waits_for_prefix``) and serve
it from the cache a step or two later instead of computing the same prefix twice in
parallel (SGLang's in-batch prefix caching): 32 chat requests with one system prompt
arriving together compute it once.
"""

from __future__ import annotations

import hashlib
import itertools
import struct
from collections import OrderedDict

from freetoken_core.engine.sequence import Sequence

_NO_SALT = bytes(32)
_SALT_DOMAIN = b"freetoken cache_salt\x00"


def _digest(parent: bytes, tokens: bytes) -> bytes:
    """The index digest of a block: SHA-256 of its parent's digest and its packed tokens.
    (Tests replace it with a colliding function to show that safety does not rest on it.)"""
    return hashlib.sha256(parent + tokens).digest()


class BlockKey:
    """The verified content of one full block in the prefix cache.

    ``digest`` indexes the cache; ``tokens`` are the block's token ids (packed), ``salt`` the
    request's ``cache_salt`` (first blocks only; ``None`` below), ``parent_serial`` the
    ``serial`` of the key of the block before it (-1 for a first block) and ``block`` the
    physical block that holds the KV. Immutable once made.
    """

    __slots__ = ("block", "digest", "parent_serial", "salt", "serial", "tokens")

    def __init__(self, digest: bytes, tokens: bytes, salt: str | None, serial: int,
                 parent_serial: int, block: int) -> None:
        self.digest = digest
        self.tokens = tokens
        self.salt = salt
        self.serial = serial
        self.parent_serial = parent_serial
        self.block = block

    def holds(self, parent: BlockKey | None, tokens: bytes, salt: str | None) -> bool:
        """Whether this key's block is the one after ``parent`` with these tokens."""
        if self.tokens != tokens:
            return False
        if parent is None:
            return self.parent_serial == -1 and self.salt == salt
        return self.parent_serial == parent.serial


class BlockManager:
    """Allocates and frees KV blocks for sequences; knows nothing about tensors."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._block_key: list[BlockKey | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, BlockKey] = {}
        self._serials = itertools.count()
        self._pack = struct.Struct(f"<{block_size}q").pack
        # Blocks in flight: digest -> how many sequences compute it now, and for each such
        # sequence (by seq_id) its (block index, digest) pairs not yet keyed, in order.
        self._computing: dict[bytes, int] = {}
        self._in_flight: dict[int, list[tuple[int, bytes]]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_blocks_in_flight(self) -> int:
        """Distinct blocks that running sequences are computing and have not keyed yet."""
        return len(self._computing)

    @property
    def num_slots(self) -> int:
        """Token slots in the whole cache: the longest sequence that can ever run."""
        return self.num_blocks * self.block_size

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------

    def _packed(self, seq: Sequence, index: int) -> bytes:
        bs = self.block_size
        return self._pack(*seq.token_ids[index * bs:(index + 1) * bs])

    @staticmethod
    def _root(salt: str | None) -> bytes:
        if salt is None:
            return _NO_SALT
        return _digest(_SALT_DOMAIN, salt.encode("utf-8", "surrogatepass"))

    def _match_prefix(self, seq: Sequence) -> list[BlockKey]:
        """Keys of cached blocks that hold ``seq``'s leading tokens, up to its
        ``num_cacheable_tokens`` (so >= 1 token is left to compute)."""
        if not self.enable_prefix_caching:
            return []
        salt = seq.params.cache_salt
        parent: BlockKey | None = None
        parent_digest = self._root(salt)
        keys = []
        for i in range(seq.num_cacheable_tokens // self.block_size):
            tokens = self._packed(seq, i)
            key = self._cached.get(_digest(parent_digest, tokens))
            if key is None or not key.holds(parent, tokens, salt):
                break
            keys.append(key)
            parent, parent_digest = key, key.digest
        return keys

    def waits_for_prefix(self, seq: Sequence) -> bool:
        """Whether a block of ``seq``'s cacheable prefix is being computed by a running
        sequence right now: once that is done the cache serves it. Walks the cached blocks
        and stops at the first block that is neither cached nor in flight (no later block
        can be: a digest names its whole prefix)."""
        if not self._computing:
            return False
        parent_digest = self._root(seq.params.cache_salt)
        for i in range(seq.num_cacheable_tokens // self.block_size):
            digest = _digest(parent_digest, self._packed(seq, i))
            if digest in self._computing:
                return True
            if digest not in self._cached:
                return False
            parent_digest = digest
        return False

    def _track_in_flight(self, seq: Sequence) -> None:
        """Note the digests of the full blocks ``seq`` now computes (after its cached
        prefix, up to its last full block)."""
        if not self.enable_prefix_caching:
            return
        start = len(seq.block_keys)
        parent_digest = (seq.block_keys[-1].digest if start
                         else self._root(seq.params.cache_salt))
        pending = []
        for i in range(start, seq.num_tokens // self.block_size):
            digest = _digest(parent_digest, self._packed(seq, i))
            pending.append((i, digest))
            self._computing[digest] = self._computing.get(digest, 0) + 1
            parent_digest = digest
        if pending:
            self._in_flight[seq.seq_id] = pending

    def _drop_in_flight(self, seq: Sequence, below: int | None = None) -> None:
        """Forget ``seq``'s blocks in flight with index < ``below`` (all when ``None``)."""
        pending = self._in_flight.pop(seq.seq_id, None)
        if pending is None:
            return
        done = len(pending) if below is None else sum(1 for i, _ in pending if i < below)
        for _, digest in pending[:done]:
            count = self._computing[digest] - 1
            if count:
                self._computing[digest] = count
            else:
                del self._computing[digest]
        if done < len(pending):
            self._in_flight[seq.seq_id] = pending[done:]

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Key every block of ``seq`` that is now full of computed tokens. A block whose
        content is already cached elsewhere takes that key; a digest held by other content
        (a collision, or a key whose parent was evicted) is taken over by this block."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        done = len(seq.block_keys)
        if num_full <= done:
            return
        salt = seq.params.cache_salt
        parent = seq.block_keys[-1] if done else None
        parent_digest = parent.digest if parent is not None else self._root(salt)
        for i in range(done, num_full):
            tokens = self._packed(seq, i)
            digest = _digest(parent_digest, tokens)
            key = self._cached.get(digest)
            if key is None or not key.holds(parent, tokens, salt):
                block = seq.block_table[i]
                key = BlockKey(digest, tokens, salt if parent is None else None,
                               next(self._serials),
                               -1 if parent is None else parent.serial, block)
                self._forget(block)
                self._cached[digest] = key
                self._block_key[block] = key
            seq.block_keys.append(key)
            parent, parent_digest = key, digest
        self._drop_in_flight(seq, below=num_full)

    def _forget(self, block: int) -> None:
        """Drop ``block``'s key: the block is about to hold other tokens."""
        key = self._block_key[block]
        if key is None:
            return
        self._block_key[block] = None
        if self._cached.get(key.digest) is key:
            del self._cached[key.digest]

    # -- allocation ---------------------------------------------------------------------

    def _take_free_block(self) -> int:
        block, _ = self._free.popitem(last=False)
        self._forget(block)
        self._ref_counts[block] = 1
        return block

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        return needed - len(seq.block_table) <= len(self._free)

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow ``seq``'s block table to hold ``num_new_tokens`` more computed tokens."""
        needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        if needed - len(seq.block_table) > len(self._free):
            raise RuntimeError("out of KV blocks: call can_append first")
        while len(seq.block_table) < needed:
            seq.block_table.append(self._take_free_block())

    def allocate(self, seq: Sequence, max_new_tokens: int) -> int | None:
        """Admit a sequence that holds no blocks: reuse its cached prefix, then allocate room
        for up to ``max_new_tokens`` of the rest. Returns how many tokens this step computes,
        or ``None`` (nothing changed) when the blocks are not there.
        """
        if seq.block_table:
            raise RuntimeError("allocate() is for sequences without blocks")
        prefix = self._match_prefix(seq)
        num_cached = len(prefix) * self.block_size
        num_new = min(seq.num_tokens - num_cached, max_new_tokens)
        revived = sum(1 for key in prefix if self._ref_counts[key.block] == 0)
        needed = self.num_blocks_for(num_cached + num_new) - len(prefix)
        if needed + revived > len(self._free):
            return None
        for key in prefix:
            if self._ref_counts[key.block] == 0:
                del self._free[key.block]
            self._ref_counts[key.block] += 1
        seq.block_table = [key.block for key in prefix]
        seq.block_keys = prefix
        seq.num_computed_tokens = num_cached
        self.append(seq, num_new)
        self._track_in_flight(seq)
        return num_new

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; tail blocks go first so they are evicted first."""
        self._drop_in_flight(seq)
        for block in reversed(seq.block_table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None
        seq.block_table = []
        seq.block_keys = []
