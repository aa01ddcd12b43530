"""Object tier against a real S3 server (SeaweedFS): the chunks a LIST finds are announced with the
block hashes and description their trailers hold, read in the background, bounded, and never in the
way of a lookup or a load."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import obstore
import pytest

from kvtier.storage.base import ChunkKey, Tier
from kvtier.storage.codec import Covered, description_of
from kvtier.storage.signing import Signer
from kvtier.storage.tiers import object_announce
from kvtier.storage.tiers.object import ObjectTier
from kvtier.storage.tiers.object_announce import READERS
from kvtier.storage.tiers.object_index import object_path
from tests.storage.store_env import until
from tests.storage_lower.test_object_tier import CHUNK, config, key, payload, raw_store, started
from tests.support.object_store import SeaweedServer

WITHIN_S = 30.0  # bound of every wait on the background reads


@pytest.fixture
def prefix() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


Announced = tuple[tuple[bytes, ...], bytes]  # a chunk's block hashes and description


class Recorder:
    """A TierListener keeping what each stored chunk was announced with: hashes and description."""

    def __init__(self) -> None:
        self.covered: dict[ChunkKey, Announced] = {}
        self.gone: list[ChunkKey] = []

    def stored(self, tier: Tier, keys: Sequence[ChunkKey], covered: Sequence[Sequence[bytes]]) -> None:
        assert tier is Tier.OBJECT
        for k, hashes in zip(keys, covered, strict=True):
            assert k not in self.covered, f"{k} announced twice"
            self.covered[k] = (tuple(hashes), description_of(hashes))

    def removed(self, tier: Tier, keys: Sequence[ChunkKey]) -> None:
        self.gone += list(keys)

    def cleared(self, tier: Tier) -> None:
        raise AssertionError("the object tier announces removals key by key")


def described(i: int) -> Covered:
    """Two block hashes and a description, both particular to chunk i."""
    return Covered([f"hash-{i}-a".encode(), f"hash-{i}-b".encode()], f"tokens of chunk {i}".encode())


class Gate:
    """Holds every ranged GET of a tier until opened, counting how many wait at once."""

    def __init__(self, tier: ObjectTier) -> None:
        self.open = asyncio.Event()
        self.waiting = 0
        self.most = 0
        real: Callable[..., Any] = tier.client.get_range

        async def gated(path: str, start: int, end: int) -> Any:
            self.waiting += 1
            self.most = max(self.most, self.waiting)
            try:
                await self.open.wait()
            finally:
                self.waiting -= 1
            return await real(path, start, end)

        tier.client.get_range = gated  # type: ignore[method-assign]


async def written(
    endpoint: str, prefix: str, chunks: dict[ChunkKey, Sequence[bytes]], **kw: Any
) -> dict[ChunkKey, Announced]:
    """Upload chunks from a writer node; what that node announced for each."""
    recorder = Recorder()
    writer = await started(config(endpoint, prefix), listener=recorder, **kw)
    try:
        await writer.wait_listed()
        for i, (k, covered) in enumerate(chunks.items()):
            assert await writer.put(k, payload(i), covered)
        await writer.settle()
    finally:
        await writer.close()
    assert set(chunks) <= set(recorder.covered)  # with those an earlier writer left, once listed
    return {k: recorder.covered[k] for k in chunks}


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
async def test_another_node_announces_each_listed_chunk_as_its_writer_did(
    s3_server: SeaweedServer, aws_env: dict[str, str], prefix: str, signed: bool
) -> None:
    signer = Signer([b"v" * 32]) if signed else None
    chunks: dict[ChunkKey, Sequence[bytes]] = {key(i): described(i) for i in range(6)}
    chunks[key(6)] = [b"plain-hash"]  # hashes without a description: a plain trailer
    chunks[key(7)] = ()  # no trailer at all
    wrote = await written(s3_server.endpoint, prefix, chunks, signer=signer)
    assert wrote[key(0)] == ((b"hash-0-a", b"hash-0-b"), b"tokens of chunk 0")

    recorder = Recorder()
    reader = await started(config(s3_server.endpoint, prefix), listener=recorder, signer=signer)
    try:
        await reader.wait_listed()
        await until(lambda: len(recorder.covered) == len(chunks), WITHIN_S)
        assert recorder.covered == wrote
        assert reader.announcing == 0
        # A chunk written after the first LIST is announced in full by the refresh that finds it.
        more = await written(s3_server.endpoint, prefix, {key(8): described(8)}, signer=signer)
        assert await reader.refresh()
        await until(lambda: key(8) in recorder.covered, WITHIN_S)
        assert recorder.covered[key(8)] == more[key(8)]
        assert "undescribed" not in reader.stats().errors
        assert recorder.gone == []
    finally:
        await reader.close()


@pytest.mark.parametrize("damage", ["trailer", "header", "truncated"])
async def test_a_damaged_object_is_announced_by_its_key_alone_and_counted(
    s3_server: SeaweedServer, aws_env: dict[str, str], prefix: str, damage: str
) -> None:
    wrote = await written(s3_server.endpoint, prefix, {key(1): described(1), key(2): described(2)})
    store = raw_store(s3_server.endpoint, prefix)
    blob = bytearray(await (await obstore.get_async(store, object_path(key(2)))).bytes_async())
    if damage == "trailer":
        blob[-12] ^= 0x01  # inside the description, before the trailer's checksum
    elif damage == "header":
        blob[20] ^= 0x01  # the payload checksum field: the header's own checksum no longer matches
    else:
        blob = blob[:-1]
    await obstore.put_async(store, object_path(key(2)), bytes(blob))

    recorder = Recorder()
    reader = await started(config(s3_server.endpoint, prefix), listener=recorder)
    try:
        await reader.wait_listed()
        await until(lambda: len(recorder.covered) == 2, WITHIN_S)
        assert recorder.covered == {key(1): wrote[key(1)], key(2): ((), b"")}
        assert reader.stats().errors == {"undescribed": 1}
        assert await reader.contains_many([key(1), key(2)]) == [True, True]  # the load will judge it
    finally:
        await reader.close()


async def test_lookups_and_loads_never_wait_for_the_announcements(
    s3_server: SeaweedServer, aws_env: dict[str, str], prefix: str
) -> None:
    count = 3 * READERS
    chunks: dict[ChunkKey, Sequence[bytes]] = {key(i): described(i) for i in range(count)}
    wrote = await written(s3_server.endpoint, prefix, chunks)
    recorder = Recorder()
    reader = ObjectTier(config(s3_server.endpoint, prefix), listener=recorder)
    gate = Gate(reader)
    await reader.start()
    try:
        await reader.wait_listed()
        await until(lambda: gate.waiting == READERS, WITHIN_S)  # every reader holds one GET
        assert await reader.contains_many(list(chunks)) == [True] * count
        dest = memoryview(bytearray(CHUNK))
        assert await reader.get_into(key(0), dest)
        assert bytes(dest[:7]) == bytes(payload(0)[:7])  # checksum verified by the load
        assert recorder.covered == {} and reader.announcing == count
        # An object deleted before its read is not announced; the others are, READERS at a time.
        await obstore.delete_async(raw_store(s3_server.endpoint, prefix), object_path(key(1)))
        gate.open.set()
        await until(lambda: reader.announcing == 0, WITHIN_S)
        assert gate.most == READERS
        assert recorder.covered == {k: c for k, c in wrote.items() if k != key(1)}
        assert "undescribed" not in reader.stats().errors
    finally:
        await reader.close()


async def test_close_ends_the_reads_in_flight(
    s3_server: SeaweedServer, aws_env: dict[str, str], prefix: str
) -> None:
    await written(s3_server.endpoint, prefix, {key(i): described(i) for i in range(2 * READERS)})
    recorder = Recorder()
    reader = ObjectTier(config(s3_server.endpoint, prefix), listener=recorder)
    gate = Gate(reader)
    await reader.start()
    await reader.wait_listed()
    await until(lambda: gate.waiting == READERS, WITHIN_S)
    async with asyncio.timeout(WITHIN_S):  # the gate never opens: close must not wait for it
        await reader.close()
    assert gate.waiting == 0 and recorder.covered == {}


async def test_keys_beyond_the_backlog_bound_are_announced_by_key_alone_and_counted(
    s3_server: SeaweedServer, aws_env: dict[str, str], prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(object_announce, "MOST_WAITING", 2)
    chunks: dict[ChunkKey, Sequence[bytes]] = {key(i): described(i) for i in range(5)}
    wrote = await written(s3_server.endpoint, prefix, chunks)
    recorder = Recorder()
    reader = await started(config(s3_server.endpoint, prefix), listener=recorder)
    try:
        await reader.wait_listed()
        await until(lambda: len(recorder.covered) == len(chunks) and not reader.announcing, WITHIN_S)
        full = {k for k, c in recorder.covered.items() if c == wrote[k]}
        alone = {k for k, c in recorder.covered.items() if c == ((), b"")}
        assert len(full) == 2 and len(alone) == 3 and full | alone == set(chunks)
        assert reader.stats().errors == {"undescribed": 3}
    finally:
        await reader.close()
