"""The Redis tier's fast path: GET read straight into the caller's buffer, SET sent without packing.

Who owns what: a RawConnection is used by one worker thread at a time (RawPool hands it out and keeps
the idle ones); the only cross-thread call is ``abort()``, which shuts the socket down.
Design: docs/internals.md#redis-tier-redispy-redis_wirepy-redis_poolpy
"""

from __future__ import annotations

import enum
import socket
import struct
import time
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit

from redis.asyncio.connection import parse_url

from kvtier.storage import codec
from kvtier.storage.base import BlobError, ChunkKey
from kvtier.storage.signing import Mac, Signer

T = TypeVar("T")

_READ_BUFFER = 64 * 1024
_LINE_FILL = 4096  # bytes asked for when a reply line is expected: any over-read is a tiny copy
_MAX_LINE = 64 * 1024
_DRAIN_CHUNK = 1 << 20
_MAX_DRAIN = 64 << 20
# Values above RANGE_PIECE are read in slices of that size, WINDOW_PIECES of them requested ahead
# (see RawConnection._read_slices): the next slice is copied by the server while this side receives
# the current one, and with 2 MiB of reply buffers per connection its allocator reuses them (more
# in flight brings page faults back: docs/performance.md).
RANGE_PIECE = 1 << 20
WINDOW_PIECES = 2
_MULTI = b"*1\r\n$5\r\nMULTI\r\n"
_EXEC = b"*1\r\n$4\r\nEXEC\r\n"


class WireError(Exception):
    """The connection is unusable: protocol desync, closed by the server, or an auth failure."""


class ServerReplyError(Exception):
    """The server answered with an error reply; the connection is still in sync and reusable."""


class TransactionRefused(ServerReplyError):
    """MULTI or a command queued in it was refused (disabled, or not allowed to this user)."""


class GetOutcome(enum.Enum):
    """How a GET into a buffer ended, when it did not fail."""

    HIT = "hit"
    MISS = "miss"
    CORRUPT = "corrupt"  # a value is there but it is not a valid blob of this key
    LENGTH_MISMATCH = "length_mismatch"  # a valid blob whose payload size differs from the buffer
    FORGED = "forged"  # with tier keys: unsigned, signed by an unknown key, or a wrong MAC tag
    # Internal to a ranged read: the header is of the other layout (signed or not), so the payload's
    # offset is not the one the slices asked for; one GET reads and judges it instead.
    OTHER_LAYOUT = "other_layout"


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


def _getrange(rkey: bytes, start: int, n: int) -> bytes:
    return pack_command(b"GETRANGE", rkey, b"%d" % start, b"%d" % (start + n - 1))


def _refusal(line: bytes, what: str = "") -> ServerReplyError:
    """The error for a refused MULTI or queued command: TransactionRefused when retrying cannot help."""
    text = what + line[1:].decode(errors="replace")
    if line.startswith(b"-NOPERM") or b"unknown command" in line:
        return TransactionRefused(text)
    return ServerReplyError(text)  # e.g. LOADING or BUSY: passing, keep using slices


def _int(line: bytes) -> int:
    """The number after a reply line's type byte (":12", "$5", "*3")."""
    try:
        return int(line[1:])
    except ValueError:
        raise WireError(f"bad number in reply {line[:40]!r}") from None


class RawConnection:
    """One blocking socket to one Redis server, for GET-into-buffer and zero-copy SET."""

    def __init__(self, endpoint: RawEndpoint, timeout: float, signer: Signer | None = None) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self.signer = signer  # tier keys: values written signed, read verified
        self.broken = False
        self.ranged = True  # large values by GETRANGE slices (False once the server refused it)
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
        """SET rkey to header+payload (EX ttl when ttl > 0) without joining the pieces; the header
        is signed (its MAC computed here, on the worker thread) when the connection has a signer."""
        self._deadline = deadline
        header = codec.encode_for(self.signer, key, payload)
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
        """GET rkey, receive the payload straight into dest and verify it there (its MAC too, with
        a signer: FORGED when it does not verify)."""
        self._deadline = deadline
        if dest.nbytes > RANGE_PIECE and self.ranged:
            try:
                outcome = self._get_ranged(rkey, key, dest)
            except TransactionRefused:
                self.ranged = False  # this server or user cannot: plain GETs on this connection
            else:
                if outcome is not GetOutcome.OTHER_LAYOUT:
                    return outcome
        return self._get_whole(rkey, key, dest)

    def _get_whole(self, rkey: bytes, key: ChunkKey, dest: memoryview) -> GetOutcome:
        """One GET: its length line and header (the signed layout's size: a blob of either layout is
        judged by its own) through the read buffer, the payload into dest."""
        self._send([memoryview(pack_command(b"GET", rkey))])
        line = self._read_line()
        if line[:1] == b"-":
            raise ServerReplyError(line[1:].decode(errors="replace"))
        if line == b"$-1":
            return GetOutcome.MISS
        if line[:1] != b"$":
            raise WireError(f"unexpected GET reply {line[:40]!r}")
        size = _int(line)
        want = min(size, codec.header_size(key, signed=True))
        head = bytes(self._read_small(want))
        rest = size - want  # bytes of the value still to receive
        mac = None
        try:
            header = codec.parse_header(head, key)
            outcome = _misfit(header, size, dest.nbytes)
            if outcome is None:
                mac = codec.payload_mac(self.signer, header)
        except codec.BlobForgedError:
            outcome = GetOutcome.FORGED
        except BlobError:
            outcome = GetOutcome.CORRUPT
        if outcome is not None:
            self._discard(rest + 2)
            return outcome
        early = head[header.size :]
        dest[: len(early)] = early
        self._read_into(dest[len(early) :])
        self._expect_crlf()
        return GetOutcome(codec.judge(header, mac, dest))

    def _get_ranged(self, rkey: bytes, key: ChunkKey, dest: memoryview) -> GetOutcome:
        """A large value as its header and RANGE_PIECE slices, streamed; read again whole if torn."""
        outcome = self._read_slices(rkey, key, dest, atomic=False)
        if outcome is None:
            # A slice did not match: the value changed between two commands, or it is corrupt.
            # Only a read in one transaction may tell, so nothing good is ever unlinked.
            outcome = self._read_slices(rkey, key, dest, atomic=True)
            if outcome is None:
                raise WireError("a transaction's slices disagree with its STRLEN")
        return outcome

    def _read_slices(
        self, rkey: bytes, key: ChunkKey, dest: memoryview, *, atomic: bool
    ) -> GetOutcome | None:
        """Read dest's slices of the value: None when they are not one consistent blob.

        One MULTI/EXEC answers EXISTS, STRLEN and the header slice consistently. Streamed (not
        atomic), the payload slices are separate GETRANGEs, WINDOW_PIECES in flight: redis-server
        copies the next slices while this side receives earlier ones, and no connection holds
        more than a few slices of reply buffers there. One GET of a value of 8 MiB or more instead
        makes it copy the whole value into one buffer that its allocator (jemalloc's
        oversize_threshold) maps fresh for every reply: page faults, and no overlap.
        """
        hsize = codec.header_size(key, signed=self.signer is not None)  # the layout this tier writes
        most = codec.header_size(key, signed=True)  # the header slice holds either layout's header
        offsets = range(0, dest.nbytes, RANGE_PIECE)
        slices = [_getrange(rkey, hsize + off, min(RANGE_PIECE, dest.nbytes - off)) for off in offsets]
        inside = [pack_command(b"EXISTS", rkey), pack_command(b"STRLEN", rkey), _getrange(rkey, 0, most)]
        if atomic:
            inside += slices
            sent, after = len(slices), 0
        else:
            sent = after = min(len(slices), WINDOW_PIECES)  # after: replies that follow EXEC's
        self._send([memoryview(b"".join([_MULTI, *inside, _EXEC, *slices[:after]]))])
        self._read_transaction_head(len(inside), then=after)
        exists = self._read_int(then=len(inside) - 1 + after)
        size = self._read_int(then=len(inside) - 2 + after)
        judged = _judge_head(self._read_head(key, most), hsize, size, dest.nbytes, self.signer)
        if isinstance(judged, GetOutcome):
            self._skip_replies(sent)
            return judged if exists else GetOutcome.MISS
        header, mac = judged
        hasher = codec.PayloadHasher()
        for i, off in enumerate(offsets):
            if sent < len(slices):  # keep the window full: ask for the next slice before reading
                self._send([memoryview(slices[sent])])
                sent += 1
            part = dest[off : off + RANGE_PIECE]
            line = self._read_line()
            if line != b"$%d" % part.nbytes:
                self._skip_replies(sent - i - 1, first=line)
                return None
            self._read_into(part)
            self._expect_crlf()
            hasher.update(part)  # while the slice is still in cache
            if mac is not None:
                mac.update(part)
        if hasher.intdigest() != header.checksum:
            return GetOutcome.CORRUPT if atomic else None
        try:
            codec.verify_tag(mac, header)  # the bytes are the blob's (checksum): a wrong tag is forged
        except codec.BlobForgedError:
            return GetOutcome.FORGED
        return GetOutcome.HIT

    def _read_head(self, key: ChunkKey, most: int) -> codec.BlobHeader | None:
        """The header slice's header when it is a valid header of this key, else None."""
        line = self._read_line()
        if line[:1] != b"$" or not 0 <= _int(line) <= most:
            raise WireError(f"unexpected GETRANGE reply {line[:40]!r}")
        head = bytes(self._read_small(_int(line)))
        self._expect_crlf()
        try:
            return codec.parse_header(head, key)
        except BlobError:
            return None

    def _read_transaction_head(self, queued: int, then: int) -> None:
        """Consume MULTI's +OK, the +QUEUED lines and EXEC's array header; raise if it was refused.

        then: replies to commands sent after EXEC, skipped too when raising.
        """
        line = self._read_line()
        if line != b"+OK":
            if line[:1] != b"-":
                raise WireError(f"unexpected MULTI reply {line[:40]!r}")
            # MULTI refused: the commands ran one by one and EXEC fails; consume every reply.
            self._skip_replies(queued + 1 + then)
            raise _refusal(line, "MULTI: ")
        refusal = b""
        for _ in range(queued):
            line = self._read_line()
            if line[:1] == b"-":
                refusal = refusal or line  # EXEC will answer EXECABORT
            elif line != b"+QUEUED":
                raise WireError(f"unexpected reply to a queued command {line[:40]!r}")
        line = self._read_line()
        if line[:1] == b"-":
            self._skip_replies(then)
            raise _refusal(refusal) if refusal else ServerReplyError(line[1:].decode(errors="replace"))
        if line != b"*%d" % queued:
            raise WireError(f"unexpected EXEC reply {line[:40]!r}")

    def _read_int(self, then: int) -> int:
        """An integer reply; on an error reply, skip the `then` replies that follow and raise it."""
        line = self._read_line()
        if line[:1] == b":":
            return _int(line)
        if line[:1] == b"-":
            self._skip_replies(then)
            raise ServerReplyError(line[1:].decode(errors="replace"))
        raise WireError(f"expected an integer reply, got {line[:40]!r}")

    def _skip_replies(self, count: int, first: bytes | None = None) -> None:
        """Consume count whole replies of any type (plus the one whose first line was read)."""
        line = first
        for _ in range(count + (first is not None)):
            if line is None:
                line = self._read_line()
            kind = line[:1]
            if kind == b"$" and line != b"$-1":
                n = _int(line)
                if n > _MAX_DRAIN:
                    self.broken = True
                    raise WireError("reply too large to skip")
                self._drain(n + 2)
            elif kind == b"*" and line != b"*-1":
                self._skip_replies(_int(line))
            elif kind not in (b"+", b"-", b":", b"$", b"*"):
                raise WireError(f"unexpected reply {line[:40]!r}")
            line = None

    def _discard(self, n: int) -> None:
        """Consume the rest of a value not read, or mark the connection broken when it is huge."""
        if n > _MAX_DRAIN:
            self.broken = True  # cheaper to reconnect than to read a huge foreign value to its end
        else:
            self._drain(n)

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


def _misfit(header: codec.BlobHeader, size: int, payload_len: int) -> GetOutcome | None:
    """codec.misfit for a Redis value, which never carries a trailer."""
    kind = codec.misfit(header, size, payload_len) or ("length_mismatch" if header.trailer_len else None)
    return None if kind is None else GetOutcome(kind)


def _judge_head(
    header: codec.BlobHeader | None, hsize: int, size: int, payload_len: int, signer: Signer | None
) -> tuple[codec.BlobHeader, Mac | None] | GetOutcome:
    """A ranged read's header and MAC when its slices can be read into the buffer, else why not."""
    if header is None:
        return GetOutcome.CORRUPT
    if header.blob_size == size and header.size != hsize:
        return GetOutcome.OTHER_LAYOUT
    outcome = _misfit(header, size, payload_len)
    if outcome is not None:
        return outcome
    try:
        return header, codec.payload_mac(signer, header)
    except codec.BlobForgedError:
        return GetOutcome.FORGED
