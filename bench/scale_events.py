"""`kvtier bench scale events`: what the KV events stream costs per chunk, in bytes and in the
service's CPU, and how many chunks a second one decoding subscriber takes.

The events are kvtier's own: chunks of ``CHUNK`` tokens, described as the connector describes them
(random 32-byte block hashes, token ids uniform below ``VOCAB``, each chunk's parent the block
before it in a prompt of ``CHAIN`` chunks), go through ``EventRecorder`` on an event loop, one
batch per loop turn, and ``EventPublisher`` sends them.

- ``bytes``: per block size and hash format, one stored chunk's ``BlockStored`` (a chunk with a
  parent), its ``BlockRemoved``, and what a batch adds (the msgpack array and timestamp of the
  payload; the topic and sequence frames), encoded with msgpack as the publisher encodes them.
- ``cpu``: per chunk, the thread CPU time of the recorder's calls (a chunk announced; the same
  chunk again under a second namespace, as another TP rank saves it, which announces nothing) and of
  ``EventPublisher.publish`` on a publisher without a socket (the encoding and the replay buffer).
- ``stream``: the publisher binds a loopback PUB socket, one subscriber process (a SUB socket that
  decodes every batch) receives, and the publisher sends as fast as it can for ``seconds`` (at most
  ``max_chunks``): the chunks/s it hands to ZeroMQ, the chunks/s delivered and decoded, the CPU per
  chunk on each side, the payload bytes per chunk received.
- ``stalled``: a subscriber that reads nothing until the publisher has sent ``stall_batches``
  one-chunk batches through a PUB socket of a small high-water mark: what arrives, what is lost, and
  what the publisher counted as dropped.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import random
import statistics
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq

from kvtier.app.chunk_description import encode_description
from kvtier.app.events import BlockRemoved, BlockStored, EventRecorder, HashFormat, KVEventBatch
from kvtier.app.events_publisher import HWM, EventPublisher
from kvtier.bench.ports import free_port
from kvtier.bench.progress import note
from kvtier.storage.base import ChunkKey, Tier
from kvtier.storage.codec import Covered

CHUNK = 256  # tokens per chunk, as the sizing's node
BLOCK_SIZES = (16, 256)
HASH_FORMATS: tuple[HashFormat, ...] = ("int", "bytes")
VOCAB = 128_256  # Llama-3's vocabulary: ids from 1 to 5 bytes in msgpack, about 4 on average
CHAIN = 32  # chunks per prompt (8,192 tokens): all but a prompt's first chunk have a parent
TOPIC = "kv@pod-a@meta-llama/Llama-3.1-70B-Instruct"  # a topic as llm-d reads it
CPU_CHUNKS, QUICK_CPU_CHUNKS = 2048, 64
PER_BATCH = (1, 32)  # chunks per batch: a commit of one chunk; one rank's step of 8,192 tokens
QUICK_PER_BATCH = (32,)
POOL_CHUNKS = 2048  # distinct chunks the stream cycles through
MAX_CHUNKS, QUICK_MAX_CHUNKS = 100_000, 2_000  # bounds the publisher's queue if the subscriber lags
STALL_HWM = 1_000  # the stalled phase's PUB high-water mark, in batches
STALL_BATCHES, QUICK_STALL_BATCHES = 20_000, 3_000
IDLE_MS = 300  # a subscriber that received nothing this long after the publisher ended has all
REPORT_S = 60.0  # longest wait for the subscriber's report
SEED = 53_000


# ---------------------------------------------------------------------------------------- chunks
def described_chunks(count: int, block_size: int, seed: int = SEED, vocab: int = VOCAB) -> list[Covered]:
    """count chunks' block hashes, each with its description as the connector sends it; prompts of
    CHAIN chunks, each chunk's parent the last block of the chunk before."""
    if CHUNK % block_size:
        raise ValueError(f"block_size {block_size} does not divide the chunk of {CHUNK} tokens")
    rng = random.Random(seed)
    chunks: list[Covered] = []
    parent = b""
    for i in range(count):
        if i % CHAIN == 0:
            parent = b""
        hashes = [rng.randbytes(32) for _ in range(CHUNK // block_size)]
        tokens = [rng.randrange(1, vocab) for _ in range(CHUNK)]
        chunks.append(Covered(hashes, encode_description(parent, tokens)))
        parent = hashes[-1]
    return chunks


def _keys(namespace: str, chunks: Sequence[Covered]) -> list[ChunkKey]:
    return [ChunkKey(namespace, c[-1]) for c in chunks]


def _groups(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


async def _recorded(
    chunks: Sequence[Covered], fmt: HashFormat, per_batch: int
) -> tuple[dict[str, list[KVEventBatch]], dict[str, float]]:
    """The batches the recorder sends for storing chunks in the CPU tier and removing them (each
    group of per_batch in one loop turn), and its thread CPU seconds for each phase: stored and
    removed announce, the second namespace's copy (stored_copy, removed_copy) announces nothing."""
    sent: list[KVEventBatch] = []
    recorder = EventRecorder(sent.append, fmt)
    batches: dict[str, list[KVEventBatch]] = {}
    cpu: dict[str, float] = {}
    for phase, namespace in (
        ("stored", "rank0"),
        ("stored_copy", "rank1"),
        ("removed_copy", "rank1"),
        ("removed", "rank0"),
    ):
        sent.clear()
        groups = _groups(chunks, per_batch)
        start = time.thread_time()
        for group in groups:
            if phase.startswith("stored"):
                recorder.stored(Tier.CPU, _keys(namespace, group), group)
            else:
                recorder.removed(Tier.CPU, _keys(namespace, group))
            await asyncio.sleep(0)  # one loop turn: the recorder flushes the turn's events as one batch
        cpu[phase] = time.thread_time() - start
        batches[phase] = list(sent)
    return batches, cpu


def _events(batches: Sequence[KVEventBatch]) -> int:
    return sum(len(b.events) for b in batches)


# ---------------------------------------------------------------------------------------- bytes
def wire_bytes(block_size: int, fmt: HashFormat) -> dict[str, Any]:
    """Encoded bytes of one chunk's BlockStored and BlockRemoved, and of a one-event batch's
    overhead; the chunk is a prompt's second, so its event carries a parent."""
    chunks = described_chunks(2, block_size)
    batches, _ = asyncio.run(_recorded(chunks, fmt, 1))
    stored, removed = batches["stored"][1], batches["removed"][1]
    (stored_event,), (removed_event,) = stored.events, removed.events
    if not isinstance(stored_event, BlockStored) or not isinstance(removed_event, BlockRemoved):
        raise RuntimeError(f"expected a BlockStored and a BlockRemoved, got {stored_event}, {removed_event}")
    encode = msgspec.msgpack.encode
    stored_bytes = len(encode(stored_event))
    token_bytes = len(encode(stored_event.token_ids))
    return {
        "block_size": block_size,
        "hash_format": fmt,
        "blocks_per_chunk": CHUNK // block_size,
        "stored_bytes": stored_bytes,
        "token_ids_bytes": token_bytes,
        "stored_bytes_without_tokens": stored_bytes - token_bytes,
        "removed_bytes": len(encode(removed_event)),
        "batch_overhead_bytes": len(encode(stored)) - stored_bytes,
        "frame_bytes": len(TOPIC.encode()) + 8,  # the topic and the 8-byte sequence number
    }


# ---------------------------------------------------------------------------------------- cpu
def _median_spread(values: Sequence[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "spread": [min(values), max(values)], "runs": list(values)}


def encode_cpu(block_size: int, count: int, repeats: int) -> dict[str, Any]:
    """Thread CPU microseconds per chunk of the recorder's phases and of the publisher's encoding,
    median of repeats with their spread, for count chunks in batches of the last PER_BATCH."""
    chunks = described_chunks(count, block_size)
    per_batch = PER_BATCH[-1]
    runs: dict[str, list[float]] = {}
    for _ in range(repeats):
        batches, cpu = asyncio.run(_recorded(chunks, "int", per_batch))
        for phase, expected in (
            ("stored", count),
            ("stored_copy", 0),
            ("removed_copy", 0),
            ("removed", count),
        ):
            if _events(batches[phase]) != expected:
                raise RuntimeError(f"{phase}: {_events(batches[phase])} events for {count} chunks")
        for phase, seconds in cpu.items():
            runs.setdefault(f"{phase}_us", []).append(seconds * 1e6 / count)
        publisher = EventPublisher("tcp://127.0.0.1:1")  # never started: publish encodes and keeps
        for phase in ("stored", "removed"):
            start = time.thread_time()
            for batch in batches[phase]:
                publisher.publish(batch)
            runs.setdefault(f"encode_{phase}_us", []).append((time.thread_time() - start) * 1e6 / count)
    fig: dict[str, Any] = {"chunks": count, "chunks_per_batch": per_batch, "repeats": repeats}
    fig.update({name: _median_spread(values) for name, values in runs.items()})
    fig["announced_chunk_us"] = _median_spread(
        [
            sum(runs[k][i] for k in ("stored_us", "encode_stored_us", "removed_us", "encode_removed_us"))
            for i in range(repeats)
        ]
    )
    return fig


# ---------------------------------------------------------------------------------------- stream
def subscribe(url: str, conn: Connection, stall: bool) -> None:
    """The subscriber process: SUB on url, decode every batch; say when the first one came, wait for
    the publisher's end (reading nothing meanwhile when stall), then read until idle and report."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    try:
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVTIMEO, IDLE_MS)
        sub.subscribe(b"")
        sub.connect(url)
        while True:
            try:
                sub.recv_multipart()
                break
            except zmq.Again:
                continue
        conn.send("joined")
        end = conn.recv() if stall else None
        conn.send(_receive(sub, decoder, conn, end))
    finally:
        sub.close(linger=0)
        ctx.term()
        conn.close()


def _receive(
    sub: zmq.Socket[bytes], decoder: msgspec.msgpack.Decoder[KVEventBatch], conn: Connection, end: Any
) -> dict[str, Any]:
    """Receive and decode until the publisher has ended and nothing came for IDLE_MS; the counts
    of the batches with events (the publisher's empty batches before them only joined us)."""
    got = {"batches": 0, "chunks": 0, "payload_bytes": 0, "missing_seqs": 0, "first_s": 0.0, "last_s": 0.0}
    prev = -1
    cpu = 0.0
    while True:
        try:
            _topic, seq_bytes, payload = sub.recv_multipart()
        except zmq.Again:
            if end is None and conn.poll():
                end = conn.recv()
            if end is not None:
                break
            continue
        batch = decoder.decode(payload)
        if not batch.events:
            continue
        now, seq = time.monotonic(), int.from_bytes(seq_bytes, "big")
        if prev < 0:
            got["first_s"], cpu = now, time.process_time()
        else:
            got["missing_seqs"] += seq - prev - 1
        prev = seq
        got["batches"] += 1
        got["chunks"] += len(batch.events)
        got["payload_bytes"] += len(payload)
        got["last_s"] = now
    got["cpu_s"] = time.process_time() - cpu if prev >= 0 else 0.0
    return got


def _flood(publisher: EventPublisher, pool: Sequence[KVEventBatch], seconds: float, limit: int) -> int:
    """Publish the pool's batches over and over, as fast as publish returns, for seconds or until
    limit batches; how many were published."""
    deadline = time.monotonic() + seconds
    sent = 0
    while sent < limit and time.monotonic() < deadline:
        for batch in pool[: limit - sent]:
            publisher.publish(batch)
        sent += min(len(pool), limit - sent)
    return sent


def stream(
    pool: Sequence[KVEventBatch], seconds: float, limit: int, *, hwm: int = HWM, stall: bool = False
) -> dict[str, Any]:
    """Send the pool's batches to one subscriber process over loopback (see the module): what was
    published, what arrived, and each side's CPU."""
    url = f"tcp://127.0.0.1:{free_port()}"
    publisher = EventPublisher(url, topic=TOPIC, hwm=hwm)
    spawn = multiprocessing.get_context("spawn")
    ours, theirs = spawn.Pipe()
    proc = spawn.Process(target=subscribe, args=(url, theirs, stall), name="kvtier-events-sub", daemon=True)
    publisher.start()
    try:
        proc.start()
        theirs.close()
        while not ours.poll(0.01):  # a SUB joins late: send empty batches until one arrived
            publisher.publish(KVEventBatch(time.time(), []))
        if ours.recv() != "joined":
            raise RuntimeError("the subscriber did not join")
        cpu, start = time.process_time(), time.monotonic()
        sent = _flood(publisher, pool, seconds, limit)
        sent_s = time.monotonic() - start
        ours.send("end")
        if not ours.poll(REPORT_S):
            raise RuntimeError(f"no report from the subscriber within {REPORT_S:.0f} s")
        got = ours.recv()
        cpu = time.process_time() - cpu
        dropped = publisher.dropped
    finally:
        asyncio.run(publisher.close())
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()
        ours.close()
    per_batch = len(pool[0].events)
    chunks_sent = sent * per_batch
    delivered_s = got["last_s"] - start
    return {
        "chunks_per_batch": per_batch,
        "hwm": hwm,
        "batches_sent": sent,
        "chunks_sent": chunks_sent,
        "publish_chunks_per_s": chunks_sent / sent_s,
        "batches_received": got["batches"],
        "chunks_received": got["chunks"],
        "batches_lost": sent - got["batches"],
        "missing_seqs": got["missing_seqs"],
        "counted_dropped": dropped,
        "delivered_chunks_per_s": got["chunks"] / delivered_s if got["chunks"] and delivered_s > 0 else 0.0,
        "received_bytes_per_chunk": got["payload_bytes"] / got["chunks"] if got["chunks"] else 0.0,
        "publisher_cpu_us_per_chunk": cpu * 1e6 / chunks_sent,
        "subscriber_cpu_us_per_chunk": got["cpu_s"] * 1e6 / got["chunks"] if got["chunks"] else 0.0,
    }


def _pool(per_batch: int, count: int = POOL_CHUNKS) -> list[KVEventBatch]:
    """The stored chunks' batches, per_batch chunks each, block size 16, int hashes."""
    batches, _ = asyncio.run(_recorded(described_chunks(count, 16), "int", per_batch))
    return batches["stored"]


def stream_runs(per_batch: int, seconds: float, max_chunks: int, repeats: int) -> dict[str, Any]:
    """stream's figures for batches of per_batch chunks, median of repeats with spread."""
    pool = _pool(per_batch, max(per_batch, min(POOL_CHUNKS, max_chunks)))
    runs = [stream(pool, seconds, max(1, max_chunks // per_batch)) for _ in range(repeats)]
    fig: dict[str, Any] = {"chunks_per_batch": per_batch, "seconds": seconds, "repeats": repeats}
    for name in runs[0]:
        if name.endswith(("_per_s", "_per_chunk")):
            fig[name] = _median_spread([r[name] for r in runs])
        elif name != "chunks_per_batch":
            fig[name] = [r[name] for r in runs]
    return fig


# ---------------------------------------------------------------------------------------- all
def measure(quick: bool, repeats: int, seconds: float) -> dict[str, Any]:
    """Every figure of the module's docstring."""
    fig: dict[str, Any] = {"chunk_tokens": CHUNK, "vocab": VOCAB, "topic": TOPIC, "repeats": repeats}
    fig["bytes"] = {str(b): {f: wire_bytes(b, f) for f in HASH_FORMATS} for b in BLOCK_SIZES}
    count = QUICK_CPU_CHUNKS if quick else CPU_CHUNKS
    note(f"events: CPU per chunk over {count} chunks, block sizes {BLOCK_SIZES}")
    fig["cpu"] = {str(b): encode_cpu(b, count, repeats) for b in BLOCK_SIZES}
    max_chunks = QUICK_MAX_CHUNKS if quick else MAX_CHUNKS
    fig["stream"] = {}
    for per_batch in QUICK_PER_BATCH if quick else PER_BATCH:
        note(f"events: streaming batches of {per_batch} chunks for {seconds:g} s, {repeats} runs")
        fig["stream"][str(per_batch)] = stream_runs(per_batch, seconds, max_chunks, repeats)
    stall = QUICK_STALL_BATCHES if quick else STALL_BATCHES
    note(f"events: {stall} batches to a stalled subscriber, hwm {STALL_HWM}")
    fig["stalled"] = stream(_pool(1, min(POOL_CHUNKS, stall)), math.inf, stall, hwm=STALL_HWM, stall=True)
    return fig


def summary(fig: dict[str, Any]) -> list[str]:
    """Lines for stdout: bytes and CPU per chunk, the stream's rates, the stalled subscriber's loss."""
    lines = []
    for block_size, by_format in fig["bytes"].items():
        for fmt, f in by_format.items():
            lines.append(
                f"events block {block_size:>3} {fmt:>5}: stored {f['stored_bytes']} B (tokens"
                f" {f['token_ids_bytes']}), removed {f['removed_bytes']} B,"
                f" batch +{f['batch_overhead_bytes']} B payload +{f['frame_bytes']} B frames"
            )
    for block_size, f in fig["cpu"].items():
        costs = " ".join(
            f"{k.removesuffix('_us')} {v['median']:.1f}" for k, v in f.items() if k.endswith("_us")
        )
        lines.append(f"events block {block_size:>3} CPU us/chunk: {costs}")
    for per_batch, f in fig["stream"].items():
        lines.append(
            f"events stream {per_batch:>2} chunks/batch:"
            f" published {f['publish_chunks_per_s']['median']:.0f}/s,"
            f" delivered {f['delivered_chunks_per_s']['median']:.0f}/s, lost {f['batches_lost']} batches;"
            f" CPU us/chunk publisher {f['publisher_cpu_us_per_chunk']['median']:.1f},"
            f" subscriber {f['subscriber_cpu_us_per_chunk']['median']:.1f}"
        )
    s = fig["stalled"]
    lines.append(
        f"events stalled subscriber (hwm {s['hwm']}): sent {s['batches_sent']}, received"
        f" {s['batches_received']}, lost {s['batches_lost']}, counted dropped {s['counted_dropped']}"
    )
    return lines
