"""KV events: vLLM's encoding byte for byte, the recorder's bookkeeping, the publisher's framing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio
from vllm.distributed import kv_events as vllm_events

from kvtier.app.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventRecorder,
    KVEventBatch,
    external_hash,
)
from kvtier.app.events_publisher import END_SEQ, EventPublisher
from kvtier.storage.base import ChunkKey, NamespaceSpec, Tier

H1, H2, H3 = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32


def _vllm_decode(payload: bytes) -> vllm_events.KVEventBatch:
    return msgspec.msgpack.decode(payload, type=vllm_events.KVEventBatch)


# ---------------------------------------------------------------------------------------------- encoding
def test_batches_encode_exactly_as_vllms_and_decode_with_its_classes() -> None:
    ours = KVEventBatch(
        12.5,
        [
            BlockStored([1, 2], None, [], 16, None, "CPU_KVTIER", None, "kvtier"),
            BlockRemoved([H1], "DISK", "kvtier"),
            AllBlocksCleared(),
        ],
    )
    theirs = vllm_events.KVEventBatch(
        ts=12.5,
        events=[
            vllm_events.BlockStored(
                block_hashes=[1, 2],
                parent_block_hash=None,
                token_ids=[],
                block_size=16,
                lora_id=None,
                medium="CPU_KVTIER",
                lora_name=None,
                ownership="kvtier",
            ),
            vllm_events.BlockRemoved(block_hashes=[H1], medium="DISK", ownership="kvtier"),
            vllm_events.AllBlocksCleared(),
        ],
    )
    payload = msgspec.msgpack.encode(ours)
    assert payload == msgspec.msgpack.encode(theirs)
    decoded = _vllm_decode(payload)
    assert decoded == theirs
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(theirs), type=KVEventBatch) == ours


def test_external_hash_is_vllms_int_conversion_or_the_bytes() -> None:
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    block_hash = bytes(range(32))
    assert external_hash(block_hash, "int") == maybe_convert_block_hash(block_hash)  # vLLM's default
    assert external_hash(block_hash, "bytes") == block_hash


# ---------------------------------------------------------------------------------------------- recorder
def _recorder(fmt: str = "bytes") -> tuple[EventRecorder, list[KVEventBatch]]:
    batches: list[KVEventBatch] = []
    return EventRecorder(batches.append, fmt), batches  # type: ignore[arg-type]


def _events(batches: list[KVEventBatch]) -> list[object]:
    return [e for b in batches for e in b.events]


def test_recorder_announces_each_block_hash_once_per_medium() -> None:
    rec, batches = _recorder()
    rec.namespaces = {
        "a": NamespaceSpec("m", "bf16", "x", block_size=16, chunk_size=32, num_layers=1, page_bytes=8)
    }
    ka, kb = ChunkKey("a", H2), ChunkKey("b", H2)  # two namespaces (e.g. TP ranks), the same blocks
    rec.stored(Tier.CPU, [ka], [[H1, H2]])
    rec.stored(Tier.CPU, [kb], [[H1, H2]])
    rec.stored(Tier.CPU, [ka], [[H1, H2]])  # told again: nothing new
    rec.stored(Tier.DISK, [ka], [()])  # no hashes at hand: those the CPU tier named
    rec.removed(Tier.CPU, [ka])  # kb still holds them in CPU
    rec.removed(Tier.CPU, [kb])
    rec.removed(Tier.CPU, [kb])  # no longer held: ignored
    rec.flush()  # outside a loop every call went out at once
    assert _events(batches) == [
        BlockStored([H1, H2], None, [], 16, None, "CPU_KVTIER", None, "kvtier"),
        BlockStored([H1, H2], None, [], 16, None, "DISK", None, "kvtier"),
        BlockRemoved([H1, H2], "CPU_KVTIER", "kvtier"),
    ]
    assert rec.held_hashes(Tier.DISK) == {H1, H2}
    assert rec.held_hashes(Tier.CPU) == set()


def test_recorder_names_a_chunk_without_known_hashes_by_its_key() -> None:
    rec, batches = _recorder("int")
    rec.stored(Tier.REDIS, [ChunkKey("n", H3)], [()])
    assert _events(batches) == [
        BlockStored([external_hash(H3, "int")], None, [], 0, None, "REDIS", None, "kvtier")
    ]


def test_cleared_all_forgets_every_medium_and_says_so() -> None:
    rec, batches = _recorder()
    rec.stored(Tier.DISK, [ChunkKey("n", H2)], [[H1, H2]])
    rec.cleared_all()
    assert _events(batches)[-1] == AllBlocksCleared()
    assert rec.held_hashes(Tier.DISK) == set()
    rec.cleared(Tier.CPU)  # nothing held: nothing said
    assert len(_events(batches)) == 2


async def test_recorder_sends_one_batch_per_turn_of_the_loop() -> None:
    rec, batches = _recorder()
    rec.stored(Tier.CPU, [ChunkKey("n", H1)], [[H1]])
    rec.stored(Tier.CPU, [ChunkKey("n", H2)], [[H2]])
    assert batches == []
    await asyncio.sleep(0)  # one turn: the flush scheduled with call_soon runs
    assert len(batches) == 1 and len(batches[0].events) == 2


# ---------------------------------------------------------------------------------------------- publisher
def _batch(n: int) -> KVEventBatch:
    return KVEventBatch(float(n), [BlockRemoved([n], "DISK", "kvtier")])


async def _recv(sock: zmq.asyncio.Socket) -> list[bytes]:
    return await asyncio.wait_for(sock.recv_multipart(), 10.0)


async def test_publisher_frames_sequence_numbers_and_replays(tmp_path: Path) -> None:
    pub_url, replay_url = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    publisher = EventPublisher(pub_url, replay_url, topic="kv")
    publisher.start()
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    dealer = ctx.socket(zmq.DEALER)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub_url)
        dealer.connect(replay_url)
        # A subscriber joins a PUB late (ZMQ's slow joiner): publish until the first one arrives.
        first = None
        while first is None:
            publisher.publish(_batch(publisher.next_seq))
            try:
                first = await asyncio.wait_for(sub.recv_multipart(), 0.05)
            except TimeoutError:
                continue
        topic, seq, payload = first
        assert topic == b"kv" and len(seq) == 8
        start = int.from_bytes(seq, "big")
        assert _vllm_decode(payload).events[0].block_hashes == [start]
        for _ in range(3):
            publisher.publish(_batch(publisher.next_seq))
        for n in range(start + 1, start + 4):
            topic, seq, payload = await _recv(sub)
            assert int.from_bytes(seq, "big") == n
            assert _vllm_decode(payload).events[0].block_hashes == [n]
        # A late subscriber asks for everything from sequence 1 on.
        await dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        replayed = []
        while True:
            empty, topic, seq, payload = await _recv(dealer)
            assert empty == b""
            if seq == END_SEQ:
                assert topic == b"" and payload == b""
                break
            assert topic == b"kv"
            replayed.append((int.from_bytes(seq, "big"), _vllm_decode(payload).events[0].block_hashes))
        assert replayed == [(n, [n]) for n in range(1, start + 4)]
        await dealer.send_multipart([b"", b"bad"])  # malformed: ignored, the socket still answers
        await dealer.send_multipart([b"", (start + 3).to_bytes(8, "big")])
        assert int.from_bytes((await _recv(dealer))[2], "big") == start + 3
        assert (await _recv(dealer))[2] == END_SEQ
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)
        ctx.term()
        await publisher.close()


async def test_publisher_refuses_an_endpoint_in_use() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        publisher = EventPublisher(f"tcp://127.0.0.1:{taken.getsockname()[1]}")
        with pytest.raises(zmq.ZMQError) as err:
            publisher.start()
        assert err.value.errno == zmq.EADDRINUSE
        await publisher.close()  # nothing left open: a second close is harmless
