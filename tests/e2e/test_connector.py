"""kvtier on a real vLLM engine: every greedy output equals the same engine's without a connector."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest

from kvtier.bench.harness import (
    Outputs,
    generate,
    generate_each,
    kv_transfer_config,
    make_prompt,
    metric,
    preemptions,
    running_engine,
)
from kvtier.bench.introspect import scheduler_connector, scheduler_totals, worker_connector, worker_totals
from kvtier.storage.base import Tier
from tests.e2e.oracle import (
    PREEMPTION_ENGINE,
    PREEMPTION_MAX_TOKENS,
    PREEMPTION_PROMPT_LEN,
    Probe,
    assert_same_outputs,
    delete_after_lookup,
    expected_external,
    forget_local_cache,
    generate_each_cold,
    wait_written,
)
from tests.e2e.service import running_service

pytestmark = pytest.mark.e2e

# vLLM's defaults, its own prefix cache on. A prompt that repeats an earlier one is served by that
# cache, so the tests empty it first (forget_local_cache, as memory pressure or a restart would):
# kvtier then serves the reuse.
CHUNK = 64

SHARED = make_prompt(100, 300)
FOLLOW_UPS = [SHARED + make_prompt(101, 40), SHARED + make_prompt(102, 25)]
# The second follow-up shares SHARED's 4 full chunks with the first, which stored them.
REUSED = expected_external(4, 0, len(FOLLOW_UPS[1]), CHUNK)


@pytest.fixture(scope="module")
def baseline(tiny_model: str) -> dict[str, Outputs]:
    """Greedy outputs of the same engine without any connector."""
    with running_engine(tiny_model) as llm:
        return {"follow_ups": generate_each_cold(llm, FOLLOW_UPS, 12)}


def test_prefix_reuse_loads_chunks_and_keeps_outputs(tiny_model: str, baseline, tmp_path: Path) -> None:
    with running_service(tmp_path / "svc") as svc:
        cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK)
        with running_engine(tiny_model, cfg) as llm:
            got = generate_each_cold(llm, FOLLOW_UPS, 12)
            sched = scheduler_totals(llm)
            work = worker_totals()
            # vLLM's own metrics carry kvtier's counters.
            prom_loaded = metric(llm, "vllm:kvtier_loaded_tokens")
            prom_tiers = {
                m.labels.get("tier"): m.value for m in llm.get_metrics() if m.name == "vllm:kvtier_hit_tokens"
            }
            prom_active = metric(llm, "vllm:kvtier_active")
            engines = svc.stats()["engines"]  # the connectors' reports, while they are connected
        hits = svc.hit_tokens()
    assert_same_outputs(baseline["follow_ups"], got)
    # The second prompt shares 300 tokens: 4 full chunks of 64 were stored by the first and loaded.
    assert REUSED == 4 * CHUNK
    assert hits == {"cpu": REUSED, "disk": 0, "redis": 0, "object": 0}
    assert sched["external_tokens"] == REUSED and sched["hit_tokens_cpu"] == REUSED
    assert work["loaded_tokens"] == REUSED
    assert work["failed_load_blocks"] == 0
    assert work["unwaited_layer_loads"] == 0, "vLLM waited for every layer's loads before its attention"
    assert work["full_graph_loads"] == 0, "an eager forward on the CPU: loads overlap it layer by layer"
    assert prom_loaded == REUSED
    assert prom_tiers["cpu"] == REUSED and prom_tiers["disk"] == 0
    # kvtier served this engine: its scheduler and worker said so to vLLM's metrics and the service.
    assert prom_active == 1
    assert sorted((e["role"], e["active"]) for e in engines) == [("scheduler", True), ("worker", True)]
    assert len({e["engine_id"] for e in engines}) == 1


def test_corrupted_staged_bytes_change_the_output(tiny_model: str, baseline, tmp_path: Path) -> None:
    """Negative control: loads are really used, so garbage in the arena must show in the output."""
    with running_service(tmp_path / "svc") as svc:
        cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK)
        with running_engine(tiny_model, cfg) as llm:
            first = generate(llm, FOLLOW_UPS[:1], 12)
            (arena,) = svc.arena_files()
            with open(arena, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
                m[:] = bytes([0x5A]) * len(m)  # every stored chunk becomes garbage
            forget_local_cache(llm)  # else vLLM's own cache serves the shared prefix
            second = generate(llm, FOLLOW_UPS[1:], 12)
        assert svc.hit_tokens()["cpu"] == REUSED
    assert_same_outputs(Outputs(baseline["follow_ups"].tokens[:1]), first)
    assert second.tokens[0] != baseline["follow_ups"].tokens[1], "corrupt KV must change the output"


def test_preempted_request_reloads_its_chunks(tiny_model: str, tmp_path: Path) -> None:
    """With vLLM's prefix cache on, a preempted request's blocks stay cached until the other request
    needs them: on resuming, vLLM's hit covers those left and kvtier reloads the rest."""
    block = 32
    prompts = [make_prompt(11, PREEMPTION_PROMPT_LEN), make_prompt(12, PREEMPTION_PROMPT_LEN)]
    with running_engine(tiny_model, **PREEMPTION_ENGINE) as llm:
        expected = generate_each(llm, prompts, PREEMPTION_MAX_TOKENS)
    with running_service(tmp_path / "svc") as svc:
        cfg = kv_transfer_config(service_url=svc.url, chunk_size=block)
        with running_engine(tiny_model, cfg, **PREEMPTION_ENGINE) as llm:
            probe = Probe(scheduler_connector(llm), worker_connector())
            got = generate(llm, prompts, PREEMPTION_MAX_TOKENS)
            preempted = preemptions(llm)
            sched = scheduler_totals(llm)
            work = worker_totals()
    assert_same_outputs(expected, got)
    admissions = probe.admissions()
    resumed = [a for a in admissions if a.preemptions > 0]
    assert preempted >= 1 and len(resumed) == preempted
    assert sched["readmissions"] == preempted, "each resumed request is counted as a re-admission"
    assert [a.external for a in admissions if a.preemptions == 0] == [0, 0], "nothing stored yet"
    for a in resumed:
        # Every chunk it computed was saved, and what vLLM's hit lacks up to the last whole block
        # before its last token comes from kvtier.
        assert a.hit_chunks == (a.num_tokens - 1) // block
        assert a.external == a.expected(block) == (a.num_tokens - 1) // block * block - a.local
        assert a.external > 0, "vLLM dropped some of the preempted request's blocks"
    # Every external token the scheduler promised was loaded, none failed, every lookup answered.
    reloaded = sum(a.external for a in resumed)
    assert sched["external_tokens"] == reloaded == work["loaded_tokens"]
    assert work["failed_load_blocks"] == 0 and sched["lookup_errors"] == 0


@pytest.mark.parametrize("save_decode", [True, False])
def test_decode_saving(tiny_model: str, tmp_path: Path, save_decode: bool) -> None:
    prompt = make_prompt(31, 100)
    with running_engine(tiny_model) as llm:
        answer = generate(llm, [prompt], 100).tokens[0]
        follow = prompt + answer + make_prompt(32, 10)
        expected = generate_each_cold(llm, [follow], 8)
    with running_service(tmp_path / "svc") as svc:
        cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK, save_decode=save_decode)
        with running_engine(tiny_model, cfg) as llm:
            assert generate(llm, [prompt], 100).tokens[0] == answer
            got = generate_each_cold(llm, [follow], 8)  # else vLLM's cache serves the prompt and answer
            sched = scheduler_totals(llm)
    assert_same_outputs(expected, got)
    # 100 prompt tokens hold one full 64-token chunk; the 199 tokens of prompt + answer with KV hold three.
    stored = 3 if save_decode else 1
    assert sched["external_tokens"] == expected_external(stored, 0, len(follow), CHUNK) == stored * CHUNK


def test_deleted_chunks_between_lookup_and_load_are_recomputed(
    tiny_model: str, baseline, tmp_path: Path
) -> None:
    disk = tmp_path / "disk"
    with running_service(tmp_path / "svc", disk_path=disk) as svc:
        cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK)
        with running_engine(tiny_model, cfg) as llm:
            first = generate(llm, FOLLOW_UPS[:1], 12)
            wait_written(svc, "disk", 5)  # 340 prompt tokens + 11 decoded with KV: 5 chunks
            svc.clear(Tier.CPU)
            forget_local_cache(llm)
            probe = Probe(scheduler_connector(llm), worker_connector())
            # Lower-tier hits load asynchronously: the stage happens a step after the lookup. Remove
            # the files of chunks 1 and 3 behind the service's back in between.
            hit = delete_after_lookup(scheduler_connector(llm), disk, 5, [1, 3])
            second = generate(llm, FOLLOW_UPS[1:], 12)
            work = worker_totals()
    assert_same_outputs(baseline["follow_ups"], Outputs(first.tokens + second.tokens))
    (req_id,) = hit
    doomed = probe.blocks_of(req_id, [1, 3])
    assert len(doomed) == 4, "two chunks of two blocks each were planned for loading"
    assert probe.failed_blocks == doomed, "exactly the deleted chunks' blocks are reported failed"
    assert work["failed_load_chunks"] == 2 and work["failed_load_blocks"] == 4
    assert work["loaded_tokens"] == REUSED - 2 * CHUNK
