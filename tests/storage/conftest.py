"""The TieredStore fixture: a store over a real arena in tmp_path and two fake lower tiers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from kvtier.storage.arena import Arena, ArenaMapping
from kvtier.storage.base import Tier
from kvtier.storage.store import StoreConfig, TieredStore
from tests.storage.fakes import FakeTier
from tests.storage.store_env import CHUNK, SPEC, Clock, Env, listing


@pytest.fixture
async def make(tmp_path: Path) -> AsyncIterator[Callable[..., object]]:
    """make(chunks=4, **StoreConfig fields) -> Env; every store is closed and its arena gone after."""
    envs: list[Env] = []

    async def factory(chunks: int = 4, **cfg: object) -> Env:
        clock = Clock()
        arena = Arena.create(tmp_path, chunks * CHUNK, prefault=False)
        disk, redis = FakeTier(Tier.DISK), FakeTier(Tier.REDIS)
        config = StoreConfig(**{"lease_ttl": 10.0, "write_queue_size": 8, **cfg})  # type: ignore[arg-type]
        store = TieredStore(arena, [redis, disk], config, clock)
        ns = store.register(SPEC)
        env = Env(store, ns, ArenaMapping.open(store.arena_info()), disk, redis, clock, arena.path)
        envs.append(env)
        return env

    yield factory
    for env in envs:
        env.client.close()
        if env.disk.put_gate is not None:
            env.disk.put_gate.set()
        await env.store.close(1.0)
    assert listing(tmp_path) == []
