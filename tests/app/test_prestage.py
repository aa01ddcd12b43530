"""Reads ahead: a lookup with stage set starts staging its lower-tier hits as it is answered, within
the service's prestage budget; the worker's Stage joins those reads."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvtier.app import protocol as p
from kvtier.app.client import ServiceClient
from kvtier.app.connection import Connection
from kvtier.app.metrics import build_registry
from kvtier.app.service import Service
from kvtier.app.settings import SettingsError, load_settings
from kvtier.storage.arena import Arena
from kvtier.storage.base import ChunkKey, Tier
from kvtier.storage.store import StoreConfig, TieredStore
from tests.app import SPEC as APP_SPEC
from tests.app import hashes, thread_service
from tests.storage.fakes import FakeTier
from tests.storage.store_env import CHUNK, SPEC, H, payload, until


class Peer:
    """A client connection driven by hand: dispatches calls, collects the service's replies."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.conn = Connection(service)
        service.attach(self.conn)
        self.conn.send = self._received  # type: ignore[method-assign]
        self._decoder = p.reply_decoder()
        self._replies: dict[int, Any] = {}
        self._arrived = asyncio.Event()
        self._ids = iter(range(1, 1 << 30))

    def _received(self, frame: bytes) -> None:
        for reply in self._decoder.feed(frame):
            self._replies[reply.id] = reply
        self._arrived.set()

    def send(self, make: Callable[[int], Any]) -> int:
        """Dispatch make(id) and return its id, not waiting for the reply."""
        msg = make(next(self._ids))
        self.service.dispatch(self.conn, msg)
        return int(msg.id)

    async def reply(self, req_id: int) -> Any:
        """The reply to req_id, waiting at most 5 s for it."""
        async with asyncio.timeout(5):
            while req_id not in self._replies:
                self._arrived.clear()
                await self._arrived.wait()
        return self._replies.pop(req_id)

    async def call(self, make: Callable[[int], Any]) -> Any:
        """Dispatch make(id) and wait for its reply."""
        return await self.reply(self.send(make))


class World:
    """A service over a store of a real arena and a fake disk tier, and one peer that registered SPEC."""

    def __init__(self, service: Service, disk: FakeTier, peer: Peer, ns: str) -> None:
        self.service, self.disk, self.peer, self.ns = service, disk, peer, ns
        self.store: TieredStore = service.store  # type: ignore[assignment]

    def key(self, i: int) -> ChunkKey:
        return ChunkKey(self.ns, H[i])

    def on_disk(self, *idx: int) -> None:
        for i in idx:
            self.disk.data[self.key(i)] = payload(H[i])

    async def lookup(
        self, idx: list[int], lease: str, stage: bool = True, direct_disk: bool = False
    ) -> p.LookupOk:
        hashes = [H[i] for i in idx]
        return await self.peer.call(
            lambda i: p.Lookup(
                id=i, namespace=self.ns, hashes=hashes, lease_id=lease, stage=stage, direct_disk=direct_disk
            )
        )

    @property
    def counts(self) -> dict[str, int]:
        return dict(self.service.stats()["prestage"])

    async def reads_ended(self) -> None:
        """Until no read ahead runs (its Task gone, its bytes back)."""
        await until(lambda: not self.counts["inflight_bytes"] and not self.service._prestages)

    def held(self, i: int) -> bool:
        return self.store.cpu.entry(self.key(i)) is not None


@pytest.fixture
async def make(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    """make(prestage_bytes) -> World; every store is closed, and its arena gone, after."""
    worlds: list[World] = []

    async def factory(prestage_bytes: int = 16 * CHUNK, redis: FakeTier | None = None) -> World:
        arena = Arena.create(tmp_path, 8 * CHUNK, prefault=False)
        disk = FakeTier(Tier.DISK)
        store = TieredStore(arena, [disk, *([redis] if redis else [])], StoreConfig(lease_ttl=30.0))
        service = Service(store, prestage_bytes=prestage_bytes)
        peer = Peer(service)
        hello = await peer.call(lambda i: p.Hello(id=i, version=p.PROTOCOL_VERSION, spec=SPEC))
        world = World(service, disk, peer, hello.namespace)
        worlds.append(world)
        return world

    yield factory
    for world in worlds:
        if world.disk.get_gate is not None:
            world.disk.get_gate.set()
        world.service.detach(world.peer.conn)  # its socket closing, as connection_lost would say
        await world.service.drain(1.0)
        await world.store.close(1.0)
    assert not any(tmp_path.iterdir())  # noqa: ASYNC240 (a listing of a tmp dir, after every await)


async def test_a_lookup_with_stage_promotes_its_disk_hits_without_a_stage_call(make) -> None:
    world = await make()
    world.on_disk(0, 1, 2)
    answer = await world.lookup([0, 1, 2], "r")
    assert answer.num_hit == 3 and answer.tiers == Tier.DISK
    await world.reads_ended()
    assert all(world.held(i) for i in range(3))
    assert world.disk.gets == [world.key(0), world.key(1), world.key(2)]
    assert world.service.metrics.calls["stage"] == 0
    assert world.counts == {"leases": 1, "bytes": 3 * CHUNK, "skipped": 0, "errors": 0, "inflight_bytes": 0}
    # The lease pins the promoted copies now, and no longer the disk's.
    cpu = world.store.cpu
    assert [cpu.pins_of(cpu.entry(world.key(i))) for i in range(3)] == [1, 1, 1]  # type: ignore[arg-type]
    assert not world.disk.pins


async def test_the_workers_stage_joins_the_reads_ahead_and_nothing_is_read_twice(make) -> None:
    world = await make()
    world.on_disk(0, 1)
    world.disk.get_gate = asyncio.Event()  # the reads ahead start, and wait
    await world.lookup([0, 1], "r")
    await until(lambda: len(world.disk.gets) == 2)
    stage_id = world.peer.send(lambda i: p.Stage(id=i, lease_id="r"))
    world.disk.get_gate.set()
    staged = await world.peer.reply(stage_id)
    assert isinstance(staged, p.StageOk) and staged.failed == []
    cpu = world.store.cpu
    slots = [cpu.slot_of(cpu.entry(world.key(i))) for i in range(2)]  # type: ignore[arg-type]
    assert staged.slots == slots
    assert world.disk.gets == [world.key(0), world.key(1)]  # one read each, however many asked
    again = await world.peer.call(lambda i: p.Stage(id=i, lease_id="r"))
    assert again.slots == slots and world.disk.gets == [world.key(0), world.key(1)]
    await world.reads_ended()


async def test_only_the_lower_tier_hits_count_against_the_budget(make) -> None:
    world = await make(prestage_bytes=CHUNK)
    world.on_disk(1)
    saved = world.store.reserve(world.ns, [H[0]])
    assert saved[0] is not None
    world.store.commit(world.ns, [H[0]], [saved[0]])
    answer = await world.lookup([0, 1], "r")
    assert answer.tiers == [Tier.CPU, Tier.DISK]
    await world.reads_ended()
    assert world.counts["leases"] == 1 and world.counts["bytes"] == CHUNK
    assert world.disk.gets == [world.key(1)]


async def test_the_budget_is_honoured_exactly(make) -> None:
    world = await make(prestage_bytes=3 * CHUNK)
    world.on_disk(0, 1, 2, 3, 4)
    world.disk.get_gate = asyncio.Event()
    await world.lookup([0, 1], "a")  # 2 chunks of 3
    await world.lookup([2], "b")  # 3 of 3: exactly the budget
    assert world.counts["inflight_bytes"] == 3 * CHUNK
    await world.lookup([3], "c")  # one more byte would pass it
    assert world.counts["skipped"] == 1 and world.counts["leases"] == 2
    await until(lambda: len(world.disk.gets) == 3)
    assert world.key(3) not in world.disk.gets
    world.disk.get_gate.set()
    await world.reads_ended()
    await world.lookup([4], "d")  # the bytes came back when the reads ended
    await world.reads_ended()
    assert world.counts == {"leases": 3, "bytes": 4 * CHUNK, "skipped": 1, "errors": 0, "inflight_bytes": 0}
    assert not world.held(3)  # c is read when its worker stages it, as without reads ahead
    staged = await world.peer.call(lambda i: p.Stage(id=i, lease_id="c"))
    assert staged.failed == [] and world.held(3)


async def test_a_hit_bigger_than_the_whole_budget_is_not_read_ahead(make) -> None:
    world = await make(prestage_bytes=2 * CHUNK - 1)
    world.on_disk(0, 1)
    await world.lookup([0, 1], "r")
    assert world.counts["skipped"] == 1 and world.counts["leases"] == 0
    assert not world.service._prestages and world.disk.gets == []


@pytest.mark.parametrize(("stage", "budget"), [(False, 16 * CHUNK), (True, 0)])
async def test_no_read_ahead_without_the_flag_or_with_the_budget_at_zero(
    make, stage: bool, budget: int
) -> None:
    world = await make(prestage_bytes=budget)
    world.on_disk(0)
    answer = await world.lookup([0], "r", stage=stage)
    assert answer.num_hit == 1
    assert not world.service._prestages and world.disk.gets == []
    assert world.counts == {"leases": 0, "bytes": 0, "skipped": 0, "errors": 0, "inflight_bytes": 0}


async def test_a_disk_file_reader_gets_its_disk_hits_left_and_redis_hits_read_ahead(make) -> None:
    redis = FakeTier(Tier.REDIS)
    world = await make(redis=redis)
    world.on_disk(0, 1)
    answer = await world.lookup([0, 1], "r", direct_disk=True)
    assert answer.num_hit == 2 and answer.tiers == Tier.DISK
    assert not world.service._prestages and world.disk.gets == []  # the worker reads these itself
    redis.data[world.key(2)] = payload(H[2])
    answer = await world.lookup([0, 1, 2], "r", direct_disk=True)
    assert answer.tiers == [Tier.DISK, Tier.DISK, Tier.REDIS]
    await world.reads_ended()
    # A hit with Redis chunks is read ahead whole (its disk chunks come along with the Redis one).
    assert redis.gets == [world.key(2)] and world.counts["leases"] == 1


async def test_an_engine_that_reads_disk_files_itself_gets_object_hits_read_ahead(make) -> None:
    store = FakeTier(Tier.OBJECT)
    world = await make(redis=store)
    for i in (0, 1):
        store.data[world.key(i)] = payload(H[i])
    answer = await world.lookup([0, 1], "r", direct_disk=True)
    assert answer.tiers == Tier.OBJECT
    await world.reads_ended()
    assert store.gets == [world.key(0), world.key(1)] and world.counts["leases"] == 1
    assert world.held(0) and world.held(1) and world.service.metrics.calls["stage"] == 0


async def test_a_lease_released_while_reading_ahead_keeps_no_slot_and_no_pin(make) -> None:
    world = await make()
    world.on_disk(0, 1)
    world.disk.get_gate = asyncio.Event()
    await world.lookup([0, 1], "r")
    await until(lambda: len(world.disk.gets) == 2)
    assert isinstance(await world.peer.call(lambda i: p.Release(id=i, lease_id="r")), p.OkReply)
    assert not world.disk.pins
    world.disk.get_gate.set()
    await world.reads_ended()
    stats = world.store.stats()
    assert stats.leases_active == 0
    assert stats.slots_in_use == stats.tiers["cpu"].chunks == 2  # promoted, unpinned: evictable
    cpu = world.store.cpu
    assert [cpu.pins_of(cpu.entry(world.key(i))) for i in range(2)] == [0, 0]  # type: ignore[arg-type]
    assert world.counts["errors"] == 0


async def test_drain_cancels_reads_ahead_that_do_not_end_and_returns_their_bytes(make) -> None:
    world = await make()
    world.on_disk(0)
    world.disk.get_gate = asyncio.Event()  # never opened before the drain: the read cannot end
    await world.lookup([0], "r")
    await until(lambda: len(world.disk.gets) == 1)
    world.service.detach(world.peer.conn)
    await world.service.drain(0.01)
    assert not world.service._prestages
    assert world.counts["inflight_bytes"] == 0 and world.counts["errors"] == 0
    world.disk.get_gate.set()
    await world.store.close(1.0)  # the promotion itself ends with the store: no slot outside the index
    stats = world.store.stats()
    assert stats.slots_in_use == stats.tiers["cpu"].chunks == 1 and stats.leases_active == 0


async def test_a_read_ahead_that_raises_is_counted_and_logged_not_raised(
    make, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    world = await make()
    world.on_disk(0)

    async def broken(lease_id: str) -> Any:
        raise RuntimeError(f"cannot stage {lease_id}")

    monkeypatch.setattr(world.store, "stage", broken)
    await world.lookup([0], "r")
    await world.reads_ended()
    assert world.counts["errors"] == 1 and world.counts["inflight_bytes"] == 0
    assert any("staging a lease ahead failed" in r.getMessage() for r in caplog.records)


async def test_the_prestage_figures_are_exported_to_prometheus(make) -> None:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    world = await make(prestage_bytes=CHUNK)
    world.on_disk(0, 1, 2)
    await world.lookup([0], "a")
    await world.reads_ended()
    await world.lookup([1, 2], "b")  # over the budget
    registry = build_registry(world.store.stats, world.service.metrics)
    samples = {
        s.name: s.value
        for f in text_string_to_metric_families(generate_latest(registry).decode())
        for s in f.samples
        if s.name.startswith("kvtier_prestage")
    }
    assert samples == {
        "kvtier_prestaged_leases_total": 1.0,
        "kvtier_prestaged_bytes_total": float(CHUNK),
        "kvtier_prestage_skipped_total": 1.0,
        "kvtier_prestage_errors_total": 0.0,
        "kvtier_prestage_inflight_bytes": 0.0,
    }


def test_a_client_lookup_with_stage_reads_a_real_disk_tier_ahead(tmp_path: Path) -> None:
    with (
        thread_service(tmp_path, disk_path=str(tmp_path / "disk")) as svc,
        ServiceClient(svc.url) as client,
    ):
        svc.call(lambda: setattr(svc.service, "prestage_bytes", 1 << 20))
        ns, keys = client.hello(APP_SPEC).result(5).namespace, hashes(3)
        got = client.reserve(ns, keys).result(5)
        client.commit(ns, keys, got.slots, got.instance_id).result(5)
        svc.wait_for(lambda: svc.service.store.stats().tiers["disk"].chunks == 3)
        assert client.clear([Tier.CPU]).result(5) == 3
        hit = client.lookup(ns, keys, "r", stage=True).result(5).result
        assert hit.tiers == [Tier.DISK] * 3
        svc.wait_for(lambda: svc.service.store.stats().tiers["cpu"].chunks == 3)
        stats = client.stats().result(5)
        assert stats["prestage"] == {
            "leases": 1, "bytes": 3 * APP_SPEC.chunk_bytes, "skipped": 0, "errors": 0, "inflight_bytes": 0,
        }  # fmt: skip
        assert stats["calls"]["stage"] == 0 and stats["tiers"]["disk"]["hits"] == 3
        staged = client.stage("r").result(5).result
        assert staged.failed == [] and client.stats().result(5)["tiers"]["disk"]["hits"] == 3
        client.release("r")


# ---------------------------------------------------------------------------- protocol, settings
def test_a_lookup_frame_without_the_stage_field_asks_for_no_read_ahead() -> None:
    payload_ = msgspec.msgpack.encode(["lookup", 3, "ns", [b"h"], "lease", ""])
    (msg,) = p.request_decoder().feed(struct.pack(">I", len(payload_)) + payload_)
    assert msg == p.Lookup(id=3, namespace="ns", hashes=[b"h"], lease_id="lease") and msg.stage is False


def test_prestage_limit_is_the_setting_at_most_half_the_cpu_tier() -> None:
    assert load_settings(env={}).prestage_limit == 256 << 20
    assert load_settings(env={"KVTIER_PRESTAGE_BYTES": "64MiB"}).prestage_limit == 64 << 20
    assert load_settings(env={"KVTIER_PRESTAGE_BYTES": "0"}).prestage_limit == 0
    assert load_settings(env={"KVTIER_CPU_SIZE": "256MiB"}).prestage_limit == 128 << 20


@pytest.mark.parametrize("value", ["lots", "-1"])
def test_a_bad_prestage_size_names_the_variable_and_what_is_allowed(value: str) -> None:
    with pytest.raises(SettingsError, match=rf"KVTIER_PRESTAGE_BYTES='{value}' is invalid.*e\.g\. 512MiB"):
        load_settings(env={"KVTIER_PRESTAGE_BYTES": value})
