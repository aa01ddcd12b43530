"""The file channel: open chunk files handed over a unix socket, refusals by name, reconnects."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.app.file_channel import (
    MAX_FILES,
    FileChannelError,
    FileClient,
    FileServer,
    channel_path,
    close_all,
)
from kvtier.storage.base import ChunkKey
from kvtier.storage.keys import disk_relpath

NS = "00112233445566ff"


def _write(root: Path, h: bytes, data: bytes) -> None:
    path = root / disk_relpath(ChunkKey(NS, h))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _server(tmp_path: Path, token: str = "") -> FileServer:
    root = str(tmp_path / "disk") + "/"
    return FileServer(
        channel_path(str(tmp_path / "kvtier.sock")), lambda key: root + disk_relpath(key), token
    )


@pytest.fixture
def server(tmp_path: Path) -> Iterator[FileServer]:
    srv = _server(tmp_path)
    yield srv
    srv.close()


def _contents(fds: list[int | None]) -> list[bytes | None]:
    try:
        return [None if fd is None else os.pread(fd, 100, 0) for fd in fds]
    finally:
        close_all(fds)


def test_files_arrive_open_and_missing_ones_as_none(server: FileServer, tmp_path: Path) -> None:
    _write(tmp_path / "disk", b"\x01", b"one")
    _write(tmp_path / "disk", b"\x03", b"three")
    client = FileClient(server.path)
    try:
        assert _contents(client.open(NS, [b"\x01", b"\x02", b"\x03"])) == [b"one", None, b"three"]
    finally:
        client.close()
    assert server.stats() == {"requests": 1, "opened": 2, "missing": 1}


def test_an_open_file_stays_readable_after_it_is_removed(server: FileServer, tmp_path: Path) -> None:
    _write(tmp_path / "disk", b"\x01", b"evicted meanwhile")
    client = FileClient(server.path)
    (fd,) = client.open(NS, [b"\x01"])
    client.close()
    (tmp_path / "disk" / disk_relpath(ChunkKey(NS, b"\x01"))).unlink()
    assert _contents([fd]) == [b"evicted meanwhile"]


def test_more_files_than_one_reply_carries_go_in_several(server: FileServer, tmp_path: Path) -> None:
    hashes = [i.to_bytes(2, "big") for i in range(MAX_FILES + 7)]
    for h in hashes[::50]:
        _write(tmp_path / "disk", h, h)
    client = FileClient(server.path)
    try:
        got = _contents(client.open(NS, hashes))
    finally:
        client.close()
    assert got == [h if i % 50 == 0 else None for i, h in enumerate(hashes)]
    assert server.stats()["requests"] == 2


@pytest.mark.parametrize(
    ("namespace", "hashes", "message"),
    [
        ("../../etc", [b"\x01"], "namespace must be 16 lowercase hex characters"),
        (NS, [b""], "every hash must be 1 to 64 bytes"),
        (NS, [b"x" * 65], "every hash must be 1 to 64 bytes"),
    ],
)
def test_bad_requests_are_refused_by_name(
    server: FileServer, namespace: str, hashes: list[bytes], message: str
) -> None:
    client = FileClient(server.path)
    try:
        with pytest.raises(FileChannelError, match=message):
            client.open(namespace, hashes)
        assert client.open(NS, [b"\x01"]) == [None]  # the connection still serves
    finally:
        client.close()


def test_a_service_with_a_token_wants_it(tmp_path: Path) -> None:
    _write(tmp_path / "disk", b"\x01", b"secret")
    server = _server(tmp_path, token="s3cret")
    try:
        wrong, good = FileClient(server.path, "wrong"), FileClient(server.path, "s3cret")
        with pytest.raises(FileChannelError, match="bad auth token"):
            wrong.open(NS, [b"\x01"])
        assert _contents(good.open(NS, [b"\x01"])) == [b"secret"]
        wrong.close()
        good.close()
    finally:
        server.close()


def test_a_client_reconnects_after_the_service_restarts(tmp_path: Path) -> None:
    _write(tmp_path / "disk", b"\x01", b"kept")
    server = _server(tmp_path)
    client = FileClient(server.path)
    assert _contents(client.open(NS, [b"\x01"])) == [b"kept"]
    server.close()
    assert not os.path.exists(server.path)
    with pytest.raises(FileChannelError):
        client.open(NS, [b"\x01"])  # the old connection is gone, and so is the socket
    server = _server(tmp_path)
    try:
        assert _contents(client.open(NS, [b"\x01"])) == [b"kept"]
    finally:
        client.close()
        server.close()


def test_a_stale_socket_file_is_replaced(tmp_path: Path) -> None:
    path = channel_path(str(tmp_path / "kvtier.sock"))
    Path(path).write_bytes(b"left by a crash")
    server = _server(tmp_path)
    client = FileClient(path)
    try:
        assert client.open(NS, [b"\x01"]) == [None]
    finally:
        client.close()
        server.close()
