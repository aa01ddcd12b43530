"""The file channel: a service hands open chunk files of its disk tier to engines on its host.

Who owns what: the channel's server runs a thread per connection, not the service's event loop
(opening files may block), and reads nothing of the disk tier's index.
Design: docs/internals.md#file-channel-file_channelpy
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence

import msgspec

from kvtier.app.address import bind_private
from kvtier.storage.base import ChunkKey
from kvtier.storage.keys import NAMESPACE_HEX_CHARS, chunk_keys

log = logging.getLogger(__name__)

SUFFIX = ".files"
# SCM_MAX_FD is 253 on Linux: a reply carries at most this many descriptors.
MAX_FILES = 250
MAX_HASH_BYTES = 64
_MAX_REQUEST = 64 << 10
_MAX_REPLY = 4 << 10
CALL_TIMEOUT_S = 5.0


class FileChannelError(Exception):
    """The file channel could not answer (not reachable, refused, or a malformed reply)."""


class OpenFiles(msgspec.Struct, array_like=True):
    """Request: open the disk files of these chunks of one namespace."""

    token: str
    namespace: str
    hashes: list[bytes]


class Opened(msgspec.Struct, array_like=True):
    """Reply: which files were opened (their descriptors ride along, in order), or why none were."""

    opened: list[bool]
    error: str = ""


_encode_request = msgspec.msgpack.Encoder().encode
_decode_request = msgspec.msgpack.Decoder(OpenFiles).decode
_encode_reply = msgspec.msgpack.Encoder().encode
_decode_reply = msgspec.msgpack.Decoder(Opened).decode


def channel_path(service_socket: str) -> str:
    """Where the file channel of the service listening at this unix socket path listens."""
    return service_socket + SUFFIX


def _check_request(req: OpenFiles) -> str:
    """Why a request is refused, or "" when it is well formed."""
    ns = req.namespace
    if len(ns) != NAMESPACE_HEX_CHARS or ns.strip("0123456789abcdef"):
        return f"namespace must be {NAMESPACE_HEX_CHARS} lowercase hex characters, got {ns!r}"
    if len(req.hashes) > MAX_FILES:
        return f"at most {MAX_FILES} files a request, got {len(req.hashes)}"
    if any(not 0 < len(h) <= MAX_HASH_BYTES for h in req.hashes):
        return f"every hash must be 1 to {MAX_HASH_BYTES} bytes"
    return ""


class FileServer:
    """Serves the file channel of one disk tier: a listening thread and a thread per connection."""

    def __init__(self, path: str, path_of: Callable[[ChunkKey], str], auth_token: str = "") -> None:
        self.path = path
        self._path_of = path_of
        self._token = auth_token
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._closed = False
        self.requests = 0
        self.files_opened = 0
        self.files_missing = 0
        self._sock = _listen(path)
        self._inode = os.lstat(path).st_ino
        self._acceptor = threading.Thread(target=self._accept, name="kvtier-files", daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # shut down by close()
                return
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                thread = threading.Thread(
                    target=self._serve, args=(conn,), name="kvtier-files-conn", daemon=True
                )
                self._conns[conn] = thread
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        """Answer one connection's requests until it closes; the connection is this thread's."""
        try:
            while True:
                data = conn.recv(_MAX_REQUEST)
                if not data:
                    return
                self._answer(conn, data)
        except OSError:  # the peer went away, or close() shut the connection down
            return
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _answer(self, conn: socket.socket, data: bytes) -> None:
        """Open the files a request names and send their descriptors; they are closed here after."""
        with self._lock:
            self.requests += 1
        try:
            req = _decode_request(data)
        except msgspec.DecodeError as exc:
            conn.send(_encode_reply(Opened([], f"malformed request: {exc}")))
            return
        if self._token and not hmac.compare_digest(req.token.encode(), self._token.encode()):
            conn.send(_encode_reply(Opened([], "bad auth token")))
            return
        error = _check_request(req)
        if error:
            conn.send(_encode_reply(Opened([], error)))
            return
        fds: list[int] = []
        opened: list[bool] = []
        try:
            for key in chunk_keys(req.namespace, req.hashes):
                fd = _open(self._path_of(key))
                opened.append(fd is not None)
                if fd is not None:
                    fds.append(fd)
            with self._lock:
                self.files_opened += len(fds)
                self.files_missing += len(opened) - len(fds)
            socket.send_fds(conn, [_encode_reply(Opened(opened))], fds)
        finally:
            for fd in fds:
                os.close(fd)

    def stats(self) -> dict[str, int]:
        """Requests answered and files handed out or not found."""
        return {"requests": self.requests, "opened": self.files_opened, "missing": self.files_missing}

    def close(self) -> None:
        """Stop accepting, end every connection, and remove the socket file if it is still ours."""
        with self._lock:
            self._closed = True
            conns = list(self._conns.items())
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        for conn, _ in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._acceptor.join(timeout=CALL_TIMEOUT_S)
        for _, thread in conns:
            thread.join(timeout=CALL_TIMEOUT_S)
        with contextlib.suppress(OSError):
            if os.lstat(self.path).st_ino == self._inode:
                os.unlink(self.path)


def _listen(path: str) -> socket.socket:
    """A listening SOCK_SEQPACKET socket at path, mode 0600 (a stale file there is replaced)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        bind_private(sock, path)
        sock.listen(64)
    except BaseException:
        sock.close()
        raise
    return sock


def _open(path: str) -> int | None:
    """The file opened read-only, or None when it is not there (or cannot be opened)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None


class FileClient:
    """One engine process's end of the file channel: blocking calls, each with a timeout.

    Not thread-safe: one thread (the worker's disk reader) owns it. A failed call closes the
    connection; the next call connects again.
    """

    def __init__(self, path: str, auth_token: str = "", timeout: float = CALL_TIMEOUT_S) -> None:
        self.path = path
        self._token = auth_token
        self._timeout = timeout
        self._sock: socket.socket | None = None

    def open(self, namespace: str, hashes: Sequence[bytes]) -> list[int | None]:
        """An open descriptor of each chunk's file (the caller closes them), None where it is not
        there; FileChannelError when the channel cannot answer."""
        out: list[int | None] = []
        try:
            for start in range(0, len(hashes), MAX_FILES):
                out.extend(self._call(namespace, list(hashes[start : start + MAX_FILES])))
        except BaseException:
            close_all(out)
            raise
        return out

    def _call(self, namespace: str, hashes: list[bytes]) -> list[int | None]:
        sock = self._connected()
        try:
            sock.send(_encode_request(OpenFiles(self._token, namespace, hashes)))
            data, fds, _, _ = socket.recv_fds(sock, _MAX_REPLY, MAX_FILES)
        except OSError as exc:
            self.close()
            raise FileChannelError(f"file channel {self.path}: {exc}") from exc
        try:
            reply = _decode_reply(data)
        except msgspec.DecodeError as exc:
            close_all(fds)
            self.close()
            raise FileChannelError(f"file channel {self.path}: malformed reply ({exc})") from exc
        if reply.error or len(reply.opened) != len(hashes) or sum(reply.opened) != len(fds):
            close_all(fds)
            raise FileChannelError(f"file channel {self.path}: {reply.error or 'reply does not match'}")
        given = iter(fds)
        return [next(given) if ok else None for ok in reply.opened]

    def _connected(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.settimeout(self._timeout)
            try:
                sock.connect(self.path)
            except OSError as exc:
                sock.close()
                raise FileChannelError(f"file channel {self.path}: {exc}") from exc
            self._sock = sock
        return self._sock

    def close(self) -> None:
        """Close the connection (a later call connects again)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def close_all(fds: Sequence[int | None]) -> None:
    """Close every descriptor given (None entries are skipped)."""
    for fd in fds:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
