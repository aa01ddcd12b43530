"""Self-describing events over a real service: the topic frame a router filters on, descriptions
sent with commits announced on every tier, kept in the disk files and announced in full again by
the index's load after a restart; a chunk committed without one is announced by hashes and counted."""

from __future__ import annotations

from pathlib import Path

import msgspec
import zmq
from vllm.distributed import kv_events as vllm_events

from kvtier.app.chunk_description import encode_description
from kvtier.app.client import ServiceClient
from kvtier.app.events import MEDIUM
from kvtier.app.events_publisher import END_SEQ
from kvtier.storage import codec
from kvtier.storage.base import ChunkKey, Tier
from kvtier.storage.keys import disk_relpath
from tests.app import SPEC, thread_service

BPC = SPEC.blocks_per_chunk  # 4 blocks of 16 tokens in a chunk of 64
TOPIC = "kv@pod-a@test-model"


def _prompt(n_chunks: int) -> tuple[list[bytes], list[list[bytes]], list[bytes], list[int]]:
    """A prompt's chunk keys, each chunk's block hashes, descriptions, and its tokens."""
    blocks = [f"described-{i}".encode().ljust(32, b".") for i in range(n_chunks * BPC)]
    tokens = list(range(1000, 1000 + n_chunks * SPEC.chunk_size))
    covered = [blocks[i : i + BPC] for i in range(0, len(blocks), BPC)]
    descriptions = [
        encode_description(
            blocks[c * BPC - 1] if c else b"", tokens[c * SPEC.chunk_size : (c + 1) * SPEC.chunk_size]
        )
        for c in range(n_chunks)
    ]
    return [c[-1] for c in covered], covered, descriptions, tokens


def _replay(replay_url: str) -> list[tuple[bytes, vllm_events.KVEventBatch]]:
    """Every batch kept, with its topic frame, through the replay socket."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 10_000)
    got = []
    try:
        dealer.connect(replay_url)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            _empty, topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return got
            got.append((topic, msgspec.msgpack.decode(payload, type=vllm_events.KVEventBatch)))
    finally:
        dealer.close(linger=0)
        ctx.term()


def _stored(
    batches: list[tuple[bytes, vllm_events.KVEventBatch]], medium: str
) -> list[vllm_events.BlockStored]:
    return [
        e
        for _topic, batch in batches
        for e in batch.events
        if isinstance(e, vllm_events.BlockStored) and e.medium == medium
    ]


def _env(tmp_path: Path) -> dict[str, str]:
    return {
        "events_url": f"ipc://{tmp_path}/events",
        "events_replay_url": f"ipc://{tmp_path}/replay",
        "events_hash_format": "bytes",
        "events_topic": TOPIC,
        "disk_path": str(tmp_path / "disk"),
    }


def _tokens_by_block(events: list[vllm_events.BlockStored]) -> dict[bytes, tuple[bytes | None, list[int]]]:
    """Per announced block: the hash of the block before it and its tokens, as a router chains them."""
    out: dict[bytes, tuple[bytes | None, list[int]]] = {}
    for e in events:
        parent = e.parent_block_hash
        for i, h in enumerate(e.block_hashes):
            out[h] = (parent, e.token_ids[i * e.block_size : (i + 1) * e.block_size])
            parent = h
    return out


def test_descriptions_are_announced_kept_on_disk_and_announced_again_after_a_restart(tmp_path: Path) -> None:
    keys, covered, descriptions, tokens = _prompt(3)
    old_key, old_blocks = b"older".ljust(32, b"."), [b"o" * 32, b"older".ljust(32, b".")]
    blocks = [h for c in covered for h in c]
    want = {h: (blocks[i - 1] if i else None, tokens[i * 16 : (i + 1) * 16]) for i, h in enumerate(blocks)}
    env = _env(tmp_path)
    for run in ("one", "two"):
        (tmp_path / run).mkdir()
    with thread_service(tmp_path / "one", **env) as svc:
        with ServiceClient(svc.url) as client:
            ns = client.hello(SPEC).result(5).namespace
            slots = client.reserve(ns, keys).result(5).slots
            client.commit(ns, keys, slots, block_hashes=covered, descriptions=descriptions).result(5)
            slots = client.reserve(ns, [old_key]).result(5).slots  # a client that sends no description
            client.commit(ns, [old_key], slots, block_hashes=[old_blocks]).result(5)
            assert svc.call(lambda: svc.service.store.flush(5.0), timeout=10)
        batches = _replay(f"ipc://{tmp_path}/replay")
        assert {topic for topic, _ in batches} == {TOPIC.encode()}
        for medium in (MEDIUM[Tier.CPU], MEDIUM[Tier.DISK]):
            events = _stored(batches, medium)
            assert [e.token_ids for e in events if e.block_hashes == old_blocks] == [[]]
            assert _tokens_by_block([e for e in events if e.token_ids]) == want
            assert {e.block_size for e in events} == {16}
        for key, version in ((keys[0], codec.DESCRIBED_VERSION), (old_key, codec.BLOB_FORMAT_VERSION)):
            with open(tmp_path / "disk" / disk_relpath(ChunkKey(ns, key)), "rb") as f:
                assert int.from_bytes(f.read(6)[4:], "little") == version
    with thread_service(tmp_path / "two", **env) as svc:
        assert svc.wait_for(lambda: not svc.service.stats()["tiers"]["disk"]["loading"], 30)
        batches = _replay(f"ipc://{tmp_path}/replay")
        events = _stored(batches, MEDIUM[Tier.DISK])
        assert _tokens_by_block([e for e in events if e.token_ids]) == want  # no engine connected yet
        assert [e.block_hashes for e in events if not e.token_ids] == [old_blocks]
        assert svc.call(lambda: svc.service.stats()["events"]) == {"dropped": 0, "undescribed": 1}


def test_a_subscriber_to_the_topic_receives_the_batches_and_one_to_another_topic_none(tmp_path: Path) -> None:
    env = _env(tmp_path)
    keys, covered, descriptions, _tokens = _prompt(1)
    ctx = zmq.Context()
    right, other = ctx.socket(zmq.SUB), ctx.socket(zmq.SUB)
    try:
        right.setsockopt(zmq.SUBSCRIBE, b"kv@")  # llm-d's subscriber: every pod's, every model's
        other.setsockopt(zmq.SUBSCRIBE, b"kv@pod-b@")
        with thread_service(tmp_path, **env) as svc:
            right.connect(env["events_url"])
            other.connect(env["events_url"])
            with ServiceClient(svc.url) as client:
                ns = client.hello(SPEC).result(5).namespace
                # A subscriber joins a PUB late (ZMQ's slow joiner): commit and delete until one arrives.
                while not right.poll(50):
                    slots = client.reserve(ns, keys).result(5).slots
                    client.commit(ns, keys, slots, block_hashes=covered, descriptions=descriptions).result(5)
                    assert client.delete(ns, keys).result(5) == 1
            topic, _seq, payload = right.recv_multipart()
            assert topic == TOPIC.encode()
            assert msgspec.msgpack.decode(payload, type=vllm_events.KVEventBatch).events
        # Every batch went out before the service stopped; the other topic's subscriber got none.
        assert other.poll(200) == 0
    finally:
        right.close(linger=0)
        other.close(linger=0)
        ctx.term()
