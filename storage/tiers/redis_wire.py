"""The Redis tier's fast path: GET read straight into the caller's buffer, SET sent without packing.

redis-py builds a bytes object for every GET reply and (with hiredis) copies every SET value into the
packed command; for multi-MiB chunks those copies, not the server, cap throughput. Here one blocking
socket per connection speaks just enough RESP2 for GET and SET against a single (non-cluster) server:

- SET goes out with one ``sendmsg`` of [command head, blob header, payload view, tail]: the kernel
  gathers the pieces, nothing is joined in Python.
- A GET reply's length line and blob header come through a small read buffer; the payload is received
  with ``recv_into`` straight into the destination (``MSG_WAITALL``, so the kernel fills it in as few
  system calls as it can), then verified there.

Who owns what: a RawConnection is used by one worker thread at a time (the pool hands it out); the
only cross-thread call is ``abort()``, which shuts the socket down so a blocked call returns at once.
Timeouts: the socket carries SO_RCVTIMEO/SO_SNDTIMEO of the call timeout and every loop checks an
absolute deadline, so no call blocks longer than its budget even when the event loop side gave up.
"""

from __future__ import annotations

import enum
import socket
import struct
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from redis.asyncio.connection import parse_url

from storage import codec
from storage.base import BlobError, ChunkKey

_READ_BUFFER = 64 * 1024
_LINE_FILL = 4096  # bytes asked for when a reply line is expected: any over-read is a tiny copy
_MAX_LINE = 64 * 1024
_DRAIN_CHUNK = 1 << 20
_MAX_DRAIN = 64 << 20


class WireError(Exception):
    """The connection is unusable: protocol desync, closed by the server, or an auth failure."""


class ServerReplyError(Exception):
    """The server answered with an error reply; the connection is still in sync and reusable."""


class GetOutcome(enum.Enum):
    """How a GET into a buffer ended, when it did not fail."""

    HIT = "hit"
    MISS = "miss"
    CORRUPT = "corrupt"  # a value is there but it is not a valid blob of this key
    LENGTH_MISMATCH = "length_mismatch"  # a valid blob whose payload size differs from the buffer


@dataclass(frozen=True, slots=True)
class RawEndpoint:
    """Where and how the raw connections connect; built from the tier's redis_url."""

    host: str | None
    port: int
    path: str | None
    username: str | None
    password: str | None
    db: int

    @classmethod
    def from_url(cls, url: str) -> RawEndpoint | None:
        """Endpoint of a plain redis:// or unix:// URL; None when the fast path cannot serve it."""
        scheme = urlsplit(url).scheme
        if scheme not in ("redis", "unix"):
            return None  # TLS and cluster URLs go through redis.asyncio
        kwargs = parse_url(url)
        return cls(
            host=kwargs.get("host"),
            port=int(kwargs.get("port") or 6379),
            path=kwargs.get("path"),
            username=kwargs.get("username"),
            password=kwargs.get("password"),
            db=int(kwargs.get("db") or 0),
        )


def _bulk(arg: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


def pack_command(*args: bytes) -> bytes:
    """A RESP2 command from small arguments."""
    return b"*%d\r\n" % len(args) + b"".join(_bulk(a) for a in args)


class RawConnection:
    """One blocking socket to one Redis server, for GET-into-buffer and zero-copy SET."""

    def __init__(self, endpoint: RawEndpoint, timeout: float) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self.broken = False
        self._sock: socket.socket | None = None
        self._buf = bytearray(_READ_BUFFER)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self._deadline = 0.0

    # ------------------------------------------------------------------------------------------ lifecycle
    @property
    def connected(self) -> bool:
        """True once connect() succeeded and until close()."""
        return self._sock is not None

    def connect(self, deadline: float) -> None:
        """Open the socket, then AUTH and SELECT when the URL asks for them."""
        self._deadline = deadline
        ep = self.endpoint
        budget = max(0.001, deadline - time.monotonic())
        if ep.path:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(budget)
            try:
                sock.connect(ep.path)
            except BaseException:
                sock.close()
                raise
        else:
            sock = socket.create_connection((ep.host or "127.0.0.1", ep.port), timeout=budget)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Blocking mode with kernel timeouts: MSG_WAITALL then fills a buffer in one system call.
        sock.settimeout(None)
        tv = struct.pack("ll", int(self.timeout), int((self.timeout % 1) * 1_000_000) or 1000)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        self._sock = sock
        self._start = self._end = 0
        try:
            if ep.password is not None:
                auth = [b"AUTH"] + ([ep.username.encode()] if ep.username else [])
                self._simple(pack_command(*auth, ep.password.encode()), "AUTH")
            if ep.db:
                self._simple(pack_command(b"SELECT", str(ep.db).encode()), "SELECT")
        except ServerReplyError as exc:
            self.close()
            raise WireError(f"connection setup refused: {exc}") from None

    def stale(self) -> bool:
        """True when an idle connection was closed by the server (e.g. it restarted)."""
        if self._sock is None:
            return True
        try:
            self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            return True
        return True  # EOF (b"") or unsolicited bytes: either way not a clean idle connection

    def abort(self) -> None:
        """From another thread: make a blocked send or receive return at once."""
        self.broken = True
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        """Close the socket (only from the thread that owns the connection, or when idle)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    # ------------------------------------------------------------------------------------------ commands
    def set(self, rkey: bytes, key: ChunkKey, payload: memoryview, ttl: int, deadline: float) -> None:
        """SET rkey to header+payload (EX ttl when ttl > 0) without joining the pieces."""
        self._deadline = deadline
        header = codec.encode_header(key, payload)
        nargs = 5 if ttl > 0 else 3
        head = b"*%d\r\n$3\r\nSET\r\n%s$%d\r\n" % (
            nargs,
            _bulk(rkey),
            len(header) + payload.nbytes,
        )
        tail = b"\r\n" + (_bulk(b"EX") + _bulk(str(ttl).encode()) if ttl > 0 else b"")
        self._send([memoryview(head), memoryview(header), payload, memoryview(tail)])
        line = self._read_line()
        if line[:1] == b"-":
            raise ServerReplyError(line[1:].decode(errors="replace"))
        if line != b"+OK":
            raise WireError(f"unexpected SET reply {line[:40]!r}")

    def get_into(self, rkey: bytes, key: ChunkKey, dest: memoryview, deadline: float) -> GetOutcome:
        """GET rkey, receive the payload straight into dest and verify it there."""
        self._deadline = deadline
        self._send([memoryview(pack_command(b"GET", rkey))])
        line = self._read_line()
        if line[:1] == b"-":
            raise ServerReplyError(line[1:].decode(errors="replace"))
        if line == b"$-1":
            return GetOutcome.MISS
        if line[:1] != b"$":
            raise WireError(f"unexpected GET reply {line[:40]!r}")
        try:
            size = int(line[1:])
        except ValueError:
            raise WireError(f"bad bulk length {line[:40]!r}") from None
        hsize = codec.header_size(key)
        if size != hsize + dest.nbytes:
            return self._wrong_size(key, size, hsize)
        head = bytes(self._read_small(hsize))
        try:
            header = codec.parse_header(head, key)
        except BlobError:
            self._drain(dest.nbytes + 2)
            return GetOutcome.CORRUPT
        self._read_into(dest)
        self._expect_crlf()
        try:
            codec.verify_payload(header, dest)
        except BlobError:
            return GetOutcome.CORRUPT
        return GetOutcome.HIT

    def _wrong_size(self, key: ChunkKey, size: int, hsize: int) -> GetOutcome:
        """Classify a value of unexpected size and consume it so the connection stays in sync."""
        outcome = GetOutcome.CORRUPT
        consumed = 0
        if size >= hsize:
            head = bytes(self._read_small(hsize))
            consumed = hsize
            try:
                header = codec.parse_header(head, key)
                if header.blob_size == size:
                    outcome = GetOutcome.LENGTH_MISMATCH
            except BlobError:
                pass
        if size - consumed > _MAX_DRAIN:
            self.broken = True  # cheaper to reconnect than to read a huge foreign value to its end
        else:
            self._drain(size - consumed + 2)
        return outcome

    def _simple(self, command: bytes, what: str) -> None:
        self._send([memoryview(command)])
        line = self._read_line()
        if line[:1] == b"-":
            raise ServerReplyError(f"{what}: {line[1:].decode(errors='replace')}")

    # ------------------------------------------------------------------------------------------ I/O
    def _sock_or_fail(self) -> socket.socket:
        if self._sock is None or self.broken:
            raise WireError("connection is closed")
        if time.monotonic() > self._deadline:
            raise TimeoutError("redis call exceeded its timeout")
        return self._sock

    def _send(self, parts: list[memoryview]) -> None:
        pending = [p.cast("B") for p in parts if p.nbytes]
        while pending:
            sock = self._sock_or_fail()
            try:
                sent = sock.sendmsg(pending)
            except BlockingIOError:
                raise TimeoutError("redis send timed out") from None
            while pending and sent >= pending[0].nbytes:
                sent -= pending[0].nbytes
                pending.pop(0)
            if sent:
                pending[0] = pending[0][sent:]

    def _recv(self, view: memoryview, flags: int = 0) -> int:
        sock = self._sock_or_fail()
        try:
            n = sock.recv_into(view, view.nbytes, flags)
        except BlockingIOError:
            raise TimeoutError("redis receive timed out") from None
        if n == 0:
            raise WireError("connection closed by the server")
        return n

    def _fill(self, want: int) -> None:
        """Receive at least one more byte into the read buffer (at most want)."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end + want > _READ_BUFFER:
            # Compact: move the unread tail to the front (at most one line's worth of bytes).
            tail = self._end - self._start
            self._buf[:tail] = self._buf[self._start : self._end]
            self._start, self._end = 0, tail
        room = min(want, _READ_BUFFER - self._end)
        self._end += self._recv(self._view[self._end : self._end + room])

    def _read_line(self) -> bytes:
        while True:
            idx = self._buf.find(b"\r\n", self._start, self._end)
            if idx >= 0:
                line = bytes(self._buf[self._start : idx])
                self._start = idx + 2
                return line
            if self._end - self._start >= _MAX_LINE:
                raise WireError("reply line too long")
            self._fill(_LINE_FILL)

    def _read_small(self, n: int) -> memoryview:
        """n bytes (n well under the read buffer) from the read buffer, valid until the next read."""
        while self._end - self._start < n:
            self._fill(n - (self._end - self._start))
        out = self._view[self._start : self._start + n]
        self._start += n
        return out

    def _read_into(self, dest: memoryview) -> None:
        """Fill dest: first whatever the read buffer holds, then straight from the socket."""
        have = min(self._end - self._start, dest.nbytes)
        if have:
            dest[:have] = self._view[self._start : self._start + have]
            self._start += have
        done = have
        while done < dest.nbytes:
            done += self._recv(dest[done:], socket.MSG_WAITALL)

    def _expect_crlf(self) -> None:
        if bytes(self._read_small(2)) != b"\r\n":
            raise WireError("bulk reply not terminated by CRLF")

    def _drain(self, n: int) -> None:
        scratch = bytearray(min(n, _DRAIN_CHUNK))
        view = memoryview(scratch)
        while n > 0:
            step = min(n, len(scratch))
            self._read_into(view[:step])
            n -= step
