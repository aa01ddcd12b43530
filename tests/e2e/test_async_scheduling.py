"""Async scheduling forced on (EngineCore driven directly): preemption, decode saving, hits from every
tier and chunks lost between lookup and load all keep the outputs exact. vLLM's prefix cache is on,
as it ships; each run is a fresh engine, so its own cache starts empty."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtier.bench.engine_core import CoreRun, run_engine_core
from kvtier.bench.harness import Outputs, kv_transfer_config, make_prompt
from kvtier.bench.introspect import worker_connector
from kvtier.storage.base import Tier
from tests.e2e.oracle import (
    PREEMPTION_ENGINE,
    PREEMPTION_MAX_TOKENS,
    PREEMPTION_PROMPT_LEN,
    Probe,
    assert_same_outputs,
    delete_after_lookup,
    expected_external,
    wait_written,
)
from tests.e2e.service import running_service

pytestmark = pytest.mark.e2e
CHUNK = 64
PROMPTS = [make_prompt(45, 330), make_prompt(46, 270)]
MAX_TOKENS = 10
STORED = sum(len(p) // CHUNK for p in PROMPTS)  # 5 + 4 full chunks
# Each prompt's stored chunks, all but the last token's block: 320 + 256 tokens.
HIT = sum(expected_external(len(p) // CHUNK, 0, len(p), CHUNK) for p in PROMPTS)


def _probed_run(model: str, prompts: list[list[int]], max_tokens: int, cfg: dict, **kw: Any) -> tuple:
    """run_engine_core with a Probe on its connectors; (the run, the probe)."""
    probes: list[Probe] = []
    hook = kw.pop("on_start", None)

    def on_start(core: Any) -> None:
        probes.append(Probe(core.scheduler.connector, worker_connector()))
        if hook is not None:
            hook(core)

    run = run_engine_core(model, prompts, max_tokens, cfg, on_start=on_start, **kw)
    assert run.async_scheduling, "vLLM ran its AsyncScheduler"
    return run, probes[0]


@pytest.fixture(scope="module")
def expected(tiny_model: str) -> Outputs:
    """The same engine's outputs without a connector, async scheduling on too."""
    run = run_engine_core(tiny_model, PROMPTS, MAX_TOKENS)
    assert run.async_scheduling
    return run.outputs


# vLLM's own cache off for the preemption case: with it on, the resumed request finds its first
# block in vLLM's cache, and its second chunk, whose hash appeared only after the last step that
# scheduled it before the preemption, was never saved: kvtier would have nothing to reload.
PREEMPTION_NO_LOCAL_CACHE = dict(PREEMPTION_ENGINE, enable_prefix_caching=False)


def test_async_scheduling_with_preemption_and_decode_saving(tiny_model: str, tmp_path: Path) -> None:
    block = 32
    prompts = [make_prompt(41, PREEMPTION_PROMPT_LEN), make_prompt(42, PREEMPTION_PROMPT_LEN)]
    engine = PREEMPTION_NO_LOCAL_CACHE
    longer = run_engine_core(tiny_model, prompts, PREEMPTION_MAX_TOKENS + 1, **engine).outputs
    expected = Outputs([tokens[:PREEMPTION_MAX_TOKENS] for tokens in longer.tokens])
    with running_service(tmp_path / "svc") as svc:
        cfg = kv_transfer_config(service_url=svc.url, chunk_size=block, save_decode=True)
        run, probe = _probed_run(tiny_model, prompts, PREEMPTION_MAX_TOKENS, cfg, **engine)
        stats = svc.stats()
        # Prompts that end with what was decoded: their second chunk, filled by decoding under
        # async scheduling (its hash appears a step late), is found and loaded.
        extended = [p + out for p, out in zip(prompts, run.outputs.tokens, strict=True)]
        again = run_engine_core(tiny_model, extended, 1, cfg, **engine)
    assert again.async_scheduling
    assert run.preemptions >= 1
    assert_same_outputs(expected, run.outputs)
    assert again.outputs.tokens == [tokens[-1:] for tokens in longer.tokens]
    # 34-token prompts + 35 generated = 69 tokens with KV: two 32-token chunks per request.
    assert stats["tiers"]["cpu"]["stores"] == 4
    # Every re-admission after a preemption reloads the chunks kvtier holds of it, by the rule.
    resumed = [a for a in probe.admissions() if a.preemptions > 0]
    assert len(resumed) == run.connector_totals["readmissions"] == run.preemptions
    for a in resumed:
        assert a.external == a.expected(block) > 0
    assert run.connector_totals["external_tokens"] == sum(a.external for a in resumed)
    assert probe.worker.totals["loaded_tokens"] == run.connector_totals["external_tokens"]
    assert again.connector_totals["external_tokens"] == 2 * 2 * block
    assert again.connector_totals["readmissions"] == 0


def test_async_scheduling_hits_from_cpu_disk_and_redis(
    tiny_model: str, expected: Outputs, redis_server, tmp_path: Path
) -> None:
    runs: dict[str, CoreRun] = {}
    probes: dict[str, Probe] = {}
    settings = dict(disk_path=tmp_path / "disk", redis_url=redis_server.url)
    with running_service(tmp_path / "svc", **settings) as svc:
        cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK)
        for tier in ("store", "cpu", "disk", "redis"):
            if tier == "cpu":
                wait_written(svc, "disk", STORED)
                wait_written(svc, "redis", STORED)
            elif tier == "disk":
                assert svc.clear(Tier.CPU) == STORED
            elif tier == "redis":
                svc.clear(Tier.CPU, Tier.DISK)
            runs[tier], probes[tier] = _probed_run(tiny_model, PROMPTS, MAX_TOKENS, cfg)
        stores = svc.stats()["tiers"]["cpu"]["stores"]
    for tier, run in runs.items():
        assert_same_outputs(expected, run.outputs)
        tokens = 0 if tier == "store" else HIT
        totals = run.connector_totals
        assert totals["external_tokens"] == tokens, tier
        assert {t: totals[f"hit_tokens_{t}"] for t in ("cpu", "disk", "redis")} == {
            t: tokens if t == tier else 0 for t in ("cpu", "disk", "redis")
        }
        assert probes[tier].worker.totals["loaded_tokens"] == tokens, tier
        assert probes[tier].worker.totals["failed_load_blocks"] == 0, tier
        assert probes[tier].failed_blocks == set(), tier
    assert HIT == STORED * CHUNK
    assert probes["store"].worker.totals["saved_chunks"] == STORED
    assert all(probes[t].worker.totals.get("saved_chunks", 0) == 0 for t in ("cpu", "disk", "redis"))
    # The CPU tier stored each chunk once when saved, then took it again from Redis (the worker
    # read the disk hits from their files itself: they are not promoted).
    assert stores == 2 * STORED
    assert probes["disk"].worker.totals["disk_read_chunks"] == STORED


def test_async_scheduling_recomputes_chunks_deleted_between_lookup_and_load(
    tiny_model: str, expected: Outputs, tmp_path: Path
) -> None:
    disk = tmp_path / "disk"
    doomed = [1, 3]
    with running_service(tmp_path / "svc", disk_path=disk) as svc:
        cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK)
        stored = run_engine_core(tiny_model, PROMPTS, MAX_TOKENS, cfg)
        wait_written(svc, "disk", STORED)
        assert svc.clear(Tier.CPU) == STORED
        # Disk hits load asynchronously, the stage a step after the lookup: the first prompt's
        # chunks 1 and 3 are deleted in between, behind the service's back.
        hooks: list[list[str]] = []  # the request whose chunks were deleted, once it is known

        def on_start(core: Any) -> None:
            hooks.append(delete_after_lookup(core.scheduler.connector, disk, 5, doomed))

        run, probe = _probed_run(tiny_model, PROMPTS, MAX_TOKENS, cfg, on_start=on_start)
    assert_same_outputs(expected, stored.outputs)
    assert_same_outputs(expected, run.outputs)
    assert hooks == [["req-0"]]
    lost = probe.blocks_of("req-0", doomed)
    assert len(lost) == 2 * len(doomed), "two chunks of two blocks each were planned for loading"
    assert probe.failed_blocks == lost, "exactly the deleted chunks' blocks are reported failed"
    work = probe.worker.totals
    assert work["failed_load_chunks"] == len(doomed) and work["failed_load_blocks"] == len(lost)
    assert work["loaded_tokens"] == HIT - len(doomed) * CHUNK
    assert run.connector_totals["external_tokens"] == HIT
