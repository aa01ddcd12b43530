"""kvtier below vLLM's own prefix cache, on as vLLM ships it: kvtier's tokens start where vLLM's local
hit ends, inside a chunk, from every tier; what vLLM's cache covers, kvtier neither loads nor saves
again. Outputs equal those of the same engine without a connector, run through the same steps."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench.harness import (
    BLOCK_SIZE,
    Outputs,
    generate,
    kv_transfer_config,
    make_prompt,
    running_engine,
)
from kvtier.bench.introspect import scheduler_connector, scheduler_totals, worker_connector, worker_totals
from kvtier.storage.base import Tier
from tests.app import wait_until
from tests.e2e.oracle import Probe, assert_same_outputs, expected_external, forget_local_cache, wait_written
from tests.e2e.service import running_service

pytestmark = pytest.mark.e2e
CHUNK = 2 * BLOCK_SIZE  # a local hit of an odd number of blocks ends inside a chunk
MAX_TOKENS = 8
DOC = make_prompt(400, 300)  # 9 full blocks, 4 full chunks
# Prompts that leave DOC's first blocks, and nothing more of it, in vLLM's cache once it forgot the
# rest: three blocks (the first whole chunk of DOC's among them, which kvtier holds), or one block
# (no whole chunk of its own: kvtier neither looks it up nor saves it).
SEED_3 = DOC[: 3 * BLOCK_SIZE] + make_prompt(401, 20)
SEED_1 = DOC[:BLOCK_SIZE] + make_prompt(402, 20)
EXTENDED = DOC + make_prompt(403, 100)  # 6 full chunks: DOC's 4, then 2 of its own
STEPS = {
    "store": [DOC],
    "cpu": [SEED_3, DOC],  # DOC's first 3 blocks local, the rest from kvtier's CPU tier
    "disk": [SEED_1, DOC],  # DOC's first block local, the rest from disk
    "redis": [SEED_1, DOC],  # DOC's first block local, the rest from Redis
    "covered": [DOC, EXTENDED],  # vLLM's cache holds all of DOC now, kvtier's chunks of it too
}
FORGETS = ("cpu", "disk", "redis")  # phases that start with vLLM's own cache emptied


def _scenario(llm: Any, before: Callable[[str], None]) -> list[list[int]]:
    """Run every phase's prompts one at a time; `before(phase)` readies the service for it, and
    `before("end")` follows the last."""
    tokens: list[list[int]] = []
    for phase, prompts in STEPS.items():
        if phase in FORGETS:
            # Also a point where the saves before it have ended: vLLM resets its cache only once
            # kvtier let go of every block it held for them.
            forget_local_cache(llm)
        before(phase)
        for prompt in prompts:
            tokens.extend(generate(llm, [prompt], MAX_TOKENS).tokens)
    forget_local_cache(llm)
    before("end")
    return tokens


def test_kvtier_tokens_start_where_vllms_local_hit_ends(
    tiny_model: str, redis_server, tmp_path: Path
) -> None:
    with running_engine(tiny_model) as llm:
        expected = Outputs(_scenario(llm, lambda phase: None))
    settings = dict(disk_path=tmp_path / "disk", redis_url=redis_server.url)
    sched: dict[str, dict[str, Any]] = {}  # scheduler-side totals as each phase began
    work: dict[str, dict[str, Any]] = {}  # worker-side totals as each phase began
    with running_service(tmp_path / "svc", **settings) as svc:
        cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK)
        with running_engine(tiny_model, cfg) as llm:
            probe = Probe(scheduler_connector(llm), worker_connector())
            before_covered: list[int] = []  # the CPU tier's stores as the last phase began

            def before(phase: str) -> None:
                sched[phase], work[phase] = scheduler_totals(llm), worker_totals()
                if phase == "cpu":
                    wait_written(svc, "disk", 4)
                    wait_written(svc, "redis", 4)
                elif phase == "disk":
                    svc.clear(Tier.CPU)
                elif phase == "redis":
                    svc.clear(Tier.CPU, Tier.DISK)
                elif phase == "covered":
                    before_covered.append(svc.stats()["tiers"]["cpu"]["stores"])

            got = Outputs(_scenario(llm, before))
        # EXTENDED's 2 chunks of its own; a commit may reach the service a moment after its save.
        stores = before_covered[0] + 2
        wait_until(lambda: svc.stats()["tiers"]["cpu"]["stores"] >= stores, 10)
        stores_at_end = svc.stats()["tiers"]["cpu"]["stores"]
    assert_same_outputs(expected, got)

    doc, seed3, seed1, ext = len(DOC), len(SEED_3), len(SEED_1), len(EXTENDED)
    from_kvtier = {  # DOC's tokens after vLLM's local hit, and SEED_3's chunk in an emptied cache
        "cpu": expected_external(1, 0, seed3, CHUNK) + expected_external(4, 3 * BLOCK_SIZE, doc, CHUNK),
        "disk": expected_external(4, BLOCK_SIZE, doc, CHUNK),
        "redis": expected_external(4, BLOCK_SIZE, doc, CHUNK),
    }
    assert from_kvtier == {"cpu": 64 + 160, "disk": 224, "redis": 224}
    admitted = [(a.num_tokens, a.local, a.hit_chunks, a.external) for a in probe.admissions()]
    assert [a for a in admitted if a[0] >= BLOCK_SIZE] == [  # the forgetting steps' prompts aside
        (doc, 0, 0, 0),
        (seed3, 0, 1, 64),  # kvtier's chunk 0, into an empty vLLM cache
        (doc, 3 * BLOCK_SIZE, 4, 160),  # from block 3: the second half of chunk 1
        (seed1, 0, 0, 0),
        (doc, BLOCK_SIZE, 4, 224),  # from block 1: the second half of chunk 0
        (seed1, 0, 0, 0),
        (doc, BLOCK_SIZE, 4, 224),
        (doc, 9 * BLOCK_SIZE, 0, 0),  # all of kvtier's chunks are under vLLM's hit: no lookup
        (ext, 9 * BLOCK_SIZE, 4, 0),  # kvtier holds 4 chunks, vLLM's hit covers them
    ]

    def delta(totals: dict[str, dict[str, Any]], phase: str, nxt: str, key: str) -> int:
        return totals[nxt].get(key, 0) - totals[phase].get(key, 0)

    for phase, nxt in itertools.pairwise([*STEPS, "end"]):
        tokens = from_kvtier.get(phase, 0)
        assert delta(sched, phase, nxt, "external_tokens") == tokens, phase
        for tier in ("cpu", "disk", "redis"):
            hits = delta(sched, phase, nxt, f"hit_tokens_{tier}")
            assert hits == (tokens if tier == phase else 0), (phase, tier)
        assert delta(work, phase, nxt, "loaded_tokens") == tokens, phase
    # Saved once: DOC's 4 chunks when first computed, then only EXTENDED's 2 chunks of its own.
    assert work["cpu"]["saved_chunks"] == 4
    assert delta(work, "cpu", "covered", "saved_chunks") == 0
    assert delta(work, "covered", "end", "saved_chunks") == 2
    assert stores_at_end == stores, "the service stored no chunk it already held"
    assert work["end"]["failed_load_blocks"] == 0
