"""Load through vLLM's OpenAI server (CPU build) with kvtier on its embedded default, and leak checks.

The same requests go to two servers started side by side from the same arguments (vLLM's defaults,
its prefix cache on), one without any connector (the baseline) and one with kvtier; a small KV cache
(32 blocks of 32 tokens) forces preemptions under 20 concurrent clients and cannot hold the eight
shared prefixes (52 blocks), so vLLM's own cache serves only part of the reuse and kvtier the rest.
Each server runs vLLM's scheduler and worker in its engine process (the "uni" executor): on this
2-core machine a separate worker process makes the run twice as long. Every response must equal the
baseline's token for token.
Then the embedded service must hold no lease, keep no slot beyond its stored chunks, not have grown
(anonymous RSS, the arena excluded) by more than 10% since warm-up, and leave nothing behind once
the server is stopped (SIGTERM to its process group, as an operator or an orchestrator does).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench.harness import kv_transfer_config
from tests.reliability.conftest import wait_for
from tests.reliability.openai_load import (
    admin_stats,
    free_port,
    kvtier_files,
    make_requests,
    metric_total,
    rss_anon_kib,
    run_load,
    running_servers,
    service_pids,
)
from tests.support.processes import exits

pytestmark = pytest.mark.e2e

WARMUP = 40
LOAD = 300
CONCURRENCY = 20
MAX_TOKENS = 8
CHUNK = 64
QUERIES, LOCAL, EXTERNAL, KVTIER = SERVED = (
    "vllm:prefix_cache_queries_total",  # counted only while vLLM's own prefix cache is on
    "vllm:prefix_cache_hits_total",  # served by vLLM's own cache, at first admissions
    "vllm:external_prefix_cache_hits_total",  # served by the connector, at first admissions
    "vllm:kvtier_external_tokens_total",  # kvtier's own count, re-admissions after preemption too
)
# kvtier serves at least this much of the ~900 reused chunks: the eight prefixes (52 blocks) never fit
# in vLLM's 32-block cache together, so many requests find theirs evicted there.
KVTIER_MIN_TOKENS = 50 * 64
SERVER_ARGS = [
    "--max-model-len", "512", "--kv-cache-memory-bytes", str(64 << 20),
    "--num-gpu-blocks-override", "32",
    "--distributed-executor-backend", "uni",
]  # fmt: skip


def _reused_tokens(requests: list[tuple[str, list[int]]], warm: int, chunk: int) -> int:
    """Tokens of the requests after the first warm ones that lie in whole chunks of a prefix one
    of those warm requests shares (at most all but a prompt's last token, as vLLM asks).

    kvtier stored those chunks during the warm-up, so at a request's first admission vLLM's own cache
    (local hit) and kvtier (external tokens, from the local hit up to the last stored chunk) together
    serve at least these tokens of it.
    """
    seen = [prompt for _, prompt in requests[:warm]]
    total = 0
    for _, prompt in requests[warm:]:
        shared = max(_common_prefix(prompt, other) for other in seen)
        total += min(shared, len(prompt) - 1) // chunk * chunk
    return total


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return n


def _quiet(admin: int) -> dict[str, Any]:
    """The embedded service's stats once no lease is held and no write is queued."""

    def check() -> dict[str, Any] | None:
        stats = admin_stats(admin)
        return stats if stats["leases_active"] == 0 and stats["write_queue_depth"] == 0 else None

    return wait_for(check, 90, "the embedded service to release every lease")


def test_openai_server_under_load_matches_baseline_and_leaks_nothing(
    tiny_model: str, tmp_path: Path, shm_dir: Path
) -> None:
    shm = shm_dir
    admin = free_port()
    kv = kv_transfer_config(chunk_size=CHUNK, cpu_size="16MiB", shm_dir=str(shm), admin_port=admin)
    requests = make_requests(WARMUP + LOAD, seed=11)
    runtime = Path(os.environ["XDG_RUNTIME_DIR"]) / "kvtier"
    specs = [("baseline", SERVER_ARGS, None), ("kvtier", SERVER_ARGS, kv)]
    with running_servers(tiny_model, tmp_path, specs) as (base, kvt):
        (service,) = service_pids(kvt.proc.pid)  # the embedded service, started by the connector
        warm = run_load(kvt, requests[:WARMUP], CONCURRENCY, MAX_TOKENS)
        _quiet(admin)
        rss_warm = rss_anon_kib(service)
        before = kvt.metrics()
        load = run_load(kvt, requests[WARMUP:], CONCURRENCY, MAX_TOKENS)
        served = {name: metric_total(kvt.metrics(), name) - metric_total(before, name) for name in SERVED}
        stats = _quiet(admin)
        rss_load = rss_anon_kib(service)
        preemptions = metric_total(kvt.metrics(), "vllm:num_preemptions_total")
        expected = run_load(base, requests, CONCURRENCY, MAX_TOKENS)
        files_running = kvtier_files(shm, runtime)
    # The server is stopped: its embedded service must go with it and take its files along.
    gone, left = exits(service, 30), kvtier_files(shm, runtime)

    failed = {**warm.errors, **load.errors, **expected.errors}
    assert not failed, f"failed requests: {failed}"
    assert load.max_in_flight >= 16, load.max_in_flight
    assert preemptions > 0, "the small KV cache preempted requests"
    got = {**warm.tokens, **load.tokens}
    differ = [rid for rid, _ in requests if got[rid] != expected.tokens[rid]]
    assert not differ, f"{len(differ)} of {len(requests)} responses differ from the baseline: {differ[:5]}"
    # Nothing was evicted, so every chunk of a prefix the warm-up completed is served in the load:
    # what vLLM's own cache did not serve of it, kvtier did.
    assert stats["tiers"]["cpu"]["evictions"] == 0
    reused = _reused_tokens(requests, WARMUP, CHUNK)
    assert reused > 100 * CHUNK  # the workload does share prefixes
    assert served[QUERIES] > 0, "vLLM's own prefix cache is on"
    assert served[EXTERNAL] >= reused - served[LOCAL], f"{served}, {reused} tokens reused"
    assert served[EXTERNAL] >= KVTIER_MIN_TOKENS, f"kvtier served little of the reuse: {served}"
    assert served[KVTIER] >= served[EXTERNAL], served
    assert len(files_running) == 2, files_running  # one socket, one arena while it runs
    # Leaks: no lease held, no slot beyond the stored chunks, memory flat after warm-up.
    assert stats["leases_active"] == 0
    assert stats["slots_in_use"] == stats["tiers"]["cpu"]["chunks"], (
        f"{stats['slots_in_use']} slots in use for {stats['tiers']['cpu']['chunks']} stored chunks"
    )
    assert abs(rss_load - rss_warm) <= 0.10 * rss_warm, f"service RSS {rss_warm} -> {rss_load} KiB"
    assert gone, "the embedded service outlived its server"
    assert not left, f"left behind after the server stopped: {left}"
