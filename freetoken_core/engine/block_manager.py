"""Paged KV-cache bookkeeping in pure Python: blocks, reference counts and the prefix cache.

The KV cache is ``num_blocks`` blocks of ``block_size`` token slots. A sequence owns an
ordered block table; slot ``p`` of a sequence lives at
``block_table[p // block_size] * block_size + p % block_size``.

Prefix cache: once a block is full of computed tokens it is keyed by a hash chain
``hash((parent_key, tokens))``, so a key names the whole prefix up to that block. A later
sequence whose leading tokens hash to the same keys shares those blocks (reference count
+1). A block whose count drops to 0 goes to the back of the free queue but keeps its key
until it is handed out again, so recently freed prefixes stay reusable (LRU eviction).
"""

from __future__ import annotations

from collections import OrderedDict

from freetoken_core.engine.sequence import Sequence


class BlockManager:
    """Allocates and frees KV blocks for sequences; knows nothing about tensors."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._block_key: list[int | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------

    def _chain_keys(self, token_ids: list[int], num_blocks: int, start: int = 0,
                    parent: int | None = None) -> list[int]:
        keys = []
        bs = self.block_size
        for i in range(start, num_blocks):
            parent = hash((parent, tuple(token_ids[i * bs:(i + 1) * bs])))
            keys.append(parent)
        return keys

    def _match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks that hold ``seq``'s leading tokens, leaving >= 1 token to compute."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        blocks = []
        parent = None
        bs = self.block_size
        for i in range(max_blocks):
            parent = hash((parent, tuple(seq.token_ids[i * bs:(i + 1) * bs])))
            block = self._cached.get(parent)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Key every block of ``seq`` that is now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        done = len(seq.block_hashes)
        if num_full <= done:
            return
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        for i, key in enumerate(self._chain_keys(seq.token_ids, num_full, done, parent), done):
            seq.block_hashes.append(key)
            block = seq.block_table[i]
            if key not in self._cached and self._block_key[block] is None:
                self._cached[key] = block
                self._block_key[block] = key

    # -- allocation ---------------------------------------------------------------------

    def _take_free_block(self) -> int:
        block, _ = self._free.popitem(last=False)
        key = self._block_key[block]
        if key is not None:
            # Evict: the block is about to hold other tokens.
            self._block_key[block] = None
            if self._cached.get(key) == block:
                del self._cached[key]
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
        revived = sum(1 for b in prefix if self._ref_counts[b] == 0)
        needed = self.num_blocks_for(num_cached + num_new) - len(prefix)
        if needed + revived > len(self._free):
            return None
        for block in prefix:
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1
        seq.block_table = list(prefix)
        seq.block_hashes = [self._block_key[b] for b in prefix]  # type: ignore[misc]
        seq.num_computed_tokens = num_cached
        self.append(seq, num_new)
        return num_new

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; tail blocks go first so they are evicted first."""
        for block in reversed(seq.block_table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None
        seq.block_table = []
        seq.block_hashes = []
