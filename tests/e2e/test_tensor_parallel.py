"""Tensor parallel 2 on the CPU build: each rank stores and loads its own shard under its own
namespace, a chunk is a hit only when every rank holds it, and a rank that misses a chunk the other
holds reports exactly its blocks; outputs equal the same TP=2 engine's without kvtier.

The engines run in a process of their own (this module's ``main``): a TP=2 engine's workers are
processes that need the CPU build's thread binding in the environment from the start.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtier.storage.base import Tier
from tests.e2e.service import REPO, running_service
from tests.support.warm import run_module

pytestmark = pytest.mark.e2e

CHUNK = 64
PROMPT_LENS = (200, 140)  # 3 and 2 full chunks; 4 new tokens complete no further chunk
STORED = 5  # chunks per rank
REUSED = 192 + 128  # tokens taken from kvtier per rank: every stored chunk, short of the last token
MAX_TOKENS = 4
# One core per rank: without the bind list vLLM's CPU build stops with "Not enough allowed NUMA
# nodes to bind threads of 2 local CPUWorkers".
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
TP_ENGINE = dict(tensor_parallel_size=2, distributed_executor_backend="mp")


def test_two_ranks_store_and_load_their_own_shards_and_recover_a_one_rank_miss(
    tiny_model: str, tmp_path: Path
) -> None:
    disk = tmp_path / "disk"
    with running_service(tmp_path / "svc", disk_path=disk) as svc:
        out = _in_a_fresh_process({"model": tiny_model, "url": svc.url, "disk": str(disk)})
        stats = svc.stats()
    ranks = out["namespaces"]
    assert len(ranks) == 2 and ranks[0] != ranks[1]
    # Each rank stored its own shard of every chunk, and its worker registered its own namespace.
    assert out["stored_per_rank"] == [STORED, STORED]
    assert stats["namespaces"] == 2
    assert out["first"] == out["baseline"], "the first round computes everything"
    # Second round: every chunk from the CPU tier, found by both ranks' lookups and loaded by both.
    assert out["second"] == out["baseline"]
    assert out["external"][1] == REUSED
    assert out["loaded_tokens"][1] == 2 * REUSED
    # Third round, from disk: rank 1's copy of chunk 1 of the first prompt went missing between
    # lookup and load. Exactly its blocks are reported, the request recomputes them, same outputs.
    assert out["third"] == out["baseline"][:1]
    assert out["external"][2] == 192
    assert out["failed_blocks"] == out["planned_chunk1_blocks"] and len(out["failed_blocks"]) == 2
    assert out["loaded_tokens"][2] == 192 + 192 - CHUNK  # rank 0 all of it, rank 1 less chunk 1


def _in_a_fresh_process(job: dict[str, Any]) -> dict[str, Any]:
    """Run _run(job) in a process of its own with the TP environment; its JSON result."""
    env = {**os.environ, **TP_ENV, "PYTHONPATH": str(REPO)}
    done = run_module("tests.e2e.test_tensor_parallel", [json.dumps(job)], env, timeout=540)
    result = done.result()
    # The degraded mode logs what it caught of kvtier's own at ERROR, in the scheduler and each worker.
    assert "kvtier caught an unexpected error" not in done.stdout + done.stderr
    return result


# ------------------------------------------------------------------------------ the engine side
def _prompts() -> list[list[int]]:
    from kvtier.bench.harness import make_prompt

    return [make_prompt(1100 + i, n) for i, n in enumerate(PROMPT_LENS)]


class _Service:
    """The shared service as the oracle's waits need it, from the engine process."""

    def __init__(self, url: str) -> None:
        from kvtier.app.client import ServiceClient

        self.client = ServiceClient(url, name="kvtier-tp-test")

    def stats(self) -> dict[str, Any]:
        return self.client.stats().result(10)

    def clear_cpu(self) -> None:
        from tests.app import wait_until

        assert wait_until(lambda: self.stats()["leases_active"] == 0, 20), self.stats()
        self.client.clear([Tier.CPU]).result(10)


def _delete_on_rank_one(llm: Any, disk: Path, chunk: int) -> dict[str, Any]:
    """As the first lookup of a 3-chunk prompt goes out, delete rank 1's disk copy of `chunk`."""
    from kvtier.bench.introspect import scheduler_connector
    from kvtier.storage.base import ChunkKey
    from kvtier.storage.keys import disk_relpath

    sched = scheduler_connector(llm)._sched
    original, seen = sched._start_lookup, {}

    def lookup_then_delete(st: Any, hashes: list[bytes], **kwargs: Any) -> Any:
        if not seen and len(hashes) == 3:
            # Behind the service's back: its index still lists the file, so rank 1's lookup finds
            # the chunk and its read (ahead at arrival, or at load) fails.
            seen["req_id"] = st.request.request_id
            (disk / disk_relpath(ChunkKey(sched._namespaces[1], hashes[chunk]))).unlink()
        return original(st, hashes, **kwargs)

    sched._start_lookup = lookup_then_delete
    return seen


def _record_failed_blocks(llm: Any) -> set[int]:
    """Every block id the workers reported failed, as vLLM's scheduler received them."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    real, failed = scheduler.update_from_output, set()

    def update_from_output(so: Any, output: Any) -> Any:
        kv = getattr(output, "kv_connector_output", None)
        failed.update(getattr(kv, "invalid_block_ids", None) or ())
        return real(so, output)

    scheduler.update_from_output = update_from_output
    return failed


def _run(job: dict[str, Any]) -> dict[str, Any]:
    from kvtier.bench.harness import generate, kv_transfer_config, metric, running_engine
    from kvtier.bench.introspect import scheduler_connector, scheduler_totals
    from tests.e2e.oracle import forget_local_cache, wait_written

    prompts, svc, disk = _prompts(), _Service(job["url"]), Path(job["disk"])
    with running_engine(job["model"], **TP_ENGINE) as llm:
        baseline = generate(llm, prompts, MAX_TOKENS)
    cfg = kv_transfer_config(service_url=job["url"], chunk_size=CHUNK)
    external, loaded = [], []

    def counts() -> None:
        external.append(int(scheduler_totals(llm).get("external_tokens", 0)) - sum(external))
        loaded.append(int(metric(llm, "vllm:kvtier_loaded_tokens")) - sum(loaded))

    with running_engine(job["model"], cfg, **TP_ENGINE) as llm:
        first = generate(llm, prompts, MAX_TOKENS)
        wait_written(svc, "disk", 2 * STORED)  # both ranks' chunks
        counts()
        forget_local_cache(llm)
        second = generate(llm, prompts, MAX_TOKENS)
        counts()
        namespaces = list(scheduler_connector(llm)._sched._namespaces)
        stored = [sum(1 for _ in (disk / ns).rglob("*.kvt")) for ns in namespaces]
        svc.clear_cpu()
        forget_local_cache(llm)
        seen = _delete_on_rank_one(llm, disk, 1)
        failed = _record_failed_blocks(llm)
        planned: list[Any] = []
        meta = scheduler_connector(llm)._sched.build_connector_meta
        scheduler_connector(llm)._sched.build_connector_meta = lambda so: _keep(meta(so), planned)
        third = generate(llm, prompts[:1], MAX_TOKENS)
        counts()
    mine = [c for load in planned if load.req_id == seen["req_id"] for c in load.chunks]
    chunk1 = sorted({b for c in mine if c.index == 1 for b in c.block_ids})
    svc.client.close()
    return {
        "baseline": baseline.tokens, "first": first.tokens, "second": second.tokens, "third": third.tokens,
        "external": external, "loaded_tokens": loaded, "namespaces": namespaces, "stored_per_rank": stored,
        "failed_blocks": sorted(failed), "planned_chunk1_blocks": chunk1,
    }  # fmt: skip


def _keep(meta: Any, planned: list[Any]) -> Any:
    planned.extend(meta.loads)
    return meta


if __name__ == "__main__":
    print(json.dumps(_run(json.loads(sys.argv[1]))), flush=True)
