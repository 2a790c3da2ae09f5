"""A helper the built-in processors share: the host-side length of each slot's list."""

from __future__ import annotations


class SlotWidths:
    """Lengths of per-slot lists (logit_bias entries, min_tokens ids) kept on the host, and
    the widest among the slots in use, so a torch path can size its gather without reading
    the device."""

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}
        self.width = 0

    def set(self, slot: int, count: int) -> None:
        previous = self._counts.get(slot, 0)
        self._counts[slot] = count
        # A slot re-added without remove() may have held the widest list.
        self.width = (max(self._counts.values()) if previous == self.width
                      else max(self.width, count))

    def remove(self, slot: int) -> None:
        if self._counts.pop(slot, 0) == self.width:
            self.width = max(self._counts.values(), default=0)
