"""Pins of a lower tier: lease counts per key, and deletions deferred until a key's last unpin.

Shared by the disk and Redis tiers, whose own eviction (or deletion) must not remove a chunk that a
lease still promises to a reader.
"""

from __future__ import annotations

from collections import Counter

from kvtier.storage.base import ChunkKey


class PinBook:
    """Pin counts per key and the set of keys doomed to go once unpinned."""

    def __init__(self) -> None:
        self._pins: Counter[ChunkKey] = Counter()
        self._doomed: set[ChunkKey] = set()

    def pinned(self, key: ChunkKey) -> bool:
        """True while at least one lease holds key."""
        return self._pins[key] > 0

    def pin(self, keys: list[ChunkKey]) -> None:
        """Add one pin to each key."""
        for key in keys:
            self._pins[key] += 1

    def unpin(self, keys: list[ChunkKey]) -> list[ChunkKey]:
        """Remove one pin of each key; returns the doomed keys whose last pin just went."""
        freed = []
        for key in keys:
            if self._pins[key] <= 0:
                continue
            self._pins[key] -= 1
            if self._pins[key] == 0:
                del self._pins[key]
                if key in self._doomed:
                    freed.append(key)
        return freed

    def doom(self, key: ChunkKey) -> None:
        """Mark key for deletion at its last unpin."""
        self._doomed.add(key)

    def is_doomed(self, key: ChunkKey) -> bool:
        """True when key waits for its last unpin to be deleted."""
        return key in self._doomed

    def forget(self, key: ChunkKey) -> None:
        """Key is gone or stored anew: it is no longer doomed."""
        self._doomed.discard(key)
