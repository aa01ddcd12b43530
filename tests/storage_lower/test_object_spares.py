"""The object tier reuses the buffer of an upload that succeeded for the next blob, never one whose
upload failed (the client may still be reading it), and every reused blob holds exactly its own
chunk. A recording client stands in for the store: this is about buffers, not S3."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

from kvtier.storage import codec
from kvtier.storage.base import ChunkKey
from kvtier.storage.config import ObjectConfig
from kvtier.storage.tiers.object import ObjectTier

NS = "aabbccddeeff0011"
CHUNK = 64 * 1024


class RecordingClient:
    """The calls the tier makes, answered in memory; put fails while ``fail_puts`` is above 0."""

    bucket, prefix = "b", "p"

    def __init__(self) -> None:
        self.buffers: list[object] = []  # each put's underlying buffer, in order
        self.objects: dict[str, bytes] = {}
        self.fail_puts = 0

    async def put(self, path: str, blob: Any) -> None:
        self.buffers.append(memoryview(blob).obj)
        if self.fail_puts:
            self.fail_puts -= 1
            raise RuntimeError("AccessDenied: refused by the test")  # counted, the breaker stays closed
        self.objects[path] = bytes(blob)

    async def get(self, path: str) -> bytes:
        return self.objects[path]

    async def delete(self, paths: list[str]) -> None:
        for path in paths:
            self.objects.pop(path, None)

    async def probe(self) -> None:
        return None

    async def pages(self, namespace: str | None = None) -> AsyncIterator[list[Any]]:
        yield []


def key(i: int) -> ChunkKey:
    return ChunkKey(NS, f"chunk-{i}".encode().ljust(32, b"."))


async def _put(tier: ObjectTier, i: int) -> bytes:
    data = os.urandom(CHUNK)
    assert await tier.put(key(i), memoryview(data))
    await tier.settle()
    return data


def _loads_as(client: RecordingClient, i: int, data: bytes) -> None:
    assert bytes(codec.decode(client.objects[f"{NS}/{key(i).prefix_hash.hex()}"], key(i))) == data


def test_a_succeeded_uploads_buffer_carries_the_next_blob_and_a_failed_ones_is_dropped() -> None:
    async def run() -> None:
        client = RecordingClient()
        cfg = ObjectConfig(url="s3://b/p", timeout=5.0, refresh_period=3600.0, retries=0)
        tier = ObjectTier(cfg, client=client)  # type: ignore[arg-type]
        await tier.start()
        try:
            first, second = await _put(tier, 1), await _put(tier, 2)
            assert client.buffers[1] is client.buffers[0]
            _loads_as(client, 1, first)
            _loads_as(client, 2, second)
            client.fail_puts = 1
            await _put(tier, 3)  # fails: counted, its buffer not kept
            assert tier.stats().errors == {"denied": 1}
            fourth = await _put(tier, 4)
            assert client.buffers[3] is not client.buffers[2]
            _loads_as(client, 4, fourth)
            assert tier.stats().stores == 3
        finally:
            await tier.close()

    asyncio.run(run())
