"""In-memory LowerTier for store and write-back tests: fails, slows, blocks, loses, corrupts."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

from kvtier.storage.base import ChunkKey, Tier, TierStats


class FakeTier:
    """A LowerTier over a dict, with a switch for every failure the store must absorb."""

    def __init__(self, tier: Tier = Tier.DISK) -> None:
        self.tier = tier
        self.data: dict[ChunkKey, bytes] = {}
        self.pins: Counter[ChunkKey] = Counter()
        self.fail = False  # every call answers as a dead tier would: misses and False
        self.raise_errors = False  # break the never-raise contract, to test the store's guard
        self.delay = 0.0  # seconds each call sleeps first
        self.put_gate: asyncio.Event | None = None  # puts wait for it (set = open)
        self.get_gate: asyncio.Event | None = None  # get_into waits for it
        self.corrupted: set[ChunkKey] = set()
        self.on_get: Callable[[ChunkKey], None] | None = None  # hook run when a read starts
        self.contains_calls: list[list[ChunkKey]] = []
        self.puts: list[ChunkKey] = []
        self.gets: list[ChunkKey] = []
        self.deletes: list[ChunkKey] = []
        self.put_started = asyncio.Event()
        self.putting = 0  # puts started and not yet returned
        self.stored = asyncio.Event()  # set once a put has stored its payload
        self.started = False
        self.closed = False
        self._stats = TierStats(capacity=1 << 40)

    # -------------------------------------------------------------------------------- test helpers
    def lose(self, key: ChunkKey) -> None:
        """Forget key silently (an eviction or a TTL expiry the store does not see)."""
        self.data.pop(key, None)

    def corrupt(self, key: ChunkKey) -> None:
        """Make the next read of key fail verification."""
        self.corrupted.add(key)

    async def _enter(self) -> None:
        if self.raise_errors:
            raise RuntimeError("fake tier broke its contract")
        if self.delay:
            await asyncio.sleep(self.delay)

    # -------------------------------------------------------------------------------- LowerTier
    async def start(self) -> None:
        """Mark started."""
        self.started = True

    async def contains_many(self, keys: list[ChunkKey]) -> list[bool]:
        """Whether each key is held; all False while failing."""
        self.contains_calls.append(list(keys))
        await self._enter()
        if self.fail:
            self._stats.count_error("timeout")
            return [False] * len(keys)
        return [k in self.data for k in keys]

    async def put(self, key: ChunkKey, payload: memoryview) -> bool:
        """Copy payload into the dict."""
        self.put_started.set()
        self.putting += 1
        try:
            await self._enter()
            if self.put_gate is not None:
                await self.put_gate.wait()
            if self.fail:
                self._stats.count_error("timeout")
                return False
            self.data[key] = bytes(payload)
            self.puts.append(key)
            self._stats.stores += 1
            self._stats.bytes_written += len(payload)
            self.stored.set()
            return True
        finally:
            self.putting -= 1

    async def get_into(self, key: ChunkKey, dest: memoryview) -> bool:
        """Copy the stored payload into dest; False on miss, corruption or failure."""
        self.gets.append(key)
        if self.on_get is not None:
            self.on_get(key)
        await self._enter()
        payload = self.data.get(key)  # taken before the gate: the file is already open
        if self.get_gate is not None:
            await self.get_gate.wait()
        if self.fail:
            self._stats.count_error("timeout")
            return False
        if payload is None:
            self._stats.misses += 1
            return False
        if key in self.corrupted or len(payload) != len(dest):
            self._stats.count_error("corrupt")
            self.data.pop(key, None)
            return False
        dest[:] = payload
        self._stats.hits += 1
        self._stats.bytes_read += len(payload)
        return True

    async def delete(self, key: ChunkKey) -> None:
        """Forget key."""
        self.deletes.append(key)
        self.data.pop(key, None)

    def pin(self, keys: list[ChunkKey]) -> None:
        """Count a pin per key."""
        self.pins.update(keys)

    def unpin(self, keys: list[ChunkKey]) -> None:
        """Drop a pin per key; never below zero."""
        for key in keys:
            assert self.pins[key] > 0, f"unpin of unpinned {key}"
            self.pins[key] -= 1
            if not self.pins[key]:
                del self.pins[key]

    async def clear(self) -> int:
        """Drop every unpinned key."""
        gone = [k for k in self.data if not self.pins[k]]
        for key in gone:
            del self.data[key]
        return len(gone)

    def stats(self) -> TierStats:
        """Counters, with chunks and bytes from the dict."""
        self._stats.chunks = len(self.data)
        self._stats.bytes = sum(len(v) for v in self.data.values())
        return self._stats

    async def close(self) -> None:
        """Mark closed."""
        self.closed = True
