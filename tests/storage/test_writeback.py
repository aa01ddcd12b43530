"""Write-behind queue: every tier written concurrently, bounded queue, counted drops, drain."""

from __future__ import annotations

import asyncio

import pytest

from kvtier.storage.base import ChunkKey, SlotRef, Tier
from kvtier.storage.writeback import WriteBack
from tests.storage.fakes import FakeTier

SIZE = 64


def key(i: int) -> ChunkKey:
    return ChunkKey("ns", bytes([i]))


def ids(keys: list[ChunkKey]) -> list[int]:
    return sorted(k.prefix_hash[0] for k in keys)


class Harness:
    """A bytearray standing in for the arena, and a record of on_done calls."""

    def __init__(self, tiers: list[FakeTier], max_queue: int = 8, workers: int = 2) -> None:
        self.memory = bytearray(SIZE * 16)
        self.done: list[ChunkKey] = []
        self.unwritten: list[ChunkKey] = []  # on_done said the write never happened
        self.tiers = tiers
        self.wb = WriteBack(tiers, self.view, self.on_done, max_queue, workers)

    def view(self, slot: SlotRef) -> memoryview:
        return memoryview(self.memory)[slot.offset : slot.offset + slot.length]

    def on_done(self, k: ChunkKey, slot: SlotRef, written: bool) -> None:
        self.done.append(k)
        if not written:
            self.unwritten.append(k)

    def offer(self, i: int) -> bool:
        slot = SlotRef(i * SIZE, SIZE)
        self.memory[slot.offset : slot.offset + SIZE] = bytes([i]) * SIZE
        return self.wb.offer(key(i), slot)


async def test_writes_reach_every_tier() -> None:
    h = Harness([FakeTier(Tier.DISK), FakeTier(Tier.REDIS)])
    assert h.offer(1) and h.offer(2)
    assert h.wb.pending(key(1)) and h.wb.depth == 2
    assert await h.wb.drain(2.0)
    for tier in h.tiers:
        assert tier.data == {key(1): b"\x01" * SIZE, key(2): b"\x02" * SIZE}
    assert ids(h.done) == [1, 2] and h.wb.depth == 0
    assert h.wb.written == 4 and h.wb.failed == 0
    await h.wb.close(1.0)


async def test_tiers_are_written_concurrently() -> None:
    slow, fast = FakeTier(Tier.DISK), FakeTier(Tier.REDIS)
    slow.put_gate = asyncio.Event()
    h = Harness([slow, fast])
    h.offer(1)
    await asyncio.wait_for(fast.stored.wait(), 10)
    assert key(1) in fast.data and key(1) not in slow.data  # fast finished while slow still waits
    assert h.done == []  # the slot stays held until every tier is done
    slow.put_gate.set()
    assert await h.wb.drain(2.0)
    assert h.done == [key(1)]
    await h.wb.close(1.0)


async def test_full_queue_drops_without_blocking() -> None:
    tier = FakeTier()
    tier.put_gate = asyncio.Event()
    h = Harness([tier], max_queue=2, workers=1)
    assert h.offer(0)
    await tier.put_started.wait()  # item 0 is in flight, the queue is empty again
    assert h.offer(1) and h.offer(2)
    assert not h.offer(3) and not h.offer(4)
    assert h.wb.dropped == 2
    assert not h.offer(1)  # already pending: refused, not a drop
    assert h.wb.dropped == 2
    tier.put_gate.set()
    assert await h.wb.drain(2.0)
    assert set(tier.data) == {key(0), key(1), key(2)}
    await h.wb.close(1.0)


async def test_drain_times_out_and_close_releases_everything() -> None:
    tier = FakeTier()
    tier.put_gate = asyncio.Event()  # never opened
    h = Harness([tier], max_queue=4, workers=1)
    for i in range(3):
        h.offer(i)
    assert not await h.wb.drain(0.05)
    assert not await h.wb.close(0.05)
    assert ids(h.done) == [0, 1, 2]  # every slot handed back
    assert h.wb.dropped == 3 and h.wb.depth == 0
    assert not h.offer(5) and h.wb.dropped == 4  # closed: refused and counted


async def test_cancel_skips_a_queued_write_and_undoes_a_running_one() -> None:
    tier = FakeTier()
    tier.put_gate = asyncio.Event()
    h = Harness([tier], workers=1)
    h.offer(1)
    h.offer(2)
    await tier.put_started.wait()  # 1 is being written, 2 is queued
    assert h.wb.cancel(key(1)) and h.wb.cancel(key(2)) and not h.wb.cancel(key(9))
    tier.put_gate.set()
    assert await h.wb.drain(2.0)
    assert tier.data == {} and tier.puts == [key(1)] and key(1) in tier.deletes
    assert ids(h.done) == [1, 2]
    await h.wb.close(1.0)


async def _one_running_three_queued() -> tuple[FakeTier, Harness]:
    """Four writes offered to one worker whose tier holds the first put: 0 runs, 1-3 are queued."""
    tier = FakeTier()
    tier.put_gate = asyncio.Event()
    h = Harness([tier], workers=1)
    for i in range(4):
        h.offer(i)
    await tier.put_started.wait()
    return tier, h


async def test_give_up_ends_queued_writes_oldest_first_never_a_running_one() -> None:
    tier, h = await _one_running_three_queued()
    assert h.wb.give_up(2 * SIZE, lambda slot: slot.length) == 2 * SIZE
    assert h.done == [key(1), key(2)] and h.unwritten == [key(1), key(2)]
    assert h.wb.yielded == 2 and h.wb.dropped == 0 and h.wb.depth == 2
    assert not h.wb.pending(key(1)) and h.wb.pending(key(0)) and h.wb.pending(key(3))
    assert h.wb.give_up(10 * SIZE, lambda slot: slot.length) == SIZE  # 3 only: 0 has started
    assert tier.putting == 1 and h.wb.pending(key(0))  # still being written
    assert h.wb.give_up(SIZE, lambda slot: slot.length) == 0  # nothing queued is left
    tier.put_gate.set()
    assert await h.wb.drain(2.0)
    assert tier.puts == [key(0)] and set(tier.data) == {key(0)}
    assert h.done == [key(1), key(2), key(3), key(0)] and h.unwritten == [key(1), key(2), key(3)]
    assert h.wb.yielded == 3 and h.wb.written == 1
    await h.wb.close(1.0)
    assert len(h.done) == 4  # once per item: close has nothing left to hand back


async def test_give_up_skips_slots_it_would_not_free() -> None:
    tier, h = await _one_running_three_queued()
    held = SlotRef(1 * SIZE, SIZE)  # as a chunk a lease also pins
    assert h.wb.give_up(SIZE, lambda slot: 0 if slot == held else slot.length) == SIZE
    assert h.done == [key(2)] and h.wb.pending(key(1))
    tier.put_gate.set()
    assert await h.wb.drain(2.0)
    assert ids(list(tier.data)) == [0, 1, 3]
    await h.wb.close(1.0)


async def test_failing_and_raising_tiers_are_counted() -> None:
    dead, broken, good = FakeTier(Tier.DISK), FakeTier(Tier.REDIS), FakeTier(Tier.DISK)
    dead.fail = True
    broken.raise_errors = True
    h = Harness([dead, broken, good])
    h.offer(1)
    assert await h.wb.drain(2.0)
    assert h.wb.failed == 2 and h.wb.written == 1 and key(1) in good.data
    assert h.done == [key(1)]
    h.offer(2)  # the worker survived
    assert await h.wb.drain(2.0) and key(2) in good.data
    await h.wb.close(1.0)


async def test_bad_sizes_rejected() -> None:
    with pytest.raises(ValueError):
        WriteBack([], lambda s: memoryview(b""), lambda k, s, w: None, 0)
