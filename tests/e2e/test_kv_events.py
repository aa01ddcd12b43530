"""KV events through a real engine: a subscriber that reads only kvtier's events holds, per tier,
exactly the block hashes the service holds, through CPU eviction, disk writes, a corrupt blob, a
clear and a restart with the disk kept; a late subscriber catches up through the replay socket; the
admin lookup answers as the connector's lookup does. kvtier's BlockStored carry the token ids, parent
hashes and extra keys vLLM's own GPU events carry for the same blocks, so a token-keyed indexer
following llm-d's rules (tests/support/indexer.py) indexes them: with the GPU's events, and after the
restart from kvtier's alone. With a real Redis tier, the subscriber's REDIS
set equals the keys Redis itself holds through a delete, keys Redis lost behind kvtier's back (found
gone by a lookup's EXISTS and by a read, as docs/events.md guarantees) and a clear."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis
import zmq
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed import kv_events as vllm_events

from kvtier.app.events import MEDIUM, external_hash
from kvtier.app.events_publisher import END_SEQ
from kvtier.bench.harness import BLOCK_SIZE, generate_each, kv_transfer_config, make_prompt, running_engine
from kvtier.bench.introspect import scheduler_connector
from kvtier.bench.ports import free_port
from kvtier.storage import codec
from kvtier.storage.base import ChunkKey, Tier
from kvtier.storage.keys import REDIS_PREFIX, disk_relpath, redis_key
from tests.app import wait_until
from tests.e2e.oracle import forget_local_cache, wait_written
from tests.e2e.service import RunningService, running_service
from tests.support.events_example import load_subscriber_example
from tests.support.indexer import Indexer, engine_key
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.e2e
CHUNK = 64
PROMPTS = [
    make_prompt(300 + i, 270) for i in range(5)
]  # 4 chunks each: 20 chunks, more than the CPU tier holds
REDIS_PROMPTS = [make_prompt(400 + i, 270) for i in range(3)]  # 4 chunks each
MODEL = "tiny"
TOPIC = f"kv@pod-a@{MODEL}"  # llm-d's form: the pod credited with the blocks, the model hashed into keys
WEIGHTS = {"gpu": 1.0, "cpu": 0.8, "cpu_kvtier": 0.8, "disk": 0.6, "redis": 0.5, "object": 0.4}


def _post(port: int, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/lookup", data=json.dumps(body).encode(), method="POST"
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
        return answer


def record_block_hashes(llm: Any) -> list[list[bytes]]:
    """From now on, the vLLM block hashes of every request the engine's connector sees, in order."""
    side = scheduler_connector(llm)._sched
    arrive = side.on_new_request
    seen: list[list[bytes]] = []

    def recording(request: Any) -> None:
        seen.append([bytes(h) for h in request.block_hashes])
        arrive(request)

    side.on_new_request = recording
    return seen


def service_holds(port: int, ns: str, bpc: int, prompts_blocks: list[list[bytes]]) -> dict[str, set[bytes]]:
    """Per medium, the block hashes of every chunk the service's index holds, asked chunk by chunk."""
    held: dict[str, set[bytes]] = {MEDIUM[Tier.CPU]: set(), MEDIUM[Tier.DISK]: set()}
    for blocks in prompts_blocks:
        for end in range(bpc, len(blocks) + 1, bpc):
            chunk = blocks[end - bpc : end]
            answer = _post(
                port, {"namespace": ns, "block_hashes": [h.hex() for h in chunk], "blocks_per_chunk": bpc}
            )
            for tier in (Tier.CPU, Tier.DISK):
                if answer["tiers"][tier.label]:
                    held[MEDIUM[tier]].update(chunk)
    return held


def drain(view: Any) -> None:
    """Apply every batch published so far (the stream goes quiet once the service is idle)."""
    while view.poll(500):
        pass


def _store(svc: Any, llm: Any, prompts: list[list[int]], tier: str) -> tuple[str, int, list[list[bytes]]]:
    """Run prompts (4 chunks each) until tier holds them all; the namespace, blocks per chunk, and
    each prompt's block hashes."""
    seen = record_block_hashes(llm)
    for done, prompt in enumerate(prompts, 1):
        # One prompt at a time: a CPU chunk is pinned until its write lands, so a save that found
        # every CPU slot pinned would be dropped (by design) and the tier would never hold them all.
        generate_each(llm, [prompt], 4)
        wait_written(svc, tier, done * 4)
    ns, spec = next(iter(svc.stats()["namespace_specs"].items()))
    return ns, spec["chunk_size"] // spec["block_size"], seen[: len(prompts)]


def settled(view: Any, expected: dict[str, set[bytes]]) -> bool:
    drain(view)
    return {m: view.held.get(m, set()) for m in expected} == expected


def test_a_subscriber_rebuilds_every_tier_through_eviction_corruption_clear_and_restart(
    tiny_model: str, tmp_path: Path
) -> None:
    mod = load_subscriber_example()
    events, replay = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    admin = free_port()
    settings = dict(
        disk_path=tmp_path / "disk",
        cpu_size="1MiB",
        events_url=events,
        events_replay_url=replay,
        events_hash_format="bytes",
        events_topic=TOPIC,
        admin_port=admin,
    )
    gpu_replay = f"ipc://{tmp_path}/gpu-replay"
    gpu_events = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"ipc://{tmp_path}/gpu-events",
        replay_endpoint=gpu_replay,
        topic=TOPIC,
    )
    view = mod.TierView(events, replay)
    try:
        with running_service(tmp_path / "svc1", **settings) as svc:
            cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK)
            with running_engine(tiny_model, cfg, kv_events_config=gpu_events) as llm:
                ns, bpc, blocks = _store(svc, llm, PROMPTS, "disk")
                assert svc.stats()["tiers"]["cpu"]["evictions"] > 0, "the CPU tier never evicted"
                _corrupt_first_chunk(tmp_path / "disk", ns, blocks[0][bpc - 1], svc, llm)
                _lookup_api_matches_the_connectors(svc, admin, ns, bpc, blocks)
                gpu = replay_all(gpu_replay)
                ours = replay_all(replay)
                _kvtier_blocks_are_described_as_the_gpus(gpu, ours)
                _an_indexer_fed_both_streams_holds_the_disk_tiers_prefixes(gpu + ours, admin, ns, blocks)
            # Once the engine is gone no save can land after the clear (the recomputed chunk's may
            # still have been on their way), and once the writes are done no chunk is pinned.
            assert wait_until(lambda: svc.stats()["write_queue_depth"] == 0, 30)
            assert svc.clear(Tier.CPU) > 0
            before = service_holds(admin, ns, bpc, blocks)
            assert before[MEDIUM[Tier.CPU]] == set() and before[MEDIUM[Tier.DISK]]
            assert wait_until(lambda: settled(view, before), 30), (view.held, before)
        with running_service(tmp_path / "svc2", **settings) as svc:
            wait_until(lambda: not svc.stats()["tiers"]["disk"]["loading"], 30)
            truth = service_holds(admin, ns, bpc, blocks)
            assert truth == before  # the disk kept what it held; the CPU tier starts empty
            assert wait_until(lambda: settled(view, truth), 30), (view.held, truth)
            late = mod.TierView(events, replay)
            try:
                late.catch_up()
                assert {m: late.held.get(m, set()) for m in truth} == truth
            finally:
                late.close()
            # No engine and no GPU events: kvtier's announcements of the files alone index them.
            _an_indexer_fed_both_streams_holds_the_disk_tiers_prefixes(replay_all(replay), admin, ns, blocks)
    finally:
        view.close()


def replay_all(replay_url: str) -> list[tuple[bytes, Any]]:
    """Every batch a publisher keeps (vLLM's or kvtier's), with its topic, through its replay socket."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 10_000)
    got: list[tuple[bytes, Any]] = []
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


def _described_blocks(batches: list[tuple[bytes, Any]], media: set[str]) -> dict[int, tuple[Any, ...]]:
    """Per block hash (as an int) of every BlockStored in media: its parent, tokens and extra keys."""
    out: dict[int, tuple[Any, ...]] = {}
    for _topic, batch in batches:
        for e in batch.events:
            if not isinstance(e, vllm_events.BlockStored) or e.medium not in media:
                continue
            assert e.token_ids, f"a BlockStored without tokens: {e}"
            parent = None if e.parent_block_hash is None else engine_key(e.parent_block_hash)
            for i, h in enumerate(e.block_hashes):
                tokens = e.token_ids[i * e.block_size : (i + 1) * e.block_size]
                extra = None if e.extra_keys is None else e.extra_keys[i]
                out[engine_key(h)] = (parent, tokens, extra, e.block_size, e.lora_id, e.lora_name)
                parent = engine_key(h)
    return out


def _kvtier_blocks_are_described_as_the_gpus(
    gpu: list[tuple[bytes, Any]], ours: list[tuple[bytes, Any]]
) -> None:
    """Every block kvtier announced carries what vLLM's own event for it carries."""
    assert {topic for topic, _ in ours} == {topic for topic, _ in gpu} == {TOPIC.encode()}
    theirs = _described_blocks(gpu, {"GPU"})
    described = _described_blocks(ours, {MEDIUM[Tier.CPU], MEDIUM[Tier.DISK]})
    assert len(described) == len(PROMPTS) * 256 // BLOCK_SIZE  # every block of every saved chunk
    assert {h: theirs.get(h) for h in described} == described
    assert external_hash(bytes(32), "int") == engine_key(bytes(32))  # both name blocks alike


def _an_indexer_fed_both_streams_holds_the_disk_tiers_prefixes(
    batches: list[tuple[bytes, Any]], admin: int, ns: str, blocks: list[list[bytes]]
) -> None:
    """Following llm-d's rules, the indexer credits the pod with exactly the leading blocks of each
    prompt that the disk tier holds (the admin lookup's count), and drops nothing."""
    indexer = Indexer(BLOCK_SIZE, WEIGHTS)
    for topic, batch in batches:
        indexer.apply(topic, batch)
    assert not indexer.dropped, indexer.dropped
    for prompt, prompt_blocks in zip(PROMPTS, blocks, strict=True):
        hexed = [h.hex() for h in prompt_blocks]
        answer = _post(
            admin, {"namespace": ns, "block_hashes": hexed, "blocks_per_chunk": CHUNK // BLOCK_SIZE}
        )
        assert indexer.leading_blocks(prompt, MODEL, "pod-a", {"disk"}) == answer["tiers"]["disk"]


def _corrupt_first_chunk(disk: Path, ns: str, last_hash: bytes, svc: RunningService, llm: Any) -> None:
    """Flip a payload byte of the first prompt's first chunk on disk, then make a load read it."""
    key = ChunkKey(ns, last_hash)
    path = disk / disk_relpath(key)
    with open(path, "r+b") as f:
        f.seek(codec.header_size(key) + 100)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    svc.clear(Tier.CPU)
    forget_local_cache(llm)
    generate_each(llm, PROMPTS[:1], 4)  # a disk hit that fails verification: the file is deleted
    assert svc.stats()["tiers"]["disk"]["errors"] == 1  # the corrupt read, counted


def _lookup_api_matches_the_connectors(
    svc: RunningService, admin: int, ns: str, bpc: int, blocks: list[list[bytes]]
) -> None:
    """The admin lookup's leading blocks equal the service's answer to the connector's lookup."""
    svc.wait_leases_ended()
    for i, prompt_blocks in enumerate(blocks):
        answer = _post(admin, {"namespace": ns, "block_hashes": [h.hex() for h in prompt_blocks]})
        chunk_hashes = prompt_blocks[bpc - 1 :: bpc]
        result = svc.client.lookup(ns, chunk_hashes, f"events-test-{i}").result(10).result
        svc.client.release(f"events-test-{i}")
        assert answer["held"] == result.num_hit * bpc, (i, answer, result)
    svc.wait_leases_ended()


# ---------------------------------------------------------------------------------------------- Redis
def chunks_of(prompts_blocks: list[list[bytes]], bpc: int) -> dict[bytes, list[bytes]]:
    """Each chunk's block hashes, by its key's prefix hash (the hash of its last block)."""
    return {
        blocks[end - 1]: blocks[end - bpc : end]
        for blocks in prompts_blocks
        for end in range(bpc, len(blocks) + 1, bpc)
    }


def redis_holds(client: redis.Redis, ns: str, chunks: dict[bytes, list[bytes]]) -> set[bytes]:
    """The block hashes of every chunk of ns whose key Redis itself holds (its keys, read directly)."""
    held: set[bytes] = set()
    for name in client.scan_iter(match=f"{REDIS_PREFIX}:{ns}:*", count=1000):
        prefix_hash = bytes.fromhex(name.decode().rsplit(":", 1)[1])
        assert prefix_hash in chunks, f"Redis holds {name!r}, a chunk of no prompt of this test"
        held.update(chunks[prefix_hash])
    return held


def redis_settled(view: Any, truth: set[bytes]) -> bool:
    drain(view)
    return view.held.get(MEDIUM[Tier.REDIS], set()) == truth


def test_a_subscriber_rebuilds_the_redis_tier_through_a_delete_keys_lost_behind_kvtiers_back_and_a_clear(
    tiny_model: str, redis_server_fn: RedisServer, tmp_path: Path
) -> None:
    mod = load_subscriber_example()
    events, replay = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    settings = dict(
        redis_url=redis_server_fn.url, events_url=events, events_replay_url=replay, events_hash_format="bytes"
    )
    raw = redis.Redis.from_url(redis_server_fn.url, socket_timeout=10, socket_connect_timeout=10)
    view = mod.TierView(events, replay)
    try:
        with running_service(tmp_path / "svc", **settings) as svc:
            cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK)
            with running_engine(tiny_model, cfg) as llm:
                ns, bpc, blocks = _store(svc, llm, REDIS_PROMPTS, "redis")
                chunks = chunks_of(blocks, bpc)
                assert len(chunks) == len(REDIS_PROMPTS) * 4
                _redis_rounds(svc, raw, view, ns, chunks, [b[bpc - 1 :: bpc] for b in blocks])
                late = mod.TierView(events, replay)
                try:
                    late.catch_up()
                    assert late.held == view.held  # every medium, the read's CPU promotions too
                finally:
                    late.close()
    finally:
        view.close()
        raw.close()


def _redis_rounds(
    svc: RunningService,
    raw: redis.Redis,
    view: Any,
    ns: str,
    chunks: dict[bytes, list[bytes]],
    prompt_keys: list[list[bytes]],
) -> None:
    """Stores, a delete, a key lost and found by EXISTS, one lost and found by a read, a clear: after
    each, the subscriber's REDIS set equals what Redis holds."""
    truth = redis_holds(raw, ns, chunks)
    assert truth == {h for blocks in chunks.values() for h in blocks}  # every chunk was SET
    assert wait_until(lambda: redis_settled(view, truth), 30), (view.held, truth)

    assert svc.client.delete(ns, prompt_keys[0]).result(10) == 4  # from every tier, Redis too
    truth = redis_holds(raw, ns, chunks)
    assert truth.isdisjoint(h for k in prompt_keys[0] for h in chunks[k]) and truth
    assert wait_until(lambda: redis_settled(view, truth), 30), (view.held, truth)

    # Gone behind kvtier's back: nothing is announced until the service finds it gone...
    assert svc.clear(Tier.CPU) == 8  # so that lookups ask Redis
    lost = prompt_keys[1][0]
    assert raw.delete(redis_key(ChunkKey(ns, lost))) == 1
    drain(view)
    assert view.held[MEDIUM[Tier.REDIS]] == truth
    # ...then the first lookup's EXISTS that answers no announces it removed.
    found = svc.client.lookup(ns, prompt_keys[1], "redis-exists").result(10).result
    svc.client.release("redis-exists")
    assert found.num_hit == 0
    truth = redis_holds(raw, ns, chunks)
    assert truth.isdisjoint(chunks[lost]) and len(truth) == 7 * len(chunks[lost])
    assert wait_until(lambda: redis_settled(view, truth), 30), (view.held, truth)

    # Gone between a lookup that found it and the read: the read's miss announces it removed.
    leased = svc.client.lookup(ns, prompt_keys[2], "redis-read").result(10).result
    assert (leased.num_hit, leased.tiers) == (4, [Tier.REDIS] * 4)
    lost = prompt_keys[2][1]
    assert raw.delete(redis_key(ChunkKey(ns, lost))) == 1
    staged = svc.client.stage("redis-read").result(10).result
    svc.client.release("redis-read")
    assert staged.failed == [1]
    truth = redis_holds(raw, ns, chunks)
    assert truth.isdisjoint(chunks[lost]) and len(truth) == 6 * len(chunks[lost])
    assert wait_until(lambda: redis_settled(view, truth), 30), (view.held, truth)

    assert svc.clear(Tier.REDIS) == 6
    assert redis_holds(raw, ns, chunks) == set()
    assert wait_until(lambda: redis_settled(view, set()), 30), view.held
