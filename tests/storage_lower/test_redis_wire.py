"""kvtier's raw Redis wire reader (redis_wire.RawConnection) against a scripted server: split and
sliced replies, errors, timeouts and closed connections."""

from __future__ import annotations

import random
import socket
import threading
import time

import pytest

from kvtier.storage import codec
from kvtier.storage.base import ChunkKey
from kvtier.storage.tiers import redis_wire
from kvtier.storage.tiers.redis_wire import (
    GetOutcome,
    RawConnection,
    RawEndpoint,
    ServerReplyError,
    WireError,
)

NS = "aabbccddeeff0011"
CHUNK = 64 * 1024  # payload() repeats a 4 KiB pattern


def key(i: int) -> ChunkKey:
    return ChunkKey(NS, i.to_bytes(8, "big"))


def payload(i: int, size: int = CHUNK) -> memoryview:
    return memoryview(random.Random(i).randbytes(4096) * (size // 4096))


class ScriptedServer:
    """A loopback server that answers each request with the next scripted reply, a few bytes at a time."""

    def __init__(self, replies: list[bytes | None], piece: int = 7) -> None:
        self.replies = replies
        self.piece = piece
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            for reply in self.replies:
                if not conn.recv(65536):
                    return
                if reply is None:
                    return  # close the connection instead of answering
                for i in range(0, len(reply), self.piece):
                    conn.sendall(reply[i : i + self.piece])
                    time.sleep(0.0005)
            conn.recv(1)

    def close(self) -> None:
        self.listener.close()
        self.thread.join(timeout=5)


def raw_connection(port: int, timeout: float = 2.0) -> RawConnection:
    endpoint = RawEndpoint(host="127.0.0.1", port=port, path=None, username=None, password=None, db=0)
    conn = RawConnection(endpoint, timeout)
    conn.connect(time.monotonic() + timeout)
    return conn


def test_reader_handles_split_replies_errors_and_bad_values() -> None:
    k = key(1)
    data = bytes(payload(1))[:1000]
    blob = codec.encode(k, data)
    other = codec.encode(k, data[:10])
    replies: list[bytes | None] = [
        b"$%d\r\n%s\r\n" % (len(blob), blob),  # hit, delivered 7 bytes at a time
        b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n",
        b"$-1\r\n",
        b"$%d\r\n%s\r\n" % (len(other), other),  # valid blob of another length
        b"$3\r\nabc\r\n",  # junk
        b":1\r\n",  # not a GET reply at all: the connection is unusable
    ]
    server = ScriptedServer(replies)
    conn = raw_connection(server.port)
    try:
        dest = memoryview(bytearray(len(data)))
        deadline = time.monotonic() + 5
        assert conn.get_into(b"k", k, dest, deadline) is GetOutcome.HIT and bytes(dest) == data
        with pytest.raises(ServerReplyError, match="WRONGTYPE"):
            conn.get_into(b"k", k, dest, deadline)
        assert conn.get_into(b"k", k, dest, deadline) is GetOutcome.MISS
        assert conn.get_into(b"k", k, dest, deadline) is GetOutcome.LENGTH_MISMATCH
        assert conn.get_into(b"k", k, dest, deadline) is GetOutcome.CORRUPT
        with pytest.raises(WireError):
            conn.get_into(b"k", k, dest, deadline)
    finally:
        conn.close()
        server.close()


def test_reader_times_out_and_notices_a_closed_connection() -> None:
    k = key(2)
    dest = memoryview(bytearray(100))
    server = ScriptedServer([b"$%d\r\n" % (codec.header_size(k) + 100), None])
    conn = raw_connection(server.port, timeout=0.2)
    try:
        with pytest.raises(TimeoutError):  # the value never follows its length line
            conn.get_into(b"k", k, dest, time.monotonic() + 0.2)
    finally:
        conn.close()
        server.close()
    server = ScriptedServer([None])
    conn = raw_connection(server.port)
    try:
        with pytest.raises(WireError, match="closed"):
            conn.get_into(b"k", k, dest, time.monotonic() + 2)
        assert conn.stale()
    finally:
        conn.close()
        server.close()


def _bulk(data: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(data), data)


def _sliced_replies(blob: bytes, hsize: int, piece: int, *, atomic: bool, torn_at: int = -1) -> bytes:
    """What redis-server answers to _read_slices: the transaction, then (streamed) the slices."""
    payload_slices = [blob[hsize + off : hsize + off + piece] for off in range(0, len(blob) - hsize, piece)]
    if torn_at >= 0:
        payload_slices[torn_at] = payload_slices[torn_at][:-1]  # the value got shorter meanwhile
    inside = 3 + (len(payload_slices) if atomic else 0)
    head = b"+OK\r\n" + b"+QUEUED\r\n" * inside + b"*%d\r\n:1\r\n:%d\r\n" % (inside, len(blob))
    return head + _bulk(blob[:hsize]) + b"".join(_bulk(s) for s in payload_slices)


def test_reader_handles_split_sliced_replies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis_wire, "RANGE_PIECE", 100)
    monkeypatch.setattr(redis_wire, "WINDOW_PIECES", 100)  # every request goes out in one send
    k = key(1)
    data = bytes(payload(1))[:1000]
    blob = codec.encode(k, data)
    hsize = codec.header_size(k)
    nope = b"-NOPERM this user has no permissions to run the 'getrange' command\r\n"
    refused = b"+OK\r\n+QUEUED\r\n+QUEUED\r\n" + nope + b"-EXECABORT Transaction discarded\r\n"
    replies: list[bytes | None] = [
        _sliced_replies(blob, hsize, 100, atomic=False),  # hit, delivered 7 bytes at a time
        _sliced_replies(blob, hsize, 100, atomic=False, torn_at=3),  # torn: read again ...
        _sliced_replies(blob, hsize, 100, atomic=True),  # ... in one transaction
        refused + nope * 10,  # GETRANGE not allowed: the slices sent after EXEC are refused too
        b"$%d\r\n%s\r\n" % (len(blob), blob),  # so the connection falls back to GET
    ]
    server = ScriptedServer(replies)
    conn = raw_connection(server.port)
    try:
        deadline = time.monotonic() + 5
        for i in range(3):
            dest = memoryview(bytearray(len(data)))
            assert conn.get_into(b"k", k, dest, deadline) is GetOutcome.HIT and bytes(dest) == data
            assert conn.ranged is (i < 2)  # the third read fell back to GET for good
    finally:
        conn.close()
        server.close()
