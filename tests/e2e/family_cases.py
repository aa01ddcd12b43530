"""The end-to-end cases every model family and KV variant runs: tier rounds and a preemption.

Tier rounds: one engine stores PROMPTS, then hits from the CPU, disk and Redis tiers in turn, and a
load whose disk chunks vanish between lookup and load is recomputed. The rounds run on a fresh
service, or on one shared with other engines whose chunks are already stored there: every count is
taken relative to what the service held before, and the first (cold) round records its hits, which
must be none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.bench.harness import (
    Outputs,
    generate,
    generate_each,
    kv_transfer_config,
    make_prompt,
    preemptions,
    running_engine,
)
from kvtier.bench.introspect import scheduler_connector, scheduler_totals, worker_connector, worker_totals
from kvtier.storage.base import Tier
from tests.app import wait_until
from tests.e2e.oracle import (
    PREEMPTION_MAX_TOKENS,
    PREEMPTION_PROMPT_LEN,
    Probe,
    assert_same_outputs,
    delete_after_lookup,
    expected_external,
    forget_local_cache,
    wait_written,
)
from tests.e2e.service import RunningService, running_service

CHUNK = 64
MAX_TOKENS = 10
PROMPTS = [make_prompt(200, 330), make_prompt(201, 270)]
STORED = sum(len(p) // CHUNK for p in PROMPTS)  # 5 + 4 full chunks
HIT = sum(expected_external(len(p) // CHUNK, 0, len(p), CHUNK) for p in PROMPTS)  # 320 + 256
DOOMED = [1, 3]  # chunks of PROMPTS[0] deleted from disk between its lookup and its load
NO_HITS = {"cpu": 0, "disk": 0, "redis": 0, "object": 0}
PREEMPTION_PROMPTS = [make_prompt(11, PREEMPTION_PROMPT_LEN), make_prompt(12, PREEMPTION_PROMPT_LEN)]


@dataclass(frozen=True)
class TierRounds:
    """What one engine did over the rounds: hits per round (tokens by tier), the failed load, and
    the namespace it stored under."""

    hits: dict[str, dict[str, int]]
    planned_doomed_blocks: set[int]
    failed_blocks: set[int]
    failed_requests: set[str]
    doomed_request: str
    failed_chunks: int
    loaded_tokens: int
    namespace: str
    spec: Any  # the connector's NamespaceSpec


def _quiet(svc: RunningService) -> None:
    """Wait (bounded) until no write-behind is queued and no lease is held."""
    if not wait_until(lambda: svc.stats()["write_queue_depth"] == 0, 30, interval=0.05):
        raise AssertionError(f"write-behind never drained: {svc.stats()}")
    svc.wait_leases_ended()


def _hits_since(svc: RunningService, before: dict[str, int]) -> dict[str, int]:
    now = svc.hit_tokens()
    return {tier: now[tier] - before.get(tier, 0) for tier in now}


def _round(llm: Any, svc: RunningService, expected: Outputs | None) -> dict[str, int]:
    """One round of PROMPTS into an emptied vLLM cache (its outputs `expected`, unless None); its hits."""
    before = svc.hit_tokens()
    forget_local_cache(llm)
    got = generate_each(llm, PROMPTS, MAX_TOKENS)
    if expected is not None:
        assert_same_outputs(expected, got)
    return _hits_since(svc, before)


def _tier_stat(svc: RunningService, tier: str, name: str) -> int:
    return int(svc.stats()["tiers"][tier][name])


def run_tier_rounds(
    model: str,
    tmp: Path,
    redis_url: str,
    cold: Outputs,
    warm: Outputs | None,
    failed: Sequence[int] | None,
    **engine: Any,
) -> TierRounds:
    """The rounds of one engine on a fresh service with a disk tier and `redis_url` (see tier_rounds_on)."""
    disk = tmp / "disk"
    with running_service(tmp / "svc", disk_path=disk, redis_url=redis_url) as svc:
        return tier_rounds_on(svc, disk, model, cold, warm, failed, **engine)


def tier_rounds_on(
    svc: RunningService,
    disk: Path,
    model: str,
    cold: Outputs,
    warm: Outputs | None,
    failed: Sequence[int] | None,
    **engine: Any,
) -> TierRounds:
    """Store PROMPTS, then load them from CPU, disk and Redis, and lose DOOMED chunks of PROMPTS[0]
    between its lookup and its load, on `svc` (whose disk tier is at `disk`); `cold`, `warm` and
    `failed` are the outputs each must give (None: those outputs are not compared)."""
    hits: dict[str, dict[str, int]] = {}
    cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK)
    with running_engine(model, cfg, **engine) as llm:
        ns = scheduler_connector(llm)._sched.cfg
        held = _tier_stat(svc, "cpu", "chunks")
        stores = {tier: _tier_stat(svc, tier, "stores") for tier in ("disk", "redis")}
        before = svc.hit_tokens()
        got = generate_each(llm, PROMPTS, MAX_TOKENS)  # stores
        hits["cold"] = _hits_since(svc, before)
        # Checked first: a hit on another engine's chunks is the likelier cause of different outputs.
        assert hits["cold"] == NO_HITS, f"the first round hit chunks this engine never stored: {hits}"
        assert_same_outputs(cold, got)
        wait_written(svc, "disk", stores["disk"] + STORED)
        wait_written(svc, "redis", stores["redis"] + STORED)
        hits["cpu"] = _round(llm, svc, warm)
        assert svc.clear(Tier.CPU) == held + STORED
        hits["disk"] = _round(llm, svc, warm)
        # The failed load: PROMPTS[0]'s chunks are on disk only, two of them vanish after lookup.
        svc.clear(Tier.CPU)
        forget_local_cache(llm)
        probe = Probe(scheduler_connector(llm), worker_connector())
        loaded = worker_totals()["loaded_tokens"]
        # Under this engine's namespace only: another engine on the service may hold the same hashes.
        own_disk = disk / ns.namespace
        hit = delete_after_lookup(scheduler_connector(llm), own_disk, len(PROMPTS[0]) // CHUNK, DOOMED)
        got = generate(llm, PROMPTS[:1], MAX_TOKENS)
        if failed is not None:
            assert_same_outputs(Outputs([list(failed)]), got)
        work = worker_totals()
        (req_id,) = hit
        doomed = probe.blocks_of(req_id, DOOMED)
        # Only Redis holds the chunks now.
        _quiet(svc)
        svc.clear(Tier.CPU, Tier.DISK)
        hits["redis"] = _round(llm, svc, warm)
    return TierRounds(
        hits,
        doomed,
        probe.failed_blocks,
        probe.failed_requests,
        req_id,
        work["failed_load_chunks"],
        work["loaded_tokens"] - loaded,
        ns.namespace,
        ns.spec,
    )


def check_tier_rounds(rounds: TierRounds, block: int, groups: int = 1) -> None:
    """Nothing hit before the engine stored, every round hit exactly its tier's HIT tokens, and the
    failed load reported exactly its blocks; an engine of several KV cache groups reports the request
    instead (vLLM then recomputes it whole)."""
    assert rounds.hits["cold"] == NO_HITS, "the first round hit chunks this engine never stored"
    assert rounds.hits["cpu"] == {**NO_HITS, "cpu": HIT}
    assert rounds.hits["disk"] == {**NO_HITS, "disk": HIT}
    assert rounds.hits["redis"] == {**NO_HITS, "redis": HIT}
    if groups > 1:
        assert rounds.failed_requests == {rounds.doomed_request} and rounds.failed_blocks == set()
        assert rounds.failed_chunks == len(PROMPTS[0]) // CHUNK, "every chunk of the failed load"
        # Recomputed whole, the request looked up again and loaded every chunk: Redis still holds
        # the ones lost from disk.
        assert rounds.loaded_tokens == len(PROMPTS[0]) // CHUNK * CHUNK
        return
    assert rounds.failed_requests == set()
    assert len(rounds.planned_doomed_blocks) == len(DOOMED) * CHUNK // block
    assert rounds.failed_blocks == rounds.planned_doomed_blocks, "exactly the lost chunks' blocks failed"
    assert rounds.failed_chunks == len(DOOMED)
    # The chunks before, between and after the lost ones were loaded.
    assert rounds.loaded_tokens == (len(PROMPTS[0]) // CHUNK - len(DOOMED)) * CHUNK


@dataclass(frozen=True)
class PreemptionRun:
    """Outputs and kvtier's answers of one run that forces a preemption."""

    outputs: Outputs
    preempted: int
    admissions: list[Any]
    sched: dict[str, Any]
    work: dict[str, Any]


def run_preemption(model: str, tmp: Path, chunk: int, **engine: Any) -> PreemptionRun:
    """PREEMPTION_PROMPTS together on an engine too small for both (chunks of `chunk` tokens)."""
    with running_service(tmp / "svc") as svc:
        cfg = kv_transfer_config(service_url=svc.url, chunk_size=chunk)
        with running_engine(model, cfg, **engine) as llm:
            probe = Probe(scheduler_connector(llm), worker_connector())
            got = generate(llm, PREEMPTION_PROMPTS, PREEMPTION_MAX_TOKENS)
            return PreemptionRun(
                got, preemptions(llm), probe.admissions(), scheduler_totals(llm), worker_totals()
            )


def check_preemption(run: PreemptionRun, expected: Outputs | None, block: int) -> None:
    """The preempted request resumed with every whole block vLLM lacks from kvtier, loaded cleanly
    (and its outputs are `expected`, unless None)."""
    if expected is not None:
        assert_same_outputs(expected, run.outputs)
    resumed = [a for a in run.admissions if a.preemptions > 0]
    assert run.preempted >= 1 and len(resumed) == run.preempted
    assert [a.external for a in run.admissions if a.preemptions == 0] == [0, 0], "nothing stored yet"
    for a in resumed:
        assert a.hit_chunks == (a.num_tokens - 1) // block
        assert a.external == a.expected(block) == (a.num_tokens - 1) // block * block - a.local > 0
    reloaded = sum(a.external for a in resumed)
    assert run.sched["external_tokens"] == reloaded == run.work["loaded_tokens"]
    assert run.work["failed_load_blocks"] == 0 and run.sched["lookup_errors"] == 0
