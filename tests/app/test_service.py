"""The service over real sockets: handshake, auth, bad frames, pipelining, and ownership cleanup."""

from __future__ import annotations

import struct
import threading
from pathlib import Path
from typing import Any

import pytest

from kvtier.app import protocol as p
from kvtier.app.address import parse_url
from kvtier.app.client import ServiceClient
from kvtier.app.server import ServeError, check_bind
from kvtier.bench.ports import free_port
from kvtier.storage.arena import align_up
from kvtier.storage.base import SlotList, Tier
from kvtier.storage.keys import namespace_id
from tests.app import SPEC, RawConn, hashes, settings_for, thread_service
from tests.support.leak_check import kvtier_leak_session, leak_check, no_kvtier_leaks  # noqa: F401


def _stored(conn: RawConn, n: int) -> tuple[str, list[bytes], list[Any]]:
    """Register SPEC on conn and store n chunks (ids 1-3); their namespace, hashes and slots."""
    ns = conn.hello(spec=SPEC).namespace
    keys = hashes(n)
    got = conn.call(p.Reserve(id=2, namespace=ns, hashes=keys))
    assert conn.call(p.Commit(id=3, namespace=ns, hashes=keys, slots=got.slots)) == p.OkReply(id=3)
    return ns, keys, got.slots


def test_socket_is_owner_only_and_first_call_must_be_hello(tmp_path: Path) -> None:
    with thread_service(tmp_path) as svc:
        assert (Path(svc.url.removeprefix("unix://")).stat().st_mode & 0o777) == 0o600
        arena = svc.call(lambda: svc.service.store.arena_info().path)
        assert (Path(arena).stat().st_mode & 0o777) == 0o600
        conn = RawConn(svc.url)
        reply = conn.call(p.Stats(id=1))
        assert isinstance(reply, p.ErrorReply) and reply.code == p.ErrorCode.HELLO_REQUIRED
        assert conn.closed_by_peer()
        conn.close()


def test_version_mismatch_is_refused(tmp_path: Path) -> None:
    with thread_service(tmp_path) as svc:
        conn = RawConn(svc.url)
        reply = conn.call(p.Hello(id=1, version=p.PROTOCOL_VERSION + 1))
        assert reply.code == p.ErrorCode.VERSION and conn.closed_by_peer()
        conn.close()


def test_calls_pipeline_on_one_connection(tmp_path: Path) -> None:
    with thread_service(tmp_path) as svc:
        conn = RawConn(svc.url)
        ns = conn.hello(spec=SPEC).namespace
        keys = hashes(8)
        reserved = conn.call(p.Reserve(id=10, namespace=ns, hashes=keys))
        assert conn.call(p.Commit(id=11, namespace=ns, hashes=keys, slots=reserved.slots)) == p.OkReply(id=11)
        ids = list(range(100, 140))
        for i in ids:  # all sent before any reply is read
            conn.send(p.Lookup(id=i, namespace=ns, hashes=keys, lease_id=f"l{i}"))
        replies = [conn.recv() for _ in ids]
        assert sorted(r.id for r in replies) == ids
        assert all(r.num_hit == 8 for r in replies)
        conn.close()


class _Writes:
    """A transport stand-in that records each write and passes it on to the real transport."""

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.sizes: list[int] = []

    def write(self, data: bytes) -> None:
        """Record, then write."""
        self.sizes.append(len(data))
        self.transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


def test_calls_that_arrive_in_one_read_are_answered_in_one_write(tmp_path: Path) -> None:
    with thread_service(tmp_path) as svc:
        conn = RawConn(svc.url)
        conn.hello()
        (server_side,) = svc.call(lambda: list(svc.service.connections))
        writes = _Writes(server_side.transport)
        svc.call(lambda: setattr(server_side, "transport", writes))
        enc = p.FrameEncoder()
        burst = [p.Health(id=i) for i in range(20, 26)]
        conn.sock.sendall(b"".join(enc.encode(m) for m in burst))  # one small send: one read there
        replies = [conn.recv() for _ in burst]
        assert [r.id for r in replies] == [m.id for m in burst]
        assert all(isinstance(r, p.HealthOk) for r in replies)
        assert svc.call(lambda: writes.sizes) == [sum(len(enc.encode(r)) for r in replies)]
        assert conn.call(p.Health(id=30)).id == 30  # a lone call is written at once, as before
        assert svc.call(lambda: len(writes.sizes)) == 2
        conn.close()


def test_a_refusal_in_a_burst_is_answered_before_the_connection_closes(tmp_path: Path) -> None:
    with thread_service(tmp_path) as svc:
        conn = RawConn(svc.url)
        enc = p.FrameEncoder()
        conn.sock.sendall(enc.encode(p.Stats(id=1)) + enc.encode(p.Health(id=2)))  # no hello first
        reply = conn.recv()
        assert isinstance(reply, p.ErrorReply) and reply.code == p.ErrorCode.HELLO_REQUIRED
        assert conn.closed_by_peer() and not conn.pending  # the call behind it was not served
        conn.close()


def test_a_call_behind_one_in_flight_waits_its_turn(tmp_path: Path) -> None:
    # Calls are answered at once only when nothing of their connection is in flight: behind a
    # stage (a Task), a reserve pipelined right behind the hello that registers its namespace
    # must still find it.
    with thread_service(tmp_path) as svc:
        conn = RawConn(svc.url)
        conn.hello()
        ns = namespace_id(SPEC)
        enc = p.FrameEncoder()
        burst = [
            p.Stage(id=19, lease_id="none"),
            p.Hello(id=20, version=p.PROTOCOL_VERSION, spec=SPEC),
            p.Reserve(id=21, namespace=ns, hashes=hashes(2)),
        ]
        conn.sock.sendall(b"".join(enc.encode(m) for m in burst))  # one read: all queued at once
        replies = {r.id: r for r in (conn.recv(), conn.recv(), conn.recv())}
        assert replies[19].slots == [] and replies[20].namespace == ns
        assert isinstance(replies[21], p.ReserveOk) and all(replies[21].slots)
        conn.close()


def test_a_release_that_wants_no_reply_ends_the_lease_in_order_and_answers_nothing(
    tmp_path: Path,
) -> None:
    with thread_service(tmp_path) as svc:
        conn = RawConn(svc.url)
        ns, keys, _ = _stored(conn, 4)
        assert conn.call(p.Lookup(id=4, namespace=ns, hashes=keys, lease_id="r1")).num_hit == 4
        assert svc.call(lambda: svc.service.stats()["leases_active"]) == 1
        # In one write, as the client sends a held release with its next call: the release is
        # served first, and the only reply is the stats call's.
        enc = p.FrameEncoder()
        conn.sock.sendall(enc.encode(p.Release(id=5, lease_id="r1", reply=False)) + enc.encode(p.Stats(id=6)))
        stats = conn.recv()
        assert stats.id == 6 and stats.stats["leases_active"] == 0
        assert svc.call(lambda: svc.service.owned()) == (0, 0)
        assert conn.call(p.Health(id=7)).id == 7  # nothing else came in between
        conn.close()


def test_a_lookup_ends_the_lease_it_replaces_even_when_it_fails(tmp_path: Path) -> None:
    with thread_service(tmp_path) as svc:
        conn = RawConn(svc.url)
        ns, keys, slots = _stored(conn, 4)
        conn.call(p.Lookup(id=4, namespace=ns, hashes=keys, lease_id="r1"))
        reply = conn.call(p.Lookup(id=5, namespace=ns, hashes=keys[:2], lease_id="r2", replaces="r1"))
        assert reply.num_hit == 2 and reply.tiers is Tier.CPU
        assert SlotList.from_packed(reply.offsets, reply.lengths) == slots[:2]
        assert svc.call(lambda: svc.service.owned()) == (1, 0)  # r2 only
        assert svc.call(lambda: svc.service.stats()["leases_active"]) == 1
        # A lookup the service refuses (unknown namespace) still ends the lease it replaces.
        refused = conn.call(p.Lookup(id=6, namespace="0" * 16, hashes=keys, lease_id="r3", replaces="r2"))
        assert isinstance(refused, p.ErrorReply) and refused.code == p.ErrorCode.UNKNOWN_NAMESPACE
        assert svc.call(lambda: svc.service.owned()) == (0, 0)
        assert svc.call(lambda: svc.service.stats()["leases_active"]) == 0
        # Likewise on the Task path: queued behind a stage that is still in flight.
        conn.call(p.Lookup(id=7, namespace=ns, hashes=keys, lease_id="r4"))
        enc = p.FrameEncoder()
        refused_later = p.Lookup(id=9, namespace="0" * 16, hashes=keys, lease_id="r5", replaces="r4")
        conn.sock.sendall(enc.encode(p.Stage(id=8, lease_id="r4")) + enc.encode(refused_later))
        replies = {r.id: r for r in (conn.recv(), conn.recv())}
        assert replies[9].code == p.ErrorCode.UNKNOWN_NAMESPACE
        assert svc.call(lambda: svc.service.owned()) == (0, 0)
        assert svc.call(lambda: svc.service.stats()["leases_active"]) == 0
        conn.close()


def test_a_release_that_wants_no_reply_answers_nothing_behind_a_call_in_flight(tmp_path: Path) -> None:
    # Queued behind a stage (a Task), the release runs as a Task: still no reply.
    with thread_service(tmp_path) as svc:
        conn = RawConn(svc.url)
        conn.hello()
        enc = p.FrameEncoder()
        burst = [p.Stage(id=20, lease_id="gone"), p.Release(id=21, lease_id="gone", reply=False)]
        conn.sock.sendall(b"".join(enc.encode(m) for m in [*burst, p.Release(id=22, lease_id="gone")]))
        assert [conn.recv().id, conn.recv().id] == [20, 22]
        assert conn.call(p.Health(id=23)).id == 23
        conn.close()


@pytest.mark.parametrize(
    "garbage",
    [
        struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1",  # malformed msgpack
        struct.pack(">I", p.MAX_FRAME_BYTES + 1),  # oversized header, no body needed
    ],
    ids=["malformed", "oversized"],
)
def test_bad_frame_closes_only_that_connection(tmp_path: Path, garbage: bytes) -> None:
    with thread_service(tmp_path) as svc:
        good, bad = RawConn(svc.url), RawConn(svc.url)
        good.hello()
        bad.hello()
        bad.sock.sendall(garbage)
        assert bad.closed_by_peer()
        assert isinstance(good.call(p.Health(id=7)), p.HealthOk)
        kinds = svc.call(lambda: dict(svc.service.metrics.protocol_errors))
        assert sum(kinds.values()) == 1
        good.close()
        bad.close()


def test_tcp_auth_token_required_and_compared_in_constant_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvtier.app.service

    compared: list[tuple[bytes, bytes]] = []
    real = kvtier.app.service.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(kvtier.app.service.hmac, "compare_digest", spy)
    url = f"tcp://127.0.0.1:{free_port()}"
    with thread_service(tmp_path, url=url, auth_token="tok-Ünïcode-42"):
        for token in ("", "wrong", "tok-Ünïcode-4"):
            conn = RawConn(url)
            reply = conn.hello(token=token)
            assert reply.code == p.ErrorCode.AUTH and conn.closed_by_peer()
            assert "tok-" not in reply.message
            conn.close()
        with ServiceClient(url, "tok-Ünïcode-42") as client:
            assert client.health().result(5).serving
    right = "tok-Ünïcode-42".encode()
    tried = [t.encode() for t in ("", "wrong", "tok-Ünïcode-4")] + [right]
    assert compared[: len(tried)] == [(t, right) for t in tried]  # every hello, as bytes


def test_non_loopback_tcp_requires_a_token(tmp_path: Path) -> None:
    with pytest.raises(ServeError, match="KVTIER_AUTH_TOKEN"):
        check_bind(parse_url("tcp://0.0.0.0:7711"), settings_for(tmp_path))
    check_bind(parse_url("tcp://0.0.0.0:7711"), settings_for(tmp_path, auth_token="t0ken"))
    check_bind(parse_url("tcp://127.0.0.1:7711"), settings_for(tmp_path))
    check_bind(parse_url("tcp://[::1]:7711"), settings_for(tmp_path))


@pytest.mark.parametrize("with_block_hashes", [False, True], ids=["plain", "block-hashes"])
def test_a_dropped_connection_gives_back_its_reserved_slots_not_its_leases(
    tmp_path: Path, with_block_hashes: bool
) -> None:
    with thread_service(tmp_path) as svc:
        conn = RawConn(svc.url)
        ns = conn.hello(spec=SPEC).namespace
        stored = hashes(4, "stored")
        got = conn.call(p.Reserve(id=2, namespace=ns, hashes=stored))
        # A commit that names each chunk's block hashes (the connector's) gives its slots up as well.
        covered = [[h[:16], h] for h in stored] if with_block_hashes else []
        commit = p.Commit(id=3, namespace=ns, hashes=stored, slots=got.slots, block_hashes=covered)
        assert conn.call(commit) == p.OkReply(id=3)
        assert svc.call(lambda: svc.service.owned())[1] == 0
        assert conn.call(p.Lookup(id=4, namespace=ns, hashes=stored, lease_id="r1")).num_hit == 4
        pending = conn.call(p.Reserve(id=5, namespace=ns, hashes=hashes(3, "pending")))
        assert all(pending.slots)
        stats = svc.call(lambda: svc.service.stats())
        assert (stats["leases_active"], stats["slots_in_use"]) == (1, 7)
        conn.close()
        stats = svc.wait_for(lambda: (s := svc.service.stats())["slots_in_use"] == 4 and s)
        assert stats and stats["tiers"]["cpu"]["chunks"] == 4
        assert svc.call(lambda: svc.service.owned()) == (1, 0)  # the lease ends by release or expiry
        with RawConn(svc.url) as other:
            other.hello()
            assert other.call(p.Release(id=2, lease_id="r1")) == p.OkReply(id=2)
        assert svc.call(lambda: svc.service.owned()) == (0, 0)


def test_a_lease_outlives_the_scheduler_connection_while_the_worker_copies(tmp_path: Path) -> None:
    # The scheduler's connection takes a lease (lookup) and hands its slots to the worker, which
    # copies from them without a call; the scheduler's connection drops meanwhile. The chunks must
    # stay where they are until the worker releases the lease: no new save may get their slots.
    with thread_service(tmp_path, cpu_size="1MiB") as svc:
        sched, worker = RawConn(svc.url), RawConn(svc.url)
        ns = sched.hello(spec=SPEC).namespace
        worker.hello(spec=SPEC)
        keys = hashes(4, "prompt")
        got = sched.call(p.Reserve(id=2, namespace=ns, hashes=keys))
        assert sched.call(p.Commit(id=3, namespace=ns, hashes=keys, slots=got.slots)) == p.OkReply(id=3)
        lease = "e1:req-1:1"
        hit = sched.call(p.Lookup(id=4, namespace=ns, hashes=keys, lease_id=lease))
        leased = set(SlotList.from_packed(hit.offsets, hit.lengths).offsets)
        assert hit.num_hit == 4 and len(leased) == 4
        sched.close()
        assert svc.wait_for(lambda: svc.service.connection_count == 1)
        assert svc.call(lambda: svc.service.stats()["leases_active"]) == 1
        # A save big enough to evict every chunk it may: the leased four stay, slots and all.
        room = svc.call(lambda: svc.service.stats()["tiers"]["cpu"]["capacity"]) // align_up(SPEC.chunk_bytes)
        fill = worker.call(p.Reserve(id=5, namespace=ns, hashes=hashes(room, "fill"))).slots
        granted = [s for s in fill if s is not None]
        assert len(granted) == room - 4 and leased.isdisjoint(s[0] for s in granted)
        assert worker.call(p.Abort(id=6, slots=granted)) == p.OkReply(id=6)
        # The worker's copy is done: its release ends the lease, and the chunks may go.
        assert worker.call(p.Release(id=7, lease_id=lease)) == p.OkReply(id=7)
        assert svc.call(lambda: svc.service.stats()["leases_active"]) == 0
        fill = worker.call(p.Reserve(id=8, namespace=ns, hashes=hashes(room, "fill"))).slots
        assert all(fill) and leased <= {s[0] for s in fill}
        worker.call(p.Abort(id=9, slots=fill))
        worker.close()


def test_reports_are_listed_as_engines_while_their_connection_is_open(tmp_path: Path) -> None:
    with thread_service(tmp_path) as svc:
        sched, worker = RawConn(svc.url), RawConn(svc.url)
        sched.hello()
        worker.hello()
        active = p.Report(id=2, engine_id="e1", role="scheduler", active=True)
        refused = p.Report(id=2, engine_id="e1", role="worker", active=False, reason="KV layout refused")
        assert sched.call(active) == p.OkReply(id=2) and worker.call(refused) == p.OkReply(id=2)
        stats = sched.call(p.Stats(id=3)).stats
        assert stats["engines"] == [
            {"engine_id": "e1", "role": "scheduler", "active": True, "reason": ""},
            {"engine_id": "e1", "role": "worker", "active": False, "reason": "KV layout refused"},
        ]
        assert stats["calls"]["report"] == 2
        # A later report of the connection replaces its earlier one.
        assert worker.call(p.Report(id=4, engine_id="e1", role="worker", active=True)) == p.OkReply(id=4)
        assert [e["active"] for e in sched.call(p.Stats(id=5)).stats["engines"]] == [True, True]
        worker.close()
        remaining = svc.wait_for(lambda: len(svc.service.stats()["engines"]) == 1)
        assert remaining and svc.call(svc.service.engines) == [
            {"engine_id": "e1", "role": "scheduler", "active": True, "reason": ""}
        ]
        sched.close()
        assert svc.wait_for(lambda: svc.service.engines() == [])


def test_commit_checks_instance_and_reservation(tmp_path: Path) -> None:
    with thread_service(tmp_path) as svc:
        conn = RawConn(svc.url)
        hello = conn.hello(spec=SPEC)
        keys = hashes(2)
        slots = conn.call(p.Reserve(id=2, namespace=hello.namespace, hashes=keys)).slots
        stale = conn.call(
            p.Commit(id=3, namespace=hello.namespace, hashes=keys, slots=slots, instance_id="not-this-one")
        )
        assert stale.code == p.ErrorCode.STALE_INSTANCE
        bogus = [(1 << 30, 2048), slots[1]]
        reply = conn.call(
            p.Commit(id=4, namespace=hello.namespace, hashes=keys, slots=bogus, instance_id=hello.instance_id)
        )
        assert reply.code == p.ErrorCode.BAD_REQUEST and "1 of 2" in reply.message
        assert conn.call(p.Abort(id=5, slots=slots)) == p.OkReply(id=5)  # the unreserved one: no-op
        unknown = conn.call(p.Lookup(id=6, namespace="feedfacefeedface", hashes=keys, lease_id="x"))
        assert unknown.code == p.ErrorCode.UNKNOWN_NAMESPACE
        assert svc.call(lambda: svc.service.stats()["slots_in_use"]) == 1
        conn.close()


def test_a_commit_from_another_connection_takes_the_slots_over(tmp_path: Path) -> None:
    with thread_service(tmp_path) as svc:
        first, second = RawConn(svc.url), RawConn(svc.url)
        ns = first.hello(spec=SPEC).namespace
        second.hello(spec=SPEC)
        keys = hashes(4)
        mine = first.call(p.Reserve(id=2, namespace=ns, hashes=keys[:2])).slots
        theirs = second.call(p.Reserve(id=2, namespace=ns, hashes=keys[2:])).slots
        assert second.call(p.Commit(id=3, namespace=ns, hashes=keys, slots=mine + theirs)) == p.OkReply(id=3)
        assert svc.call(lambda: svc.service.owned()) == (0, 0)
        first.close()  # it owns nothing any more: its slots stay committed
        second.close()
        assert svc.wait_for(lambda: svc.service.connection_count == 0)
        stats = svc.call(lambda: svc.service.stats())
        assert stats["slots_in_use"] == 4 and stats["tiers"]["cpu"]["chunks"] == 4


def test_many_concurrent_clients(tmp_path: Path) -> None:
    errors: list[BaseException] = []
    with thread_service(tmp_path, cpu_size="16MiB") as svc:

        def client_run(n: int) -> None:
            try:
                with ServiceClient(svc.url) as client:
                    ns = client.hello(SPEC).result(10).namespace
                    keys = hashes(16, f"c{n}")
                    for _ in range(5):
                        got = client.reserve(ns, keys).result(10)
                        ready = [(h, s) for h, s in zip(keys, got.slots, strict=True) if s]
                        if ready:
                            client.commit(
                                ns, [h for h, _ in ready], [s for _, s in ready], got.instance_id
                            ).result(10)
                        futures = [client.lookup(ns, keys, f"c{n}-{i}") for i in range(10)]
                        assert all(f.result(10).result.num_hit == 16 for f in futures)
                        for i in range(10):
                            client.release(f"c{n}-{i}")
                    client.health().result(10)  # answered once the releases sent ahead of it are done
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=client_run, args=(n,)) for n in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a client thread never finished"
        assert not errors, errors[:3]
        stats = svc.wait_for(lambda: (s := svc.service.stats())["connections"] == 0 and s)
        assert stats["leases_active"] == 0
        assert stats["tiers"]["cpu"]["chunks"] == 16 * 16 == stats["slots_in_use"]
