"""Redis dies, comes back, or slows down under a running vLLM engine: outputs never change.

The service has only a Redis lower tier and a small CPU tier, which the tests empty before each batch
that should look in Redis, so every lookup of a stored prefix goes to Redis. vLLM's prefix cache is
on; ``forget_local`` empties it before those batches, so each of their prompts asks kvtier for all
three prefix chunks.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.bench.harness import generate, generate_each, kv_transfer_config, running_engine
from tests.e2e.oracle import assert_same_outputs
from tests.reliability.conftest import (
    CHUNK,
    MAX_TOKENS,
    PREFIX_TOKENS,
    Oracle,
    batch,
    before_lookup,
    clear_cpu,
    delta,
    forget_local,
    local_hits,
    redis_ready,
    sched_counts,
    wait_for,
    wait_stored,
    worker_counts,
)
from tests.reliability.proxy import LatencyProxy

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

BREAKER_PERIOD = 0.5
PROXY_DELAY = 0.2
# The slow test's Redis call budget: well past the proxy's delay, because the proxy's threads share
# the test process with a running vLLM engine, and a busy machine adds hundreds of ms to each reply.
SLOW_REDIS_TIMEOUT = 3.0
SMALL_CPU = "4MiB"  # 64 chunks of the tiny model


def _redis_errors(stats: dict) -> dict[str, int]:
    return dict(stats["tiers"]["redis"]["errors_by_kind"])


def test_redis_killed_mid_workload_then_restarted(
    tiny_model: str, oracle: Oracle, redis_server_fn, services, tmp_path: Path
) -> None:
    a, b = [0, 1, 2, 3], [4, 5, 6, 7]
    sp = services(
        tmp_path / "svc",
        redis_url=redis_server_fn.url,
        cpu_size=SMALL_CPU,
        breaker_period=BREAKER_PERIOD,
        redis_timeout=1.0,
    )
    svc = sp.start()
    redis_ready(svc)
    cfg = kv_transfer_config(service_url=sp.url, chunk_size=CHUNK)
    with running_engine(tiny_model, cfg) as llm:
        # Redis up: store group A, then load it back from Redis alone.
        assert_same_outputs(oracle(batch(a, 0)), generate(llm, batch(a, 0), MAX_TOKENS))
        wait_stored(svc, "redis", len(a) * 3)
        clear_cpu(svc)
        forget_local(llm)
        local0, before, s0 = local_hits(llm), svc.hit_tokens(), sched_counts(llm)
        assert_same_outputs(oracle(batch(a, 1)), generate_each(llm, batch(a, 1), MAX_TOKENS))
        up_hits, up_s = delta(svc.hit_tokens(), before), delta(sched_counts(llm), s0)

        # kill -9 Redis while a workload runs: after the lookups of this batch's first two prompts
        # (one at a time) were served, before the third's starts.
        clear_cpu(svc)
        forget_local(llm)
        with before_lookup(llm, 3, redis_server_fn.kill) as killed:
            got = generate_each(llm, batch(a, 2), MAX_TOKENS)
        assert killed.is_set(), "the workload ended before Redis could be killed in its middle"
        assert_same_outputs(oracle(batch(a, 2)), got)

        # Redis down: every lookup is answered (a miss), none fails, nothing waits on Redis.
        clear_cpu(svc)
        forget_local(llm)
        s0, w0 = sched_counts(llm), worker_counts()
        assert_same_outputs(oracle(batch(a, 3)), generate_each(llm, batch(a, 3), MAX_TOKENS))
        down_s, down_w = delta(sched_counts(llm), s0), delta(worker_counts(), w0)
        stats = svc.stats()
        errors = _redis_errors(stats)

        # Redis back on the same port (empty: no persistence); after the breaker period it is used.
        redis_server_fn.restart()
        redis_ready(svc)
        stores0 = svc.stats()["tiers"]["redis"]["stores"]
        assert_same_outputs(oracle(batch(b, 0)), generate(llm, batch(b, 0), MAX_TOKENS))
        wait_stored(svc, "redis", stores0 + len(b) * 3)
        clear_cpu(svc)
        forget_local(llm)
        before, s1 = svc.hit_tokens(), sched_counts(llm)
        assert_same_outputs(oracle(batch(b, 1)), generate_each(llm, batch(b, 1), MAX_TOKENS))
        after, back_s = svc.stats(), delta(sched_counts(llm), s1)
        local = local_hits(llm) - local0
    # Redis up: every prefix came from Redis alone, none from vLLM's own cache (emptied before each batch).
    assert up_hits == {"cpu": 0, "disk": 0, "redis": len(a) * PREFIX_TOKENS, "object": 0}, up_hits
    assert up_s["external_tokens"] == len(a) * PREFIX_TOKENS, up_s
    assert local == 0
    assert down_s["admissions"] == len(a), down_s
    assert down_s["lookup_count"] == len(a), "every lookup got an answer while Redis was down"
    assert down_s["lookup_errors"] == 0, "a dead Redis is a miss in the service, not a failed call"
    assert down_s["external_tokens"] == 0, down_s
    assert down_w["loaded_chunks"] == 0 and down_w["failed_load_chunks"] == 0, down_w
    # The service counted the outage: refused connections, then calls skipped by the open breaker.
    assert errors.get("connection", 0) >= 1, errors
    assert errors.get("unavailable", 0) >= 1, errors
    resumed = delta(after["hit_tokens"], before)
    assert resumed == {"cpu": 0, "disk": 0, "redis": len(b) * PREFIX_TOKENS, "object": 0}, (
        f"hits resumed: {resumed}"
    )
    assert back_s["external_tokens"] == len(b) * PREFIX_TOKENS, back_s
    assert after["tiers"]["redis"]["healthy"], after["tiers"]["redis"]


def test_slow_redis_never_blocks_the_scheduler(
    tiny_model: str, oracle: Oracle, redis_server, services, tmp_path: Path
) -> None:
    """Every Redis reply 200 ms late: lookups are deferred (never waited on) and still hit."""
    groups = [8, 9, 10, 11]
    with LatencyProxy(redis_server.port, delay=PROXY_DELAY) as proxy:
        sp = services(
            tmp_path / "svc",
            redis_url=proxy.url,
            cpu_size=SMALL_CPU,
            breaker_period=BREAKER_PERIOD,
            redis_timeout=SLOW_REDIS_TIMEOUT,
        )
        svc = sp.start()
        redis_ready(svc)
        cfg = kv_transfer_config(service_url=sp.url, chunk_size=CHUNK)  # lookup budget 5 ms
        with running_engine(tiny_model, cfg) as llm:
            assert_same_outputs(oracle(batch(groups, 0)), generate(llm, batch(groups, 0), MAX_TOKENS))
            wait_stored(svc, "redis", len(groups) * 3)
            clear_cpu(svc)
            forget_local(llm)
            s0, hits0, delayed0, local0 = (
                sched_counts(llm),
                svc.hit_tokens(),
                proxy.responses_delayed,
                local_hits(llm),
            )
            assert_same_outputs(oracle(batch(groups, 1)), generate_each(llm, batch(groups, 1), MAX_TOKENS))
            slow = delta(sched_counts(llm), s0)
            hits = delta(svc.hit_tokens(), hits0)
            delayed = proxy.responses_delayed - delayed0
            slow_stats = svc.stats()

            # Redis hangs (the proxy holds every byte): calls time out, the breaker opens, misses.
            clear_cpu(svc)
            forget_local(llm)
            proxy.pause()
            try:
                s1 = sched_counts(llm)
                got = generate_each(llm, batch(groups, 2), MAX_TOKENS)
                hung = delta(sched_counts(llm), s1)
                local = local_hits(llm) - local0
                # The engine may finish before a hung call's timeout ends; the service counts it then.
                wait_for(
                    lambda: _redis_errors(svc.stats()).get("timeout", 0) >= 1,
                    SLOW_REDIS_TIMEOUT + 10,
                    "a Redis timeout to be counted",
                )
            finally:
                proxy.resume()
            wait_for(lambda: svc.stats()["write_queue_depth"] == 0, 30, "writes to drain")
    assert_same_outputs(oracle(batch(groups, 2)), got)
    assert delayed > 0, "Redis replies went through the slow proxy"
    served = len(groups) * PREFIX_TOKENS
    assert hits == {"cpu": 0, "disk": 0, "redis": served, "object": 0}, (
        f"slow Redis still served every stored prefix: {slow_stats}"
    )
    assert slow["external_tokens"] == served, (slow, slow_stats)
    assert local == 0, "vLLM's own cache served part of a batch that had to come from kvtier"
    # No Redis reply can arrive within the 5 ms budget, so every lookup that went to Redis was deferred
    # (vLLM asked again on a later step) instead of being waited on.
    assert slow["lookups_deferred"] >= len(groups), slow
    assert slow["lookup_errors"] == 0, slow
    assert hung["lookups_deferred"] >= 1, hung
    assert hung["admissions"] == len(groups) and hung["external_tokens"] == 0, hung
