"""What the TieredStore tests share: a store over a real arena and fake lower tiers, and helpers."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.storage.arena import ArenaMapping
from kvtier.storage.base import ChunkKey, LookupResult, NamespaceSpec, SlotRef
from kvtier.storage.store import TieredStore
from tests.storage.fakes import FakeTier

SPEC = NamespaceSpec(
    model="m", kv_dtype="bf16", kv_layout="nhd", block_size=16, chunk_size=16, num_layers=2,
    page_bytes=8192,
)  # fmt: skip
BIG = NamespaceSpec(
    model="m2", kv_dtype="bf16", kv_layout="nhd", block_size=16, chunk_size=16, num_layers=2,
    page_bytes=16384,
)  # fmt: skip
CHUNK = SPEC.chunk_bytes  # 16 KiB
H = [bytes([i]) * 8 for i in range(16)]


def payload(h: bytes, n: int = CHUNK) -> bytes:
    return (h * (n // len(h) + 1))[:n]


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def answer(result: LookupResult | Coroutine[Any, Any, LookupResult]) -> LookupResult:
    """A lookup's answer, awaited when the store had to ask a lower tier for it."""
    return result if isinstance(result, LookupResult) else await result


def at_once(result: LookupResult | Coroutine[Any, Any, LookupResult]) -> LookupResult:
    """A lookup's answer, which the CPU tier must have given at once."""
    assert isinstance(result, LookupResult), "the lookup had to ask a lower tier"
    return result


@dataclass
class Env:
    store: TieredStore
    ns: str
    client: ArenaMapping  # what a vLLM worker maps
    disk: FakeTier
    redis: FakeTier
    clock: Clock
    path: str

    def key(self, i: int) -> ChunkKey:
        return ChunkKey(self.ns, H[i])

    def held(self, i: int) -> bool:
        """Whether the CPU tier holds chunk i."""
        return self.store.cpu.entry(self.key(i)) is not None

    def slot(self, i: int) -> SlotRef | None:
        """The CPU slot of chunk i, or None."""
        sid = self.store.cpu.entry(self.key(i))
        return None if sid is None else self.store.cpu.slot_of(sid)

    def read(self, slot: SlotRef | None) -> bytes:
        assert slot is not None
        view = self.client.view(slot)
        try:
            return bytes(view)
        finally:
            view.release()

    async def save(self, idx: list[int], ns: str | None = None, n: int = CHUNK) -> list[bool]:
        """Reserve, fill through the client mapping, commit: what a worker does."""
        ns = ns or self.ns
        hashes = [H[i] for i in idx]
        slots = self.store.reserve(ns, hashes)
        done = [(h, s) for h, s in zip(hashes, slots, strict=True) if s is not None]
        for h, s in done:
            view = self.client.view(s)
            view[:] = payload(h, n)
            view.release()
        if done:
            self.store.commit(ns, [h for h, _ in done], [s for _, s in done])
        return [s is not None for s in slots]

    def pins(self, i: int) -> int:
        sid = self.store.cpu.entry(self.key(i))
        assert sid is not None
        return self.store.cpu.pins_of(sid)


def listing(path: Path) -> list[Path]:
    return list(path.iterdir())


def exists(path: str) -> bool:
    return os.path.exists(path)


async def until(pred: Callable[[], bool], within_s: float = 2.0) -> None:
    """Yield to the loop until pred() holds (fails the test after within_s)."""
    for _ in range(int(within_s / 0.001)):
        if pred():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition not reached")


async def settled(env: Env) -> None:
    """Queued writes done, then no pin may be left anywhere."""
    assert await env.store.flush(2.0)
    stats = env.store.stats()
    assert stats.slots_in_use == stats.tiers["cpu"].chunks  # no slot kept outside the index
    assert not any(env.pins(i) for i in range(len(H)) if env.held(i))
    assert not env.disk.pins and not env.redis.pins
