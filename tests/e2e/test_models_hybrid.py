"""A sliding-window hybrid (Gemma-3-shaped: sliding-window layers around a full-attention one).

kvtier's connector does not declare ``SupportsHMA``, so vLLM turns its hybrid KV cache manager off:
every layer, sliding-window ones included, keeps all its blocks in one KV cache group of
``FullAttentionSpec`` and a chunk holds every layer's blocks. The baseline engine without a
connector runs with the hybrid manager on; only outputs are compared, and they must be identical.

The rounds below are shared with the MLA tests: one engine stores, then hits from the CPU, disk and
Redis tiers, and a load whose disk chunks vanish between lookup and load is recomputed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

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
from kvtier.bench.models import build_gemma3_model, build_granite_hybrid_model
from kvtier.storage.base import Tier
from tests.app import wait_until
from tests.e2e.oracle import (
    PREEMPTION_ENGINE,
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

pytestmark = pytest.mark.e2e

CHUNK = 64
MAX_TOKENS = 10
PROMPTS = [make_prompt(200, 330), make_prompt(201, 270)]
STORED = sum(len(p) // CHUNK for p in PROMPTS)  # 5 + 4 full chunks
HIT = sum(expected_external(len(p) // CHUNK, 0, len(p), CHUNK) for p in PROMPTS)  # 320 + 256
DOOMED = [1, 3]  # chunks of PROMPTS[0] deleted from disk between its lookup and its load
PREEMPTION_PROMPTS = [make_prompt(11, PREEMPTION_PROMPT_LEN), make_prompt(12, PREEMPTION_PROMPT_LEN)]


@dataclass(frozen=True)
class TierRounds:
    """What one engine did over the rounds: hits per round (tokens by tier) and the failed load."""

    hits: dict[str, dict[str, int]]
    planned_doomed_blocks: set[int]
    failed_blocks: set[int]
    failed_chunks: int
    loaded_tokens: int


def _quiet(svc: RunningService) -> None:
    """Wait (bounded) until no write-behind is queued and no lease is held."""
    if not wait_until(lambda: svc.stats()["write_queue_depth"] == 0, 30, interval=0.05):
        raise AssertionError(f"write-behind never drained: {svc.stats()}")
    svc.wait_leases_ended()


def _round(llm: Any, svc: RunningService, expected: Outputs | None, before: dict[str, int]) -> dict[str, int]:
    """One round of PROMPTS into an emptied vLLM cache (its outputs `expected`, unless None); its hits."""
    forget_local_cache(llm)
    got = generate_each(llm, PROMPTS, MAX_TOKENS)
    if expected is not None:
        assert_same_outputs(expected, got)
    now = svc.hit_tokens()
    return {tier: now[tier] - before.get(tier, 0) for tier in now}


def run_tier_rounds(
    model: str,
    tmp: Path,
    redis_url: str,
    cold: Outputs,
    warm: Outputs | None,
    failed: Sequence[int] | None,
    **engine: Any,
) -> TierRounds:
    """Store PROMPTS, then load them from CPU, disk and Redis, and lose DOOMED chunks of PROMPTS[0]
    between its lookup and its load; `cold`, `warm` and `failed` are the outputs each must give
    (None: those outputs are not compared)."""
    disk = tmp / "disk"
    hits: dict[str, dict[str, int]] = {}
    with running_service(tmp / "svc", disk_path=disk, redis_url=redis_url) as svc:
        cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK)
        with running_engine(model, cfg, **engine) as llm:
            assert_same_outputs(cold, generate_each(llm, PROMPTS, MAX_TOKENS))  # stores
            wait_written(svc, "disk", STORED)
            wait_written(svc, "redis", STORED)
            hits["cpu"] = _round(llm, svc, warm, svc.hit_tokens())
            assert svc.clear(Tier.CPU) == STORED
            hits["disk"] = _round(llm, svc, warm, svc.hit_tokens())
            # The failed load: PROMPTS[0]'s chunks are on disk only, two of them vanish after lookup.
            svc.clear(Tier.CPU)
            forget_local_cache(llm)
            probe = Probe(scheduler_connector(llm), worker_connector())
            loaded = worker_totals()["loaded_tokens"]
            hit = delete_after_lookup(scheduler_connector(llm), disk, len(PROMPTS[0]) // CHUNK, DOOMED)
            got = generate(llm, PROMPTS[:1], MAX_TOKENS)
            if failed is not None:
                assert_same_outputs(Outputs([list(failed)]), got)
            work = worker_totals()
            (req_id,) = hit
            doomed = probe.blocks_of(req_id, DOOMED)
            # Only Redis holds the chunks now.
            _quiet(svc)
            svc.clear(Tier.CPU, Tier.DISK)
            hits["redis"] = _round(llm, svc, warm, svc.hit_tokens())
    return TierRounds(
        hits, doomed, probe.failed_blocks, work["failed_load_chunks"], work["loaded_tokens"] - loaded
    )


def check_tier_rounds(rounds: TierRounds, block: int) -> None:
    """Every round hit exactly its tier's HIT tokens, and the failed load reported exactly its blocks."""
    assert rounds.hits["cpu"] == {"cpu": HIT, "disk": 0, "redis": 0}
    assert rounds.hits["disk"] == {"cpu": 0, "disk": HIT, "redis": 0}
    assert rounds.hits["redis"] == {"cpu": 0, "disk": 0, "redis": HIT}
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


# ------------------------------------------------------------------------------ the Gemma-3 tests
@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_gemma3_model(tmp_path_factory.mktemp("models") / "tiny-gemma3"))


@pytest.fixture(scope="module")
def baseline(gemma3: str) -> dict[str, Outputs]:
    """Outputs of the engine without a connector (hybrid KV cache manager on), prompts one at a time."""
    with running_engine(gemma3) as llm:
        return {
            "prompts": generate_each(llm, PROMPTS, MAX_TOKENS),
            "preemption": generate_each(llm, PREEMPTION_PROMPTS, PREEMPTION_MAX_TOKENS),
        }


def test_outputs_vary_so_the_oracle_can_fail(baseline: dict[str, Outputs]) -> None:
    for tokens in baseline["prompts"].tokens + baseline["preemption"].tokens:
        assert len(set(tokens)) > len(tokens) // 2, f"the random model repeats itself: {tokens}"


def test_hits_from_every_tier_and_a_failed_load(
    gemma3: str, baseline: dict[str, Outputs], redis_server, tmp_path: Path
) -> None:
    expected = baseline["prompts"]
    rounds = run_tier_rounds(gemma3, tmp_path, redis_server.url, expected, expected, expected.tokens[0])
    check_tier_rounds(rounds, block=32)


def test_preempted_request_reloads_its_chunks(
    gemma3: str, baseline: dict[str, Outputs], tmp_path: Path
) -> None:
    run = run_preemption(gemma3, tmp_path, 32, **PREEMPTION_ENGINE)
    check_preemption(run, baseline["preemption"], block=32)


def test_a_state_space_hybrid_is_refused_by_vllm_at_start(tmp_path: Path) -> None:
    """Granite-4-shaped (Mamba-2 + attention): without SupportsHMA vLLM turns its hybrid manager off
    and cannot put Mamba state and attention blocks in one group, before any connector exists."""
    model = str(build_granite_hybrid_model(tmp_path / "tiny-granite-hybrid"))
    refused = re.escape("Failed to promote local KV cache specs to one unified type.")
    with pytest.raises(ValueError, match=f"^{refused}$"), running_engine(model, kv_transfer_config()):
        pass
