"""Poisoned shared tiers under a real engine: an attacker with write access to Redis and the bucket
stores another prompt's KV, well formed and with valid checksums, under the keys a victim's prompt
looks up. With tier keys (KVTIER_TIER_KEY) the victim's outputs equal vLLM's without kvtier and
each forgery is counted; without keys the same attack changes the outputs (the negative control
that proves the test can see a poisoning)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import obstore
import pytest
import redis

from kvtier.bench.harness import Outputs, generate_each, kv_transfer_config, make_prompt, running_engine
from kvtier.bench.introspect import scheduler_connector, worker_totals
from kvtier.storage import codec
from kvtier.storage.base import ChunkKey, Tier
from kvtier.storage.config import ObjectConfig
from kvtier.storage.keys import redis_key
from kvtier.storage.tiers.object_client import build_store
from kvtier.storage.tiers.object_index import object_path
from tests.e2e.oracle import assert_same_outputs, forget_local_cache, wait_written
from tests.e2e.service import RunningService, running_service
from tests.support.object_store import BUCKET, SeaweedServer
from tests.support.redis_server import RedisServer

pytestmark = [pytest.mark.e2e, pytest.mark.redis]
CHUNK = 64
CHUNKS = 3
MAX_TOKENS = 10
# Three full chunks each, all loadable (one token is left to compute).
DONOR = make_prompt(600, 230)  # the prompt whose KV the attacker plants under the victims' keys
IN_REDIS, IN_BUCKET = make_prompt(601, 230), make_prompt(602, 230)  # victims, one per shared tier
TIER_KEY = "5a" * 32
FORGED_LINE = "failed its MAC check (forged)"


@pytest.fixture(scope="module")
def expected(tiny_model: str) -> Outputs:
    with running_engine(tiny_model) as llm:
        return generate_each(llm, [IN_REDIS, IN_BUCKET], MAX_TOKENS)


@dataclass
class Attacked:
    """What the victim's engine and service did in the two rounds of the attack; each list holds
    the round of the chunks planted in Redis, then the round of those planted in the bucket."""

    outputs: Outputs  # IN_REDIS's, then IN_BUCKET's
    loaded: list[int]  # chunks the worker loaded in each round
    hits: list[dict[str, int]]  # the service's hit tokens in each round, by tier
    errors: dict[str, dict[str, int]]  # tier -> errors by kind, after both rounds
    forged_lines: int  # the service's log lines about forgeries


@contextlib.contextmanager
def recorded_lookups(llm: Any) -> Iterator[dict[str, list[bytes]]]:
    """While the block runs, the chunk hashes of each request's first lookup, by request id, in order."""
    side = scheduler_connector(llm)._sched
    start = side._start_lookup
    seen: dict[str, list[bytes]] = {}

    def recording(st: Any, hashes: list[bytes], *args: Any, **kwargs: Any) -> Any:
        seen.setdefault(st.request.request_id, list(hashes))
        return start(st, hashes, *args, **kwargs)

    side._start_lookup = recording
    try:
        yield seen
    finally:
        side._start_lookup = start


def donor_payloads(raw: redis.Redis, ns: str, donor: list[bytes]) -> list[bytes]:
    """What the attacker copies: the payload of each of DONOR's chunks, read from Redis."""
    out = []
    for d in donor:
        blob = raw.get(redis_key(ChunkKey(ns, d)))
        assert blob is not None, "the donor's chunk is in Redis"
        out.append(bytes(codec.decode(blob, ChunkKey(ns, d))))  # a signed blob reads on its checksum
    return out


def forged(ns: str, victim: list[bytes], payloads: list[bytes]) -> dict[ChunkKey, bytes]:
    """Each payload as a well-formed blob of a victim's key: the key echo and checksum an honest
    writer would give it, no tag (the attacker has no tier key)."""
    keys = [ChunkKey(ns, v) for v in victim]
    return {k: codec.encode(k, p) for k, p in zip(keys, payloads, strict=True)}


def attack(tiny_model: str, tmp: Path, redis_url: str, endpoint: str, **keys: str) -> Attacked:
    """Store DONOR and both victims through a service, then plant DONOR's KV under IN_BUCKET's keys
    in the bucket (Redis emptied) and under IN_REDIS's keys in Redis (its chunks deleted from every
    tier first), running each victim after its planting."""
    raw = redis.Redis.from_url(redis_url, socket_timeout=10)
    raw.flushall()
    url = f"s3://{BUCKET}/attack-{uuid.uuid4().hex[:8]}"
    bucket = build_store(ObjectConfig(url=url, endpoint=endpoint))
    settings = dict(redis_url=redis_url, object_url=url, object_endpoint=endpoint, object_timeout=30, **keys)
    try:
        with running_service(tmp, **settings) as svc:
            cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK)
            with running_engine(tiny_model, cfg) as llm:
                with recorded_lookups(llm) as seen:
                    generate_each(llm, [DONOR, IN_REDIS, IN_BUCKET], MAX_TOKENS)  # stored everywhere
                donor, in_redis, in_bucket = seen.values()
                wait_written(svc, "redis", 3 * CHUNKS)
                wait_written(svc, "object", 3 * CHUNKS)
                (ns,) = svc.stats()["namespace_specs"]
                payloads = donor_payloads(raw, ns, donor)

                svc.clear(Tier.CPU, Tier.REDIS)  # the bucket alone holds the victims' chunks
                for key, blob in forged(ns, in_bucket, payloads).items():
                    obstore.put(bucket, object_path(key), blob)  # over the genuine object
                from_bucket = _run(svc, llm, IN_BUCKET)

                svc.wait_leases_ended()
                assert svc.client.delete(ns, in_redis).result(10) == CHUNKS  # from every tier
                svc.clear(Tier.CPU)
                for key, blob in forged(ns, in_redis, payloads).items():
                    raw.set(redis_key(key), blob)
                from_redis = _run(svc, llm, IN_REDIS)
            stats = svc.stats()
            log = (tmp / "service.log").read_text()
    finally:
        raw.close()
    return Attacked(
        Outputs(from_redis[0].tokens + from_bucket[0].tokens),
        [from_redis[1], from_bucket[1]],
        [from_redis[2], from_bucket[2]],
        {t: dict(stats["tiers"][t]["errors_by_kind"]) for t in ("redis", "object")},
        log.count(FORGED_LINE),
    )


def _run(svc: RunningService, llm: Any, prompt: list[int]) -> tuple[Outputs, int, dict[str, int]]:
    """Run prompt into an emptied vLLM cache; its outputs, the chunks loaded and the hit tokens."""
    forget_local_cache(llm)
    loaded, hits = worker_totals().get("loaded_chunks", 0), svc.hit_tokens()
    out = generate_each(llm, [prompt], MAX_TOKENS)
    after = svc.hit_tokens()
    return out, worker_totals().get("loaded_chunks", 0) - loaded, {t: after[t] - hits[t] for t in after}


HIT = CHUNKS * CHUNK
REDIS_HIT = {"cpu": 0, "disk": 0, "redis": HIT, "object": 0}
OBJECT_HIT = {"cpu": 0, "disk": 0, "redis": 0, "object": HIT}


def test_signed_tiers_refuse_planted_chunks_and_unsigned_ones_serve_them(
    tiny_model: str,
    expected: Outputs,
    redis_server: RedisServer,
    s3_server: SeaweedServer,
    aws_env_module: dict[str, str],
    tmp_path: Path,
) -> None:
    keyed = attack(tiny_model, tmp_path / "keyed", redis_server.url, s3_server.endpoint, tier_key=TIER_KEY)
    open_ = attack(tiny_model, tmp_path / "open", redis_server.url, s3_server.endpoint)
    # With keys: every planted chunk was found, refused as a forgery, and recomputed.
    assert_same_outputs(expected, keyed.outputs)
    assert keyed.hits == [REDIS_HIT, OBJECT_HIT], keyed.hits
    assert keyed.loaded == [0, 0], keyed.loaded
    assert keyed.errors == {"redis": {"forged": CHUNKS}, "object": {"forged": CHUNKS}}, keyed.errors
    assert keyed.forged_lines == 2 * CHUNKS
    # Without keys the same chunks are loaded, and each victim's answer follows the donor's KV.
    assert open_.hits == [REDIS_HIT, OBJECT_HIT], open_.hits
    assert open_.loaded == [CHUNKS, CHUNKS], open_.loaded
    assert open_.errors == {"redis": {}, "object": {}}, open_.errors
    assert open_.forged_lines == 0
    poisoned = [want != got for want, got in zip(expected.tokens, open_.outputs.tokens, strict=True)]
    assert poisoned == [True, True], "a poisoning went unseen"
