"""ServiceClient: futures from any thread, fail-fast while down, reconnect, timeouts, close."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from concurrent.futures import InvalidStateError
from pathlib import Path
from typing import Any

import pytest

from kvtier.app import client as client_module
from kvtier.app import client_loop
from kvtier.app import protocol as p
from kvtier.app.client import (
    CallTimeout,
    ClientClosed,
    ConstantBackoff,
    HelloReply,
    ServiceClient,
    ServiceError,
    ServiceUnavailable,
    StaleInstance,
)
from kvtier.app.client_call import Call
from kvtier.app.client_connection import ClientConnection
from kvtier.app.client_results import CONVERT
from kvtier.storage.base import LookupResult, SlotList, SlotRef, Tier
from kvtier.storage.keys import namespace_id
from tests.app import SPEC, ThreadService, hashes, settings_for, thread_service, wait_until
from tests.support.leak_check import kvtier_leak_session, leak_check, no_kvtier_leaks  # noqa: F401

FAST = ConstantBackoff(0.02)


def test_full_api_against_a_service(tmp_path: Path) -> None:
    with thread_service(tmp_path) as svc, ServiceClient(svc.url) as client:
        hello = client.hello(SPEC).result(5)
        assert isinstance(hello, HelloReply) and hello.chunk_bytes == SPEC.chunk_bytes
        assert hello.arena_path.startswith(str(tmp_path)) and hello.arena_size == 4 << 20
        assert client.instance_id == hello.instance_id and client.arena == hello.arena
        ns, keys = hello.namespace, hashes(4)
        miss = client.lookup(ns, keys, "r1").result(5)
        assert miss.result == LookupResult(0, [], []) and miss.instance_id == hello.instance_id
        got = client.reserve(ns, keys).result(5)
        assert all(isinstance(s, SlotRef) for s in got.slots)
        assert client.commit(ns, keys, got.slots, got.instance_id).result(5) is None
        hit = client.lookup(ns, keys, "r0").result(5).result
        assert hit.num_hit == 4 and hit.tiers == [Tier.CPU] * 4 and hit.slots == got.slots
        assert all(type(s) is SlotRef for s in hit.slots) and hit.slots[1] == got.slots[1]
        hit = client.lookup(ns, keys[:3], "r1", replaces="r0").result(5).result  # r0 ends with it
        assert hit.num_hit == 3 and list(hit.slots) == got.slots[:3]
        assert client.stats().result(5)["leases_active"] == 1
        staged = client.stage("r1").result(5).result
        assert staged.slots == got.slots[:3] and staged.failed == []
        assert client.release("r1") is None
        spare = client.reserve(ns, hashes(2, "spare")).result(5)
        assert client.abort(spare.slots, spare.instance_id).result(5) is None
        assert client.delete(ns, keys[:1]).result(5) == 1
        assert client.clear([Tier.CPU]).result(5) == 3
        health = client.health().result(5)
        assert health.serving and health.tiers == {"cpu": True}
        stats = client.stats().result(5)
        assert set(stats["tiers"]["cpu"]) >= {"chunks", "bytes", "hits", "stores", "evictions", "errors"}
        assert stats["leases_active"] == 0 and stats["slots_in_use"] == 0


def test_lookup_slots_are_made_from_offsets_and_lengths() -> None:
    one = SlotList([0, None, 8192], 4096)
    assert len(one) == 3 and one[0] == SlotRef(0, 4096) and one[1] is None and one[-1] == SlotRef(8192, 4096)
    assert type(one[2]) is SlotRef and list(one) == [SlotRef(0, 4096), None, SlotRef(8192, 4096)]
    assert one == [SlotRef(0, 4096), None, SlotRef(8192, 4096)] and one[1:] == [None, SlotRef(8192, 4096)]
    assert one != [SlotRef(0, 4096)] and SlotList([], 0) == []
    each = SlotList([0, 4096], [4096, 2048])
    assert list(each) == [SlotRef(0, 4096), SlotRef(4096, 2048)] and each[1] == SlotRef(4096, 2048)
    with pytest.raises(IndexError):
        one[3]
    with pytest.raises(ValueError, match="2 slot offsets but 1 lengths"):
        SlotList([0, 1], [4096])


def test_lookup_slots_travel_packed_and_unpack_one_at_a_time() -> None:
    big = 5 << 40  # an offset past 4 GiB survives the packing
    packed = SlotList([0, None, big], 4096).packed
    assert packed == struct.pack("<3q", 0, -1, big)  # little-endian int64 each, -1 for no slot
    slots = SlotList.from_packed(packed, 4096)
    assert len(slots) == 3 and slots[1] is None and slots[-1] == SlotRef(big, 4096)
    assert slots[0] == SlotRef(0, 4096) and slots.offsets == [0, None, big]
    assert slots == SlotList([0, None, big], 4096) and slots.packed is packed
    each = SlotList.from_packed(struct.pack("<2q", 0, 4096), [4096, 2048])
    assert each[1] == SlotRef(4096, 2048) and list(each) == [SlotRef(0, 4096), SlotRef(4096, 2048)]
    with pytest.raises(IndexError):
        SlotList.from_packed(packed, 4096)[3]
    with pytest.raises(ValueError, match="not a multiple of 8"):
        SlotList.from_packed(packed[:-1], 4096)
    with pytest.raises(ValueError, match="3 slot offsets but 2 lengths"):
        SlotList.from_packed(packed, [4096, 4096])


def _stored_and_leased(client: ServiceClient, lease_id: str) -> tuple[str, list[bytes]]:
    """Register SPEC, store 4 chunks and lease them under lease_id; returns the namespace and keys."""
    ns, keys = client.hello(SPEC).result(5).namespace, hashes(4)
    got = client.reserve(ns, keys).result(5)
    client.commit(ns, keys, got.slots, got.instance_id).result(5)
    assert client.lookup(ns, keys, lease_id).result(5).result.num_hit == 4
    return ns, keys


def test_release_ends_the_lease_before_the_next_call(tmp_path: Path) -> None:
    with thread_service(tmp_path) as svc, ServiceClient(svc.url) as client:
        ns, keys = _stored_and_leased(client, "r1")
        assert client.release("r1") is None
        assert not client._pending  # nothing waits for an answer: none comes
        # Sent ahead of (with) the next call on the connection, so that call sees it done.
        assert client.stats().result(5)["leases_active"] == 0
        assert client.lookup(ns, keys, "r2").result(5).result.num_hit == 4
        client.release("r2")
        client.release("r2")  # idempotent
        assert client.stats().result(5)["leases_active"] == 0
        assert svc.call(lambda: svc.service.owned()) == (0, 0)


def test_release_rides_in_the_next_lookup_that_ends_no_lease(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[Any] = []
    decoder = p.request_decoder()
    write = ClientConnection.write

    def spy(conn: ClientConnection, frame: bytes | bytearray) -> bool:
        sent.extend(decoder.feed(bytes(conn.held) + bytes(frame)))  # held frames go first
        return write(conn, frame)

    with thread_service(tmp_path) as svc, ServiceClient(svc.url) as client:
        ns, keys = _stored_and_leased(client, "r1")
        monkeypatch.setattr(ClientConnection, "write", spy)
        client.release("r1")
        assert client.lookup(ns, keys, "r2").result(5).result.num_hit == 4
        # One frame: the lookup, ending r1 as its replaces.
        assert [(type(m), m.lease_id, m.replaces) for m in sent] == [(p.Lookup, "r2", "r1")]
        assert client.stats().result(5)["leases_active"] == 1
        # A lookup that ends a lease itself takes none along: the kept one goes ahead as a Release.
        del sent[:]
        client.release("r9")
        assert client.lookup(ns, keys, "r3", replaces="r2").result(5).result.num_hit == 4
        assert [(type(m), m.lease_id) for m in sent] == [(p.Release, "r9"), (p.Lookup, "r3")]
        assert sent[1].replaces == "r2" and client.stats().result(5)["leases_active"] == 1
        # One that fails to encode keeps it for the next call.
        del sent[:]
        client.release("r3")
        with pytest.raises(ServiceError):
            client.lookup(ns, [b"h" * 256] * 40_000, "r4").result(5)  # over the frame limit
        assert client.stats().result(5)["leases_active"] == 0
        assert [type(m) for m in sent] == [p.Release, p.Stats]
        assert svc.call(lambda: svc.service.owned()) == (0, 0)


def _spy_sends(monkeypatch: pytest.MonkeyPatch) -> list[list[Any]]:
    """Record the messages of each send the client makes (held frames go first)."""
    sends: list[list[Any]] = []
    decoder = p.request_decoder()
    write = ClientConnection.write

    def spy(conn: ClientConnection, frame: bytes | bytearray) -> bool:
        sends.append(decoder.feed(bytes(conn.held) + bytes(frame)))
        return write(conn, frame)

    monkeypatch.setattr(ClientConnection, "write", spy)
    return sends


def _no_sweep_for_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    """Clients made after this sweep once a minute: only callers send what is held."""
    monkeypatch.setattr(client_loop, "SWEEP_PERIOD_S", 60.0)


def test_held_lookups_wait_while_a_call_is_in_flight_and_go_out_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_sweep_for_a_while(monkeypatch)
    with thread_service(tmp_path) as svc, ServiceClient(svc.url) as client:
        ns, keys = _stored_and_leased(client, "r0")
        sends = _spy_sends(monkeypatch)
        assert client._conn is not None
        with client._conn.reading:  # nobody reads replies meanwhile: r1 stays in flight
            first = client.lookup(ns, keys, "r1", hold=True)  # nothing in flight: sent at once
            second = client.lookup(ns, keys[:2], "r2", hold=True)
            third = client.lookup(ns, keys, "r3", hold=True)
            assert [[m.lease_id for m in send] for send in sends] == [["r1"]]
        # Waiting on one sends every held frame, in one send.
        assert second.result(5).result.num_hit == 2
        assert [[m.lease_id for m in send] for send in sends] == [["r1"], ["r2", "r3"]]
        assert first.result(5).result.num_hit == 4 and third.result(5).result.num_hit == 4
        # A poll sends them too, and so does a call that is not held.
        del sends[:]
        with client._conn.reading:
            client.lookup(ns, keys, "r4", hold=True)
            polled = client.lookup(ns, keys, "r5", hold=True)
            polled.done()
            client.lookup(ns, keys, "r6", hold=True)
            stats = client.stats()
            assert [[type(m) for m in send] for send in sends] == [
                [p.Lookup],
                [p.Lookup],
                [p.Lookup, p.Stats],
            ]
        assert stats.result(5)["leases_active"] == 7  # r0-r6: every held lookup went out before it


def test_held_lookups_go_out_once_they_fill_a_send(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_sweep_for_a_while(monkeypatch)
    with thread_service(tmp_path) as svc, ServiceClient(svc.url) as client:
        ns, keys = _stored_and_leased(client, "r0")
        size = len(p.FrameEncoder().encode(p.Lookup(id=1, namespace=ns, hashes=keys, lease_id="r1")))
        monkeypatch.setattr(client_module, "HOLD_BYTES", 3 * size)
        sends = _spy_sends(monkeypatch)
        assert client._conn is not None
        with client._conn.reading:
            made = [client.lookup(ns, keys, f"r{i}", hold=True) for i in range(1, 6)]
            assert [[m.lease_id for m in send] for send in sends] == [["r1"], ["r2", "r3", "r4", "r5"]]
        assert svc.wait_for(lambda: svc.service.stats()["leases_active"] == 6)
        assert all(f.result(5).result.num_hit == 4 for f in made)


def test_a_held_lookup_nobody_waits_for_goes_out_with_the_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Held: the sweep is brought forward to go within SWEEP_PERIOD_S, whatever else is due (no
    # deadline, no idle sweep for a minute).
    monkeypatch.setattr(client_loop, "SWEEP_IDLE_PERIOD_S", 60.0)
    with thread_service(tmp_path) as svc, ServiceClient(svc.url, timeout=60) as client:
        ns, keys = _stored_and_leased(client, "r0")
        assert wait_until(lambda: client._sweep_due > time.monotonic() + 30)  # past the connect's
        assert client._conn is not None
        with client._conn.reading:
            client.lookup(ns, keys, "r1", hold=True)
            held = client.lookup(ns, keys, "r2", hold=True)
            assert client._conn.held
            assert svc.wait_for(lambda: svc.service.stats()["leases_active"] == 3)
        assert held.result(5).result.num_hit == 4


def test_release_goes_out_without_a_later_call(tmp_path: Path) -> None:
    with thread_service(tmp_path) as svc, ServiceClient(svc.url) as client:
        _stored_and_leased(client, "r1")
        client.release("r1")
        # No other call follows: the client's sweep sends it.
        assert svc.wait_for(lambda: svc.service.stats()["leases_active"] == 0)


def test_a_release_while_the_sweep_lingers_goes_out_without_waking_the_loop_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_loop, "SWEEP_LINGER_S", 60.0)
    with thread_service(tmp_path) as svc, ServiceClient(svc.url) as client:
        _stored_and_leased(client, "r1")  # its calls started the sweep
        assert wait_until(lambda: client._idle_since is not None)  # a sweep found nothing to do: it lingers
        wakes: list[Any] = []
        wake = client._loop.call_soon_threadsafe
        monkeypatch.setattr(client._loop, "call_soon_threadsafe", lambda *a: (wakes.append(a), wake(*a))[1])
        client.release("r1")
        assert svc.wait_for(lambda: svc.service.stats()["leases_active"] == 0)  # the next sweep sent it
        assert wakes == []


def test_the_sweep_stops_once_the_client_was_idle_for_its_linger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An idle period is longer than the linger: the first sweep that finds nothing to do goes on
    # (the linger starts), the next one stops.
    monkeypatch.setattr(client_loop, "SWEEP_LINGER_S", client_loop.SWEEP_IDLE_PERIOD_S / 2)
    with thread_service(tmp_path) as svc, ServiceClient(svc.url) as client:
        # Whether the sweep is still on after each of its runs, in order (set before any call arms it).
        after_runs: list[bool] = []
        stopped = threading.Event()
        sweep = client._sweep

        def recorded() -> None:
            sweep()
            after_runs.append(client._sweeping)
            if not client._sweeping:
                stopped.set()

        monkeypatch.setattr(client, "_sweep", recorded)
        assert client.health().result(5).serving
        assert stopped.wait(10)  # no wake-ups go on while nothing happens
        del after_runs[:]
        stopped.clear()
        client.release("r0")  # starts it again: it sends the release, lingers once, stops
        assert stopped.wait(10)
        assert after_runs == [True, False]


def test_a_client_with_nothing_due_leaves_its_loop_thread_asleep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every wake-up of the loop thread lands in the middle of vLLM's forward: a sweep that finds
    # nothing due comes back after SWEEP_IDLE_PERIOD_S, not SWEEP_PERIOD_S (30 wake-ups in a prefill).
    monkeypatch.setattr(client_loop, "SWEEP_IDLE_PERIOD_S", 60.0)
    with thread_service(tmp_path) as svc, ServiceClient(svc.url, timeout=60) as client:
        assert client.wait_connected(5)
        assert client.health().result(5).serving  # read by this thread: nothing due for a minute
        swept = threading.Event()
        sweep = client._sweep
        monkeypatch.setattr(client, "_sweep", lambda: (sweep(), swept.set())[0])
        client._loop.call_soon_threadsafe(client._sweep)
        assert swept.wait(5)
        assert client._sweeping  # still on: the next call needs no wake-up to start it
        assert client._sweep_due > time.monotonic() + 30  # the next one is an idle period away


def test_a_reply_nobody_read_reaches_its_call_before_the_deadline_sweep_fails_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_loop, "SWEEP_IDLE_PERIOD_S", 60.0)  # no sweep comes by itself
    with thread_service(tmp_path) as svc, ServiceClient(svc.url) as client:
        assert client.wait_connected(5)
        channel = client._conn
        assert channel is not None
        outcome: list[BaseException | None] = []
        swept = threading.Event()
        with channel.reading:  # a caller reads: the loop thread stops watching when the reply comes
            call = client.health(timeout=60)
            call.add_done_callback(lambda f: outcome.append(f.exception()))
            assert wait_until(lambda: not channel.watched)  # the reply came: it waits in the socket
            assert outcome == []
        # Its deadline passes (set, not waited for) with the reply unread; then the sweep runs.
        call.deadline = time.monotonic()
        client._loop.call_soon_threadsafe(lambda: (client._sweep(), swept.set()))
        assert swept.wait(10)
        assert outcome == [None]


def test_release_made_while_connecting_is_sent_once_connected(tmp_path: Path) -> None:
    with thread_service(tmp_path) as svc:
        with ServiceClient(svc.url) as client:
            _stored_and_leased(client, "r1")
            client.release("r1")
        assert svc.wait_for(lambda: svc.service.stats()["leases_active"] == 0)
        # The service's loop is held: a new client connects (the socket's backlog takes it) and its
        # hello waits unanswered, so the calls below are certainly made while it connects.
        assert svc.loop is not None
        held, resume = threading.Event(), threading.Event()
        svc.loop.call_soon_threadsafe(lambda: (held.set(), resume.wait(60)))
        try:
            assert held.wait(5)
            with ServiceClient(svc.url, timeout=60, connect_timeout=60) as client:
                lookup = client.lookup(namespace_id(SPEC), hashes(4), "r2")
                client.release("r2")
                assert client._state == client_loop.CONNECTING and lookup in client._queue
                resume.set()
                # Queued in order: the lookup takes the lease, the release ends it.
                assert lookup.result(5).result.num_hit == 4
                assert client.stats().result(5)["leases_active"] == 0
                assert svc.wait_for(lambda: svc.service.stats()["leases_active"] == 0)
        finally:
            resume.set()


def test_close_sends_the_releases_it_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_sweep_for_a_while(monkeypatch)
    monkeypatch.setattr(client_loop, "SWEEP_IDLE_PERIOD_S", 60.0)  # only close() can send it
    with thread_service(tmp_path) as svc:
        sends = _spy_sends(monkeypatch)
        with ServiceClient(svc.url) as client:
            _stored_and_leased(client, "r1")
            client.release("r1")
        assert [(type(m), m.lease_id) for m in sends[-1]] == [(p.Release, "r1")]
        assert svc.wait_for(lambda: svc.service.stats()["leases_active"] == 0)


def test_a_release_while_down_goes_out_once_reconnected(tmp_path: Path) -> None:
    url = f"unix://{tmp_path}/svc.sock"
    back = threading.Event()
    started: list[ThreadService] = []

    def bring_back() -> None:  # the reconnect schedule's hook: the service returns holding lease r1
        if back.is_set() and not started:
            started.append(ThreadService(url, settings_for(tmp_path)).start())
            with ServiceClient(url) as other:
                _stored_and_leased(other, "r1")

    try:
        with ServiceClient(url, backoff=FAST, on_unavailable=bring_back) as client:
            with pytest.raises(ServiceUnavailable):
                client.health().result(2)
            client.release("r1")  # kept: nothing can send it now
            back.set()
            assert client.wait_connected(10)
            (svc,) = started
            assert svc.wait_for(lambda: svc.service.stats()["leases_active"] == 0)
    finally:
        for svc in started:
            svc.stop()


def test_release_after_close_does_nothing(tmp_path: Path) -> None:
    client = ServiceClient(f"unix://{tmp_path}/none.sock", backoff=ConstantBackoff(0.5))
    client.close()
    client.release("l")
    assert not client._releases


def test_fails_fast_while_the_service_is_unreachable(tmp_path: Path) -> None:
    with ServiceClient(f"unix://{tmp_path}/none.sock", backoff=ConstantBackoff(0.5)) as client:
        with pytest.raises(ServiceUnavailable):  # the first connect attempt fails at once
            client.health().result(2)
        for _ in range(20):
            future = client.lookup("ns", hashes(2), "l")
            assert future.done()  # failed before the call returned: nothing waited on a connect
            assert isinstance(future.exception(), ServiceUnavailable)


def test_reconnects_and_registers_namespaces_again(tmp_path: Path) -> None:
    settings = settings_for(tmp_path)
    url = f"unix://{tmp_path}/svc.sock"
    seen: list[HelloReply] = []
    first = ThreadService(url, settings).start()
    try:
        with ServiceClient(url, backoff=FAST, on_connect=seen.append) as client:
            hello = client.hello(SPEC).result(5)
            keys = hashes(2)
            got = client.reserve(hello.namespace, keys).result(5)
            first.stop()
            assert wait_until(lambda: not client.connected, 5)
            with pytest.raises(ServiceUnavailable):
                client.stats().result(1)
            second = ThreadService(url, settings).start()
            try:
                assert client.wait_connected(5)
                assert client.instance_id != hello.instance_id == seen[0].instance_id
                assert seen[-1].instance_id == client.instance_id
                # The namespace is known again without another hello from the caller.
                assert client.lookup(hello.namespace, keys, "l").result(5).result.num_hit == 0
                with pytest.raises(StaleInstance):  # slots of the old instance are void
                    client.commit(hello.namespace, keys, got.slots, got.instance_id).result(5)
            finally:
                second.stop()
    finally:
        first.stop()


def test_a_report_is_told_again_after_a_reconnect(tmp_path: Path) -> None:
    settings = settings_for(tmp_path)
    url = f"unix://{tmp_path}/svc.sock"
    first = ThreadService(url, settings).start()
    try:
        with ServiceClient(url, backoff=FAST) as client:
            assert client.report("e1", "worker", False, "x" * (p.MAX_REASON_CHARS + 10)).result(5) is None
            engines = client.stats().result(5)["engines"]
            cut = "x" * p.MAX_REASON_CHARS  # cut to what the service accepts
            assert engines == [{"engine_id": "e1", "role": "worker", "active": False, "reason": cut}]
            first.stop()
            assert wait_until(lambda: not client.connected, 5)
            second = ThreadService(url, settings).start()
            try:
                assert client.wait_connected(5)
                assert client.stats().result(5)["engines"] == engines  # told without another report()
            finally:
                second.stop()
    finally:
        first.stop()


@contextlib.contextmanager
def silent_service(tmp: Path) -> Iterator[str]:
    """A unix socket that answers hello and nothing else; yields its path."""
    path = str(tmp / "silent.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen()  # before the client is made: it connects at once
    stop = threading.Event()
    server = threading.Thread(target=_silent_server, args=(srv, path, stop), daemon=True)
    server.start()
    try:
        yield path
    finally:
        stop.set()
        server.join(5)
    assert not server.is_alive(), "the silent service did not stop"


def _silent_server(srv: socket.socket, path: str, stop: threading.Event) -> None:
    """Answers hello, never anything else; checks for stop between short waits on its sockets."""
    srv.settimeout(0.05)
    conns = []
    enc, dec = p.FrameEncoder(), p.request_decoder()
    try:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
                conn.settimeout(0.05)
                conns.append(conn)
            except TimeoutError:
                pass
            for conn in conns:
                try:
                    data = conn.recv(65536)
                except TimeoutError:
                    continue
                for msg in dec.feed(data):
                    if isinstance(msg, p.Hello):
                        conn.sendall(
                            enc.encode(
                                p.HelloOk(id=msg.id, version=1, instance_id="x", arena_path="", arena_size=0)
                            )
                        )
    finally:
        for conn in conns:
            conn.close()
        srv.close()
        Path(path).unlink(missing_ok=True)


def test_every_call_has_a_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_loop, "SWEEP_IDLE_PERIOD_S", 60.0)  # deadlines bring the sweep forward
    with silent_service(tmp_path) as path, ServiceClient(f"unix://{path}", timeout=0.2) as client:
        assert client.wait_connected(5)
        patient = client.health(timeout=60)
        with pytest.raises(CallTimeout):
            client.stats().result(5)  # the client's default timeout
        with pytest.raises(CallTimeout):
            client.lookup("ns", hashes(1), "l", timeout=0.05).result(5)
        assert not patient.done(), "each call keeps its own deadline"


def test_a_reserve_answered_after_its_timeout_gives_its_slots_back(tmp_path: Path) -> None:
    with thread_service(tmp_path) as svc, ServiceClient(svc.url) as client:
        ns = client.hello(SPEC).result(5).namespace
        assert svc.loop is not None
        stalled, resume = threading.Event(), threading.Event()

        def stall() -> None:  # the service stalls, as under a SIGSTOP, until the call timed out
            stalled.set()
            resume.wait(10)

        svc.loop.call_soon_threadsafe(stall)
        assert stalled.wait(5)  # stalled before the call is sent: the service answers calls at once
        late = client.reserve(ns, hashes(3), timeout=0.05)
        with pytest.raises(CallTimeout):
            late.result(5)
        resume.set()
        # The reply comes once the service runs again; the client aborts what it reserved.
        assert wait_until(lambda: client.stats().result(5)["slots_in_use"] == 0, 5)
        assert client.stats().result(5)["calls"]["abort"] == 1


def test_close_is_idempotent_and_fails_later_calls(tmp_path: Path) -> None:
    with thread_service(tmp_path) as svc:
        client = ServiceClient(svc.url)
        assert client.wait_connected(5)
        thread = client._thread
        client.close()
        client.close()
        assert not thread.is_alive()
        with pytest.raises(ClientClosed):
            client.health().result(1)


def test_on_unavailable_hook_can_bring_the_service_back(tmp_path: Path) -> None:
    url = f"unix://{tmp_path}/svc.sock"
    started: list[ThreadService] = []

    def respawn() -> None:
        if not started:
            started.append(ThreadService(url, settings_for(tmp_path)).start())

    try:
        with ServiceClient(url, backoff=FAST, on_unavailable=respawn) as client:
            assert client.wait_connected(10)
            assert client.health().result(5).serving
        assert len(started) == 1
    finally:
        for svc in started:
            svc.stop()


def test_thread_safe_calls_from_many_threads(tmp_path: Path) -> None:
    with thread_service(tmp_path) as svc, ServiceClient(svc.url) as client:
        ns = client.hello(SPEC).result(5).namespace
        keys = hashes(8)
        got = client.reserve(ns, keys).result(5)
        client.commit(ns, keys, got.slots).result(5)
        failures: list[BaseException] = []

        def hammer(n: int) -> None:
            try:
                futures = [client.lookup(ns, keys, f"t{n}-{i}") for i in range(100)]
                assert all(f.result(10).result.num_hit == 8 for f in futures)
                for i in range(100):
                    client.release(f"t{n}-{i}")
            except BaseException as exc:
                failures.append(exc)

        threads = [threading.Thread(target=hammer, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a caller thread is still waiting"
        assert not failures, failures[:2]
        assert client.stats().result(5)["leases_active"] == 0


def test_replies_nobody_waits_for_still_complete_their_futures(tmp_path: Path) -> None:
    # Callers that wait read their own replies and the loop thread stops watching the socket
    # meanwhile; a call that is only polled, or only has a callback, must complete all the same.
    with thread_service(tmp_path) as svc, ServiceClient(svc.url) as client:
        for _ in range(20):
            assert client.health().result(5).serving
        assert svc.loop is not None
        stalled, resume = threading.Event(), threading.Event()
        svc.loop.call_soon_threadsafe(lambda: (stalled.set(), resume.wait(10)))
        assert stalled.wait(5)  # no reply before the callback is in place
        polled = client.health()
        threads: list[str] = []
        polled.add_done_callback(lambda f: threads.append(threading.current_thread().name))
        resume.set()
        assert wait_until(polled.done, 10)
        assert polled.result(0).serving
        # Completed by the client's thread: a poll never reads (each read lets go of the GIL, and
        # a thread polling in a busy loop would starve the process's other threads).
        assert threads == ["kvtier-client"]
        called = threading.Event()
        client.stats().add_done_callback(lambda f: called.set())
        assert called.wait(10)


def _wait_in_thread(future: Any, timeout: float) -> tuple[threading.Thread, list[BaseException]]:
    """A started thread blocked in future.result(timeout), and the list its exception lands in."""
    outcome: list[BaseException] = []

    def wait() -> None:
        try:
            future.result(timeout)
        except BaseException as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    return waiter, outcome


def test_close_wakes_a_caller_blocked_reading(tmp_path: Path) -> None:
    with silent_service(tmp_path) as path:
        client = ServiceClient(f"unix://{path}", timeout=60)
        assert client.wait_connected(5)
        future = client.stats()
        waiter, outcome = _wait_in_thread(future, 30)
        assert wait_until(lambda: client._conn is not None and client._conn.reading.locked(), 5)
        client.close()
        waiter.join(30)
        assert not waiter.is_alive()
        # Woken by the close, not by its 30 s timeout (that would be a TimeoutError).
        assert len(outcome) == 1 and isinstance(outcome[0], ClientClosed)


def test_a_call_waited_on_from_several_threads_completes_for_each(tmp_path: Path) -> None:
    with thread_service(tmp_path) as svc, ServiceClient(svc.url) as client:
        ns = client.hello(SPEC).result(5).namespace
        futures = [client.lookup(ns, hashes(4), f"w{i}") for i in range(50)]
        results: list[int] = []

        def wait(part: int) -> None:
            results.extend(f.result(10).result.num_hit for f in futures[part::4])

        threads = [threading.Thread(target=wait, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "a waiting thread never got its answers"
        assert results == [0] * 50


class _NoReads:
    """A call's reader that reads nothing and tells when a thread is about to wait on the call."""

    def __init__(self) -> None:
        self.waiting = threading.Event()

    def await_reply(self, call: Call, timeout: float | None) -> float | None:
        self.waiting.set()
        return timeout


def _call(reader: _NoReads | None = None) -> Call:
    return Call(reader, 1, b"", CONVERT[p.Health])


def test_a_call_is_a_future_before_and_after_it_completes() -> None:
    done = _call()
    done.set_result(7)
    seen: list[object] = []
    done.add_done_callback(lambda f: seen.append(f.result()))  # after completion: called at once
    assert seen == [7] and done.done() and done.result(0) == 7 and done.exception(0) is None
    with pytest.raises(InvalidStateError):
        done.set_result(8)

    reader = _NoReads()
    waited = _call(reader)
    waited.add_done_callback(lambda f: seen.append(f.exception()))  # before: called on completion
    waiter, raised = _wait_in_thread(waited, 10)
    assert reader.waiting.wait(5)  # the waiter asked its reader first, then waits on the future
    error = RuntimeError("no")
    setter = threading.Thread(target=waited.set_exception, args=(error,))
    setter.start()
    waiter.join(10)
    setter.join(10)
    assert not waiter.is_alive() and not setter.is_alive() and seen == [7, error] and raised == [error]
    assert waited.finished() and waited.exception(0) is error

    cancelled = _call()
    assert not cancelled.finished() and cancelled.cancel() and cancelled.cancelled() and cancelled.done()
    with pytest.raises(InvalidStateError):
        cancelled.set_result(1)
    with pytest.raises(futures.CancelledError):
        cancelled.result(0)


def test_a_wait_on_a_call_times_out_and_a_later_answer_still_lands() -> None:
    call = _call(_NoReads())
    with pytest.raises(TimeoutError):
        call.result(0.01)
    with pytest.raises(TimeoutError):
        call.exception(0)  # a poll of a pending call
    call.set_result(3)
    assert call.result(0) == 3 and call.finished() and not call.cancelled()
    assert not call.cancel()  # answered: too late to cancel


def test_a_forked_child_cannot_use_the_parents_client(tmp_path: Path) -> None:
    with thread_service(tmp_path) as svc, ServiceClient(svc.url) as client:
        assert client.health().result(5).serving
        pid = os.fork()
        if pid == 0:  # the child: the parent's connection is not its own
            code = 1
            try:
                future = client.health()
                code = 0 if future.done() and isinstance(future.exception(), ClientClosed) else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert client.health().result(5).serving  # the parent's client goes on


def test_the_sweep_leaves_alone_a_call_whose_reply_was_just_read(tmp_path: Path) -> None:
    # A caller thread pops its reply without the client's lock, possibly while the sweep runs.
    class Racing(dict[int, Call]):
        def pop(self, key: int, default: Call | None = None) -> Call | None:  # type: ignore[override]
            if key == 1:  # the reader took it between the sweep's look and its removal
                super().pop(key)
                return default
            return super().pop(key, default)

    with ServiceClient(f"unix://{tmp_path}/none.sock", backoff=ConstantBackoff(5.0)) as client:
        answered = Call(client, 1, b"", CONVERT[p.Health], deadline=0.0)
        late = Call(client, 2, b"", CONVERT[p.Health], deadline=0.0)
        with client._lock:
            client._pending = Racing({1: answered, 2: late})
            assert client._take_expired(time.monotonic()) == [late]
            assert not client._pending


def test_a_lookup_reply_with_bad_packed_slots_fails_that_call_only(tmp_path: Path) -> None:
    path = str(tmp_path / "fake.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def serve() -> None:  # a service whose lookup replies carry 7 bytes of offsets
        conn, _ = listener.accept()
        enc, dec = p.FrameEncoder(), p.request_decoder()
        with conn:
            while data := conn.recv(1 << 16):
                for msg in dec.feed(data):
                    if isinstance(msg, p.Hello):
                        reply: p.Reply = p.HelloOk(
                            id=msg.id,
                            version=p.PROTOCOL_VERSION,
                            instance_id="i",
                            arena_path="",
                            arena_size=0,
                        )
                    elif isinstance(msg, p.Lookup):
                        reply = p.LookupOk(
                            id=msg.id,
                            num_hit=1,
                            tiers=Tier.CPU,
                            offsets=b"\0" * 7,
                            lengths=4096,
                            instance_id="i",
                        )
                    else:
                        reply = p.HealthOk(id=msg.id, serving=True, instance_id="i", tiers={})
                    conn.sendall(enc.encode(reply))

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        with ServiceClient(f"unix://{path}") as client:
            assert client.wait_connected(5)
            with pytest.raises(ServiceError, match=r"bad LookupOk.*not a multiple of 8"):
                client.lookup("ns", [b"k"], "l1").result(5)
            assert client.health().result(5).serving and client.connected  # the connection goes on
    finally:
        listener.close()
        os.unlink(path)
        server.join(5)
    assert not server.is_alive(), "the fake service still serves a connection the client closed"
