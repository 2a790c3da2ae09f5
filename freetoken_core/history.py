"""Each slot's tokens, prompt + generated, on the device: the one copy every processor reads.

The engine keeps a ``TokenHistory`` when an enabled processor declares
``LogitsProcessor.reads_history``, and hands it to every processor as
``ProcessorContext.history`` (``self.history`` in a processor). A processor reads it; only
the core writes it, so no processor keeps its own copy of a slot's tokens or counts steps.

What the core guarantees (``freetoken_core.engine.pipeline``):

- A slot is *tracked* while it holds a sequence whose request uses a processor that reads
  the history. ``add`` runs when such a sequence gets its slot (new, or resumed after a
  preemption with the tokens it drew so far), **before** the processors' ``add_request``,
  so ``add_request`` may read the slot's row; ``remove`` runs after their
  ``remove_request``.
- Each step, ``append`` folds the drawn tokens in **before** the processors' ``update``:
  in ``update`` the history already ends with the token the row drew; in ``apply`` it
  ends with the last token the sequence holds (the one whose logits these are).
- Untracked slots have length 0 and their rows hold stale ids (always valid ids in
  ``[0, vocab)``, or 0), so indexing with them is safe and a mask on ``lengths`` ignores
  them.

Layout (``S`` slots, ``L`` = ``max_model_len``): ``token_ids`` [S, L] int32, entries
``[0, lengths[s])`` valid; ``lengths`` [S] int64; ``num_prompt_tokens`` [S] int64 (where
the generated tokens start). ``4 × S × L + 24 × S`` bytes: 32 MiB at 256 slots and
``max_model_len`` 32,768.

No device→host synchronisation: ``width`` is a host-side upper bound on the length of
every tracked slot (its length when added plus the appends since), so a torch path can
slice ``token_ids[slots, :width]`` without reading ``lengths``. It can overshoot (a slot
that did not draw in a step, a prompt still being prefilled) but never undershoots.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class TokenHistory:
    """See the module docstring. Processors read ``token_ids``, ``lengths``,
    ``num_prompt_tokens``, ``width`` and ``window``; the core calls ``add``, ``remove`` and
    ``append``."""

    def __init__(self, max_num_slots: int, max_model_len: int, device: torch.device) -> None:
        self.capacity = max(1, max_model_len)
        self.device = device
        self.token_ids = torch.zeros(max_num_slots, self.capacity, dtype=torch.int32,
                                     device=device)
        self.lengths = torch.zeros(max_num_slots, dtype=torch.long, device=device)
        self.num_prompt_tokens = torch.zeros(max_num_slots, dtype=torch.long, device=device)
        self._tracked = torch.zeros(max_num_slots, dtype=torch.long, device=device)
        # Tracked slot s has at most _offsets[s] + _num_appends tokens.
        self._offsets: dict[int, int] = {}
        self._max_offset = 0
        self._num_appends = 0

    @property
    def state_bytes(self) -> int:
        """Device memory held, in bytes."""
        tensors = (self.token_ids, self.lengths, self.num_prompt_tokens, self._tracked)
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def width(self) -> int:
        """An upper bound on ``lengths`` of every tracked slot; 0 when none is tracked."""
        if not self._offsets:
            return 0
        return min(self.capacity, self._max_offset + self._num_appends)

    def is_tracked(self, slot: int) -> bool:
        return slot in self._offsets

    def window(self, slots: torch.Tensor, width: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``width`` (default ``self.width``) token ids of each row's slot, as
        int64 [rows, width] (ready for ``gather`` / ``scatter_``), and the rows' lengths
        [rows]; entries at or past a row's length are stale (valid ids, but not its)."""
        width = self.width if width is None else width
        return self.token_ids[slots, :width].long(), self.lengths[slots]

    # -- written by the core only ----------------------------------------------------------

    def add(self, slot: int, prompt_token_ids: Sequence[int],
            output_token_ids: Sequence[int]) -> None:
        """Start tracking ``slot`` with these tokens (one host-to-device copy)."""
        ids = list(prompt_token_ids) + list(output_token_ids)
        if len(ids) > self.capacity:
            raise ValueError(f"{len(ids)} tokens exceed the history's {self.capacity}")
        if ids:
            self.token_ids[slot, :len(ids)] = torch.tensor(ids, dtype=torch.int32).to(
                self.device)
        self.lengths[slot] = len(ids)
        self.num_prompt_tokens[slot] = len(prompt_token_ids)
        self._tracked[slot] = 1
        self._offsets[slot] = len(ids) - self._num_appends
        self._max_offset = max(self._offsets.values())

    def remove(self, slot: int) -> None:
        """Stop tracking ``slot`` (its length becomes 0)."""
        if self._offsets.pop(slot, None) is None:
            return
        self.lengths[slot] = 0
        self._tracked[slot] = 0
        self._max_offset = max(self._offsets.values(), default=0)

    def append(self, slots: torch.Tensor, sampled: torch.Tensor) -> None:
        """Append ``sampled[i]`` to slot ``slots[i]`` for the tracked slots (rows of other
        slots write a stale entry and keep length 0); on the device, no synchronisation."""
        if not self._offsets:
            return
        n = self.lengths[slots]
        # clamp: a row that drew nothing (non-finite logits; its request fails) must still
        # leave a valid id behind.
        self.token_ids[slots, n.clamp(max=self.capacity - 1)] = sampled.clamp(min=0).to(
            torch.int32)
        self.lengths[slots] = (n + self._tracked[slots]).clamp(max=self.capacity)
        self._num_appends += 1
