"""The service's KV-event stream and the admin lookup for routers, over a real service in a thread."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from vllm.distributed import kv_events as vllm_events

from kvtier.app.admin import MAX_LOOKUP_BYTES
from kvtier.app.client import ServiceClient
from kvtier.app.events import MEDIUM
from kvtier.app.events_publisher import END_SEQ
from kvtier.app.server import _start_events
from kvtier.bench.ports import free_port
from kvtier.storage.base import Tier
from tests.app import SPEC, settings_for, thread_service

BPC = SPEC.blocks_per_chunk  # 4 blocks of 16 tokens in a chunk of 64


def _blocks(n_chunks: int, salt: str = "") -> list[bytes]:
    return [f"{salt}block-{i}".encode().ljust(32, b".") for i in range(n_chunks * BPC)]


def _chunks(blocks: list[bytes]) -> tuple[list[bytes], list[list[bytes]]]:
    """The chunk keys (hash of each chunk's last block) and each chunk's block hashes."""
    covered = [blocks[i : i + BPC] for i in range(0, len(blocks), BPC)]
    return [c[-1] for c in covered], covered


def replay_all(replay_url: str) -> dict[str, set[bytes]]:
    """A late subscriber: every batch from sequence 0 through the replay socket, applied in order."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 10_000)
    held: dict[str, set[bytes]] = {}
    try:
        dealer.connect(replay_url)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            _empty, _topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return held
            apply(held, msgspec.msgpack.decode(payload, type=vllm_events.KVEventBatch))
    finally:
        dealer.close(linger=0)
        ctx.term()


def apply(held: dict[str, set[bytes]], batch: vllm_events.KVEventBatch) -> None:
    """What a router does with a batch (vLLM's classes decode it)."""
    for event in batch.events:
        if isinstance(event, vllm_events.AllBlocksCleared):
            held.clear()
        elif isinstance(event, vllm_events.BlockStored):
            held.setdefault(event.medium or "", set()).update(event.block_hashes)
        elif isinstance(event, vllm_events.BlockRemoved):
            held.setdefault(event.medium or "", set()).difference_update(event.block_hashes)


def _post(port: int, body: bytes, path: str = "/lookup") -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method="POST")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture
def service(tmp_path: Path) -> Any:
    admin = free_port()
    env = {
        "events_url": f"ipc://{tmp_path}/events",
        "events_replay_url": f"ipc://{tmp_path}/replay",
        "events_hash_format": "bytes",
        "disk_path": str(tmp_path / "disk"),
        "admin_port": str(admin),
    }
    with thread_service(tmp_path, **env) as svc:
        yield svc, admin, f"ipc://{tmp_path}/replay"


def test_commits_deletes_and_clears_reach_a_late_subscriber(service: Any) -> None:
    svc, _admin, replay_url = service
    blocks = _blocks(3)
    keys, covered = _chunks(blocks)
    with ServiceClient(svc.url) as client:
        ns = client.hello(SPEC).result(5).namespace
        slots = client.reserve(ns, keys).result(5).slots
        client.commit(ns, keys, slots, block_hashes=covered).result(5)
        svc.call(lambda: None)
        assert svc.call(lambda: svc.service.store.flush(5.0), timeout=10)
        held = replay_all(replay_url)
        assert held == {MEDIUM[Tier.CPU]: set(blocks), MEDIUM[Tier.DISK]: set(blocks)}
        assert client.delete(ns, keys[:1]).result(5) == 1
        assert client.clear([Tier.CPU]).result(5) == 2
        held = replay_all(replay_url)
        assert held == {MEDIUM[Tier.CPU]: set(), MEDIUM[Tier.DISK]: set(blocks[BPC:])}


def test_lookup_answers_leading_blocks_per_tier_without_a_lease(service: Any) -> None:
    svc, admin, _replay = service
    blocks = _blocks(3, "L")
    keys, covered = _chunks(blocks)
    with ServiceClient(svc.url) as client:
        ns = client.hello(SPEC).result(5).namespace
        slots = client.reserve(ns, keys[:2]).result(5).slots
        client.commit(ns, keys[:2], slots, block_hashes=covered[:2]).result(5)
        assert svc.call(lambda: svc.service.store.flush(5.0), timeout=10)
        client.clear([Tier.CPU]).result(5)
        slots = client.reserve(ns, keys[:1]).result(5).slots
        client.commit(ns, keys[:1], slots).result(5)  # CPU holds chunk 0 again, disk chunks 0 and 1
        body = json.dumps({"namespace": ns, "block_hashes": [b.hex() for b in [*blocks, b"x" * 32]]})
        status, answer = _post(admin, body.encode())
        assert status == 200
        assert answer == {
            "namespace": ns,
            "blocks_per_chunk": BPC,
            "blocks": 3 * BPC + 1,
            "tiers": {"cpu": BPC, "disk": 2 * BPC},
            "held": 2 * BPC,
        }
        assert client.stats().result(5)["leases_active"] == 0
        assert client.stats().result(5)["namespace_specs"][ns]["block_size"] == SPEC.block_size


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        (b"not json", 400, "not JSON"),
        (b"[]", 400, "JSON object"),
        (b'{"namespace": "x"}', 400, "block_hashes"),
        (b'{"namespace": "x", "block_hashes": ["zz"]}', 400, "hex strings"),
        (b'{"namespace": "x", "block_hashes": [], "extra": 1}', 400, "unknown field"),
        (b'{"namespace": "x", "block_hashes": ["00000000075bcd15"]}', 400, "not the 8-byte ints"),
        (
            b'{"namespace": "x", "block_hashes": ["' + b"ab" * 32 + b'", "' + b"ab" * 16 + b'"]}',
            400,
            "one length",
        ),
        (b'{"namespace": "nope", "block_hashes": []}', 404, "unknown namespace"),
        (b'{"namespace": "nope", "block_hashes": [], "blocks_per_chunk": 0}', 400, "positive"),
    ],
)
def test_malformed_lookups_get_a_4xx_naming_the_problem(
    service: Any, body: bytes, status: int, says: str
) -> None:
    _svc, admin, _replay = service
    got, answer = _post(admin, body)
    assert got == status and says in answer["error"]


def test_oversized_lookup_and_wrong_method_are_refused(service: Any) -> None:
    _svc, admin, _replay = service
    # The answer comes from the headers alone: the body is never read.
    with socket.create_connection(("127.0.0.1", admin), timeout=10) as conn:
        conn.sendall(f"POST /lookup HTTP/1.1\r\nContent-Length: {MAX_LOOKUP_BYTES + 1}\r\n\r\n".encode())
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 ") and str(MAX_LOOKUP_BYTES).encode() in body
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{admin}/lookup", timeout=10)
        raise AssertionError("GET /lookup answered 200")
    except urllib.error.HTTPError as err:
        assert err.code == 405 and "POST" in json.loads(err.read())["error"]


def test_unknown_namespace_may_be_asked_with_its_chunk_size(service: Any) -> None:
    _svc, admin, _replay = service
    body = json.dumps({"namespace": "feed", "block_hashes": ["00" * 32] * 8, "blocks_per_chunk": 4})
    status, answer = _post(admin, body.encode())
    assert status == 200 and answer["held"] == 0 and answer["tiers"] == {"cpu": 0, "disk": 0}


def test_events_off_by_default_open_no_socket(tmp_path: Path) -> None:
    assert _start_events(settings_for(tmp_path)) is None
