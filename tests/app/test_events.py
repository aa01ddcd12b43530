"""KV events: vLLM's encoding byte for byte, the recorder's bookkeeping, the publisher's framing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio
from vllm.distributed import kv_events as vllm_events

from kvtier.app.chunk_description import encode_description
from kvtier.app.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventRecorder,
    KVEventBatch,
    external_hash,
)
from kvtier.app.events_order import ParentOrder
from kvtier.app.events_publisher import END_SEQ, EventPublisher
from kvtier.storage.base import ChunkKey, NamespaceSpec, Tier
from kvtier.storage.codec import Covered

H1, H2, H3 = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32


def _vllm_decode(payload: bytes) -> vllm_events.KVEventBatch:
    return msgspec.msgpack.decode(payload, type=vllm_events.KVEventBatch)


# ---------------------------------------------------------------------------------------------- encoding
def test_batches_encode_exactly_as_vllms_and_decode_with_its_classes() -> None:
    ours = KVEventBatch(
        12.5,
        [
            BlockStored([1, 2], None, [], 16, None, "CPU_KVTIER", None, ownership="kvtier"),
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
        BlockStored([H1, H2], None, [], 16, None, "CPU_KVTIER", None, ownership="kvtier"),
        BlockStored([H1, H2], None, [], 16, None, "DISK", None, ownership="kvtier"),
        BlockRemoved([H1, H2], "CPU_KVTIER", "kvtier"),
    ]
    assert rec.held_hashes(Tier.DISK) == {H1, H2}
    assert rec.held_hashes(Tier.CPU) == set()


def test_recorder_names_a_chunk_without_known_hashes_by_its_key() -> None:
    rec, batches = _recorder("int")
    rec.stored(Tier.REDIS, [ChunkKey("n", H3)], [()])
    assert _events(batches) == [
        BlockStored([external_hash(H3, "int")], None, [], 0, None, "REDIS", None, ownership="kvtier")
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


# ---------------------------------------------------------------------------------------------- descriptions
TOKENS = list(range(100, 164))  # a chunk of 4 blocks of 16 tokens


def _described(blocks: list[bytes], parent: bytes = b"", **fields: object) -> Covered:
    return Covered(blocks, encode_description(parent, TOKENS[: 16 * len(blocks)], **fields))  # type: ignore[arg-type]


def test_a_described_chunk_is_announced_with_its_tokens_and_parent_as_vllm_fills_them() -> None:
    rec, batches = _recorder("int")
    blocks = [H1, H2, H3, b"\x04" * 32]
    rec.stored(Tier.CPU, [ChunkKey("n", blocks[-1])], [_described(blocks, parent=b"\x09" * 32)])
    (event,) = _events(batches)
    theirs = vllm_events.BlockStored(
        block_hashes=[external_hash(h, "int") for h in blocks],
        parent_block_hash=external_hash(b"\x09" * 32, "int"),
        token_ids=TOKENS,
        block_size=16,
        lora_id=None,
        medium="CPU_KVTIER",
        lora_name=None,
        extra_keys=[None] * 4,  # what vLLM's GPU events say for blocks without extra keys
        ownership="kvtier",
    )
    assert msgspec.msgpack.encode(event) == msgspec.msgpack.encode(theirs)
    assert rec.undescribed == 0


def test_lora_and_extra_keys_travel_per_block_and_a_prompts_first_chunk_has_no_parent() -> None:
    rec, batches = _recorder("bytes")
    extra = [("adapter", "salt"), ("adapter",)]
    covered = _described([H1, H2], lora_id=3, lora_name="adapter", extra_keys=extra)
    rec.stored(Tier.DISK, [ChunkKey("n", H2)], [covered])
    (event,) = _events(batches)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(event), type=vllm_events.BlockStored)
    assert decoded.parent_block_hash is None
    assert (decoded.lora_id, decoded.lora_name) == (3, "adapter")
    assert decoded.extra_keys == [("adapter", "salt"), ("adapter",)]
    assert decoded.token_ids == TOKENS[:32] and decoded.block_size == 16


def test_only_the_blocks_new_to_a_medium_are_announced_each_run_with_its_own_parent() -> None:
    rec, batches = _recorder("bytes")
    blocks = [H1, H2, H3, b"\x04" * 32]
    # Another namespace (another chunk size) already holds blocks 1 and 3 in this medium.
    rec.stored(Tier.CPU, [ChunkKey("m", H2)], [Covered([H2])])
    rec.stored(Tier.CPU, [ChunkKey("o", blocks[3])], [Covered([blocks[3]])])
    batches.clear()
    rec.stored(Tier.CPU, [ChunkKey("n", blocks[3])], [_described(blocks, parent=b"\x09" * 32)])
    first, second = _events(batches)
    assert (first.block_hashes, first.parent_block_hash, first.token_ids) == ([H1], b"\x09" * 32, TOKENS[:16])
    assert (second.block_hashes, second.parent_block_hash, second.token_ids) == ([H3], H2, TOKENS[32:48])


def test_a_promotion_names_no_hashes_and_is_announced_as_described_elsewhere() -> None:
    rec, batches = _recorder("bytes")
    key = ChunkKey("n", H2)
    rec.stored(Tier.DISK, [key], [_described([H1, H2])])
    rec.stored(Tier.CPU, [key], [()])  # a disk hit promoted into the CPU tier
    rec.stored(Tier.REDIS, [key], [[H1, H2]])  # the same hashes, without the description
    disk, cpu, redis = _events(batches)
    assert cpu.token_ids == redis.token_ids == disk.token_ids == TOKENS[:32]
    assert rec.undescribed == 0


def test_chunks_without_a_description_are_announced_by_their_hashes_and_counted() -> None:
    rec, batches = _recorder("bytes")
    rec.stored(Tier.DISK, [ChunkKey("n", H2)], [Covered([H1, H2])])  # an older build's file
    rec.stored(Tier.DISK, [ChunkKey("n", H3)], [Covered([H3], b"\xc1not msgpack")])  # not one of ours
    short = Covered([H1, H2], encode_description(b"", TOKENS[:17]))  # tokens not whole blocks
    rec.stored(Tier.CPU, [ChunkKey("n", H2)], [short])
    assert [e.token_ids for e in _events(batches)] == [[], [], []]
    assert rec.undescribed == 3


async def test_a_connecting_publisher_reaches_a_subscriber_that_binds_as_llm_ds_indexer_does(
    tmp_path: Path,
) -> None:
    url = f"ipc://{tmp_path}/indexer"
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    publisher = EventPublisher(url, topic="kv@pod-a@model", connect=True)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")  # llm-d's default topic filter
        sub.bind(url)
        publisher.start()
        while not await sub.poll(50):  # ZMQ's slow joiner: publish until one arrives
            publisher.publish(_batch(publisher.next_seq))
        topic, _seq, payload = await _recv(sub)
        assert topic == b"kv@pod-a@model" and _vllm_decode(payload).events
    finally:
        sub.close(linger=0)
        ctx.term()
        await publisher.close()


# ---------------------------------------------------------------------------------------------- parents first
H4, H5 = b"\x04" * 32, b"\x05" * 32


async def test_a_chunk_found_before_its_parent_goes_out_after_it() -> None:
    """The disk index's load finds files in directory order: children may come first."""
    rec, batches = _recorder("bytes")
    third = Covered([H5], encode_description(H4, TOKENS[32:48]))
    second = Covered([H3, H4], encode_description(H2, TOKENS[:32]))
    first = Covered([H1, H2], encode_description(b"", TOKENS[:32]))
    rec.stored(Tier.DISK, [ChunkKey("n", H5), ChunkKey("n", H4)], [third, second])
    assert rec.order.parked == 2
    rec.stored(Tier.DISK, [ChunkKey("n", H2)], [first])
    await asyncio.sleep(0)  # the turn's batch goes out
    assert [e.block_hashes for e in _events(batches)] == [[H1, H2], [H3, H4], [H5]]
    assert rec.order.parked == 0


async def test_a_waiting_chunk_removed_before_its_parent_came_is_never_announced_stored() -> None:
    rec, batches = _recorder("bytes")
    rec.stored(Tier.DISK, [ChunkKey("n", H4)], [Covered([H3, H4], encode_description(H2, TOKENS[:32]))])
    rec.removed(Tier.DISK, [ChunkKey("n", H4)])
    rec.stored(Tier.DISK, [ChunkKey("n", H2)], [Covered([H1, H2], encode_description(b"", TOKENS[:32]))])
    await asyncio.sleep(0)
    stored = [e.block_hashes for e in _events(batches) if isinstance(e, BlockStored)]
    assert stored == [[H1, H2]] and rec.order.parked == 0


async def test_a_chunk_whose_parent_never_comes_goes_out_after_the_wait() -> None:
    now = [100.0]
    sent: list[object] = []
    order = ParentOrder(sent.append, wait_s=5.0, clock=lambda: now[0])
    order.stored("late", H2, "child event", [H3])
    order.release_expired()  # not due yet
    assert sent == [] and order.parked == 1
    now[0] += 5.0
    order.release_expired()
    assert sent == ["child event"] and order.parked == 0
    order.stored("grandchild", H3, "its child", [H4])  # its parent went out: no wait
    assert sent == ["child event", "its child"]


async def test_every_waiting_run_of_a_removed_chunk_is_dropped_and_the_others_still_wait() -> None:
    sent: list[object] = []
    order = ParentOrder(sent.append)
    order.stored(("disk", "chunk"), H1, "run 1", [H2])  # two runs of one chunk, each waiting
    order.stored(("disk", "chunk"), H3, "run 2", [H4])
    order.stored(("disk", "other"), H1, "other chunk", [H5])
    order.removed(("disk", "chunk"), "removed", [H2, H4])
    assert sent == ["removed"] and order.parked == 1
    order.stored(("disk", "parent"), None, "parent", [H1])
    assert sent == ["removed", "parent", "other chunk"] and order.parked == 0
