"""Two services and two engines share a Redis Cluster with replicas; a primary dies mid-run.

Engine A (on service A) stores every chunk of the prompts in the cluster; engine B, on service B,
whose CPU tier starts empty and is emptied before each batch, loads them from Redis alone. Then a
primary is SIGKILLed while engine B serves the prompts again: no request fails and outputs stay the
oracle's. Once the cluster has promoted that primary's replica, every chunk is a Redis hit again,
the dead shard's included: they were copied to the replica before the kill.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench.harness import Outputs, generate_each, kv_transfer_config, make_prompt, running_engine
from kvtier.bench.introspect import scheduler_connector, worker_connector
from kvtier.connector.stats import merge_counts
from kvtier.storage.base import NamespaceSpec, Tier
from tests.e2e.oracle import assert_same_outputs
from tests.e2e.service import RunningService, running_service
from tests.reliability.conftest import before_lookup, wait_for
from tests.support.redis_server import RedisClusterServers, RedisServer

pytestmark = [pytest.mark.e2e, pytest.mark.redis]
NO_LOCAL_CACHE: dict[str, Any] = dict(enable_prefix_caching=False)
CHUNK = 64
PROMPT_LEN = 330  # five full chunks; the tail keeps tokens to compute
PROMPTS = [make_prompt(400 + i, PROMPT_LEN) for i in range(6)]
CHUNKS = len(PROMPTS) * (PROMPT_LEN // CHUNK)
HIT_TOKENS = CHUNKS * CHUNK  # every chunk of every prompt
MAX_TOKENS = 8
# A Redis call's budget: a dead primary refuses connections at once, so only a stall of the loaded
# test machine could use it up, and such a stall must not be taken for a dead node.
SETTINGS = dict(redis_timeout=5.0)


@pytest.fixture(scope="module")
def expected(tiny_model: str) -> Outputs:
    with running_engine(tiny_model, **NO_LOCAL_CACHE) as llm:
        return generate_each(llm, PROMPTS, MAX_TOKENS)


def counts(llm: Any) -> dict[str, Any]:
    """Scheduler- and worker-side connector counters since the engine started."""
    sched, worker = scheduler_connector(llm)._sched, worker_connector()._worker
    return {
        **merge_counts(sched.totals, asdict(sched.counters)),
        **merge_counts(worker.totals, asdict(worker.counters)),
    }


def delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """Counter increments between two readings."""
    return {k: after[k] - before.get(k, 0) for k in after}


def wait_stored(svc: RunningService, chunks: int) -> None:
    """Wait until the write-behind queue is empty and the Redis tier counted `chunks` stores."""

    def stored() -> bool:
        stats = svc.stats()
        return stats["write_queue_depth"] == 0 and stats["tiers"]["redis"]["stores"] >= chunks

    wait_for(stored, 30, f"{chunks} stores in Redis")


def empty_cpu(svc: RunningService) -> None:
    """Drop the service's CPU copies, so its next lookups can find chunks in Redis only."""
    svc.clear(Tier.CPU)
    assert svc.stats()["tiers"]["cpu"]["chunks"] == 0


PROBE_SPEC = NamespaceSpec(
    model="kvtier-cluster-probe", kv_dtype="none", kv_layout="none", block_size=1, chunk_size=1,
    num_layers=1, page_bytes=4096,
)  # fmt: skip


def wait_redis_healthy(svc: RunningService) -> None:
    """Look up 64 absent chunks (some on every shard, all but surely) until the service says its
    Redis tier is healthy: every node of the slot map takes calls, so a dead primary's slots are
    mapped to its promoted replica. A call refused for the dead node is what makes the tier check
    the cluster's slot map, hence the lookups."""
    namespace = svc.client.hello(PROBE_SPEC).result(10).namespace

    def healthy() -> bool:
        svc.client.lookup(namespace, [os.urandom(32) for _ in range(64)], "cluster-probe").result(10)
        svc.client.release("cluster-probe")
        return bool(svc.stats()["tiers"]["redis"]["healthy"])

    wait_for(healthy, 30, "service B's Redis tier to be healthy")


def busiest_primary(cluster: RedisClusterServers) -> tuple[RedisServer, int]:
    """The primary holding the most keys (every key in this cluster is a chunk), and its count."""
    sizes = [(int(n.command("DBSIZE").strip(b":\r\n")), n.port) for n in cluster.primary_nodes()]
    keys, port = max(sizes)
    return cluster.node(port), keys


def redis_loads(d: dict[str, Any]) -> tuple[int, ...]:
    """Admissions, Redis hit tokens, external tokens, CPU hit tokens, chunks loaded and failed."""
    keys = ("admissions", "hit_tokens_redis", "external_tokens", "hit_tokens_cpu", "loaded_chunks")
    return (*(d[k] for k in keys), d["failed_load_chunks"])


# Every prompt admitted once with every one of its chunks loaded from Redis, none failed.
ALL_FROM_REDIS = (len(PROMPTS), HIT_TOKENS, HIT_TOKENS, 0, CHUNKS, 0)


def engine_config(svc: RunningService) -> dict[str, Any]:
    """kvtier on for an engine, served by svc."""
    return kv_transfer_config(service_url=svc.url, chunk_size=CHUNK)


def store_with_engine_a(tiny_model: str, expected: Outputs, settings: dict[str, Any], tmp: Path) -> None:
    """Engine A on service A: the oracle's outputs, and every chunk written to the cluster."""
    with running_service(tmp, **settings) as svc_a:
        with running_engine(tiny_model, engine_config(svc_a), **NO_LOCAL_CACHE) as llm:
            assert_same_outputs(expected, generate_each(llm, PROMPTS, MAX_TOKENS))
        wait_stored(svc_a, CHUNKS)
        assert svc_a.stats()["tiers"]["redis"]["stores"] == CHUNKS


def test_two_services_share_a_cluster_through_a_primary_failover(
    tiny_model: str, expected: Outputs, redis_cluster_replicated: RedisClusterServers, tmp_path: Path
) -> None:
    cluster = redis_cluster_replicated
    settings = dict(redis_url=cluster.url, **SETTINGS)
    store_with_engine_a(tiny_model, expected, settings, tmp_path / "a")
    cluster.wait_synced()  # every chunk is on its primary's replica too
    victim, victim_keys = busiest_primary(cluster)
    (replica,) = cluster.replicas_of(victim)

    with running_service(tmp_path / "b", **settings) as svc_b:
        with running_engine(tiny_model, engine_config(svc_b), **NO_LOCAL_CACHE) as llm:
            # Engine B loads what engine A stored, from Redis alone.
            before = counts(llm)
            assert_same_outputs(expected, generate_each(llm, PROMPTS, MAX_TOKENS))
            shared = delta(counts(llm), before)

            # The busiest primary is SIGKILLed once two requests of this batch were looked up (one
            # at a time), before the third's lookup starts.
            empty_cpu(svc_b)
            before = counts(llm)
            seen: dict[str, int] = {}

            def kill() -> None:
                seen["lookups_at_kill"] = svc_b.stats()["lookups"]
                cluster.kill(victim)

            with before_lookup(llm, 3, kill) as killed:
                during_kill = generate_each(llm, PROMPTS, MAX_TOKENS)
            outage, lookups_after = delta(counts(llm), before), svc_b.stats()["lookups"]

            # The replica takes over; the service follows the slot map to it.
            assert cluster.wait_failover(victim) is replica
            wait_redis_healthy(svc_b)
            empty_cpu(svc_b)
            before = counts(llm)
            assert_same_outputs(expected, generate_each(llm, PROMPTS, MAX_TOKENS))
            after = delta(counts(llm), before)
        redis_stats = svc_b.stats()["tiers"]["redis"]

    assert redis_loads(shared) == ALL_FROM_REDIS

    assert killed.is_set(), "the workload ended before the primary could be killed"
    assert seen["lookups_at_kill"] < lookups_after, "no lookup was served after the kill"
    assert_same_outputs(expected, during_kill)  # nothing failed: every request has the oracle's output
    assert (outage["admissions"], outage["lookup_errors"], outage["hit_tokens_cpu"]) == (len(PROMPTS), 0, 0)
    # Chunks a lookup counted and the kill then took were recomputed by vLLM, exactly those.
    assert outage["loaded_chunks"] + outage["failed_load_chunks"] == outage["hit_tokens_redis"] // CHUNK

    # The promoted replica holds the victim's chunks (copied before the kill) and serves them: every
    # chunk of every prompt is a Redis hit again, the tier is healthy, and it saw the dead node.
    assert int(replica.command("DBSIZE").strip(b":\r\n")) >= victim_keys > 0
    assert redis_loads(after) == ALL_FROM_REDIS
    assert redis_stats["healthy"], redis_stats
    assert redis_stats["errors_by_kind"].get("connection", 0) >= 1, redis_stats
