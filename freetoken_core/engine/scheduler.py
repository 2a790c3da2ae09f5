"""Continuous batching with chunked prefill and preemption by recompute (pure Python).

Every step the scheduler spends a token budget: first on running sequences in arrival
order (a decoding sequence needs one token, a sequence in chunked prefill the next chunk),
then on waiting sequences, which join the batch as soon as blocks and seats allow. When a
running sequence cannot get a block, the most recently arrived running sequence is
preempted: its blocks are freed and it goes back to the front of the queue, to be
recomputed (its prompt and generated tokens, mostly from the prefix cache) later.

Liveness: every sequence must fit in the whole cache on its own (``add`` refuses one that
cannot; the engine's length check against ``compute_limits`` guarantees it). Then the
oldest running sequence computes at least one token every step (it preempts the others
before itself, and alone it fits), waiting sequences hold no blocks, and when nothing runs
the head of the queue is admitted into an empty cache; so every sequence finishes within
about as many steps as it has tokens once it is the oldest, and nothing spins.
tests/test_scheduler_random.py checks this over random configurations.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from freetoken_core.engine.block_manager import BlockManager
from freetoken_core.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """One step's work: each sequence with the number of its tokens to compute."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0

    def __len__(self) -> int:
        return len(self.seqs)

    def add(self, seq: Sequence, num_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_tokens)


class Scheduler:
    """Decides what runs each step; owns the waiting queue and the running list."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int,
                 on_admit: Callable[[Sequence], None] | None = None,
                 on_release: Callable[[Sequence], None] | None = None) -> None:
        """``on_admit(seq)`` runs when a sequence gets a slot (it starts or resumes
        running), ``on_release(seq)`` just before it gives the slot back (finished,
        aborted or preempted); the engine keeps processor state in step with them."""
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self._on_admit = on_admit
        self._on_release = on_release

    def _release_slot(self, seq: Sequence) -> None:
        if seq.slot is None:
            return
        if self._on_release is not None:
            self._on_release(seq)
        self._free_slots.append(seq.slot)
        seq.slot = None

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def add(self, seq: Sequence) -> None:
        """Queue ``seq``. Raises ``ValueError`` when its prompt plus ``max_tokens`` cannot
        fit in the whole KV cache: it could never run, and would preempt itself forever."""
        # The last sampled token is never computed, hence the - 1 (a request that generates
        # nothing computes its whole prompt).
        needed = seq.num_prompt_tokens + max(seq.max_tokens - 1, 0)
        if needed > self.block_manager.num_slots:
            raise ValueError(
                f"sequence of request {seq.request_id!r} needs {needed} KV slots but the "
                f"cache has {self.block_manager.num_slots}: check its length against "
                "compute_limits' max_model_len first")
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(batch, budget)
        if batch.num_preempted == 0:
            self._schedule_waiting(batch, budget)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num = min(seq.num_uncomputed_tokens, budget)
            while not bm.can_append(seq, num):
                victim = self.running[-1]
                self.preempt(victim)
                batch.num_preempted += 1
                if victim is seq:
                    return budget
            bm.append(seq, num)
            batch.add(seq, num)
            budget -= num
            i += 1
        return budget

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        held: list[Sequence] = []
        try:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                if seq.index > 0 and self._prompt_in_progress(seq.request_id):
                    # A later choice of a request waits until the first one has computed the
                    # shared prompt, so it is served from the prefix cache instead of
                    # recomputed (and the first choice's first update, which carries the
                    # prompt's logprobs, comes before any other choice's).
                    return
                if self.block_manager.waits_for_prefix(seq):
                    # A running sequence is computing a block of this one's prompt: it waits
                    # (keeping its place) and gets the block from the cache once it is done,
                    # while the sequences behind it may start. At most max_num_seqs are
                    # looked at a step (each look hashes the prompt's shared blocks).
                    held.append(self.waiting.popleft())
                    if len(held) >= self.max_num_seqs:
                        return
                    continue
                num = self.block_manager.allocate(seq, budget)
                if num is None:
                    return
                self.waiting.popleft()
                if seq.num_output_tokens == 0:
                    seq.num_cached_tokens = seq.num_computed_tokens
                seq.status = SequenceStatus.RUNNING
                seq.slot = self._free_slots.pop()
                if self._on_admit is not None:
                    self._on_admit(seq)
                self.running.append(seq)
                batch.add(seq, num)
                budget -= num
        finally:
            self.waiting.extendleft(reversed(held))

    def _prompt_in_progress(self, request_id: str) -> bool:
        return any(s.request_id == request_id and s.num_computed_tokens < s.num_prompt_tokens
                   for s in self.running)

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and queue it first, to be recomputed."""
        self.running.remove(seq)
        self._release_slot(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def advance(self, batch: ScheduledBatch) -> None:
        """Record that the batch's tokens are now computed and key the blocks they filled."""
        for seq, num in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += num
            self.block_manager.cache_full_blocks(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End ``seq`` (finished or aborted), wherever it is, and free its blocks."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._release_slot(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
