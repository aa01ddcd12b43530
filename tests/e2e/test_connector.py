"""kvtier on a real vLLM engine: every greedy output equals the same engine's without a connector."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest

from kvtier.bench.harness import (
    generate,
    generate_each,
    kv_transfer_config,
    make_prompt,
    metric,
    preemptions,
    running_engine,
)
from kvtier.bench.introspect import scheduler_connector, scheduler_totals, worker_totals
from kvtier.storage.base import Tier
from tests.e2e.oracle import (
    PREEMPTION_ENGINE,
    PREEMPTION_MAX_TOKENS,
    PREEMPTION_PROMPT_LEN,
    assert_same_outputs,
)
from tests.e2e.service import running_service

pytestmark = pytest.mark.e2e

# Local prefix caching off: every reuse must come through kvtier, so these tests see its loads.
NO_LOCAL_CACHE = dict(enable_prefix_caching=False)
CHUNK = 64

SHARED = make_prompt(100, 300)
FOLLOW_UPS = [SHARED + make_prompt(101, 40), SHARED + make_prompt(102, 25)]


@pytest.fixture(scope="module")
def baseline(tiny_model: str) -> dict[str, object]:
    """Greedy outputs of the same engine without any connector."""
    with running_engine(tiny_model, **NO_LOCAL_CACHE) as llm:
        return {"follow_ups": generate_each(llm, FOLLOW_UPS, 12)}


def test_prefix_reuse_loads_chunks_and_keeps_outputs(tiny_model: str, baseline, tmp_path: Path) -> None:
    with running_service(tmp_path / "svc") as svc:
        cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK)
        with running_engine(tiny_model, cfg, **NO_LOCAL_CACHE) as llm:
            got = generate_each(llm, FOLLOW_UPS, 12)
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
    assert hits["cpu"] >= 4 * CHUNK
    assert sched["external_tokens"] >= 4 * CHUNK
    assert work["loaded_tokens"] >= 4 * CHUNK
    assert work["failed_load_blocks"] == 0
    assert work["unwaited_layer_loads"] == 0, "vLLM waited for every layer's loads before its attention"
    assert work["full_graph_loads"] == 0, "an eager forward on the CPU: loads overlap it layer by layer"
    assert prom_loaded == work["loaded_tokens"]
    assert prom_tiers["cpu"] >= 4 * CHUNK and prom_tiers["disk"] == 0
    # kvtier served this engine: its scheduler and worker said so to vLLM's metrics and the service.
    assert prom_active == 1
    assert sorted((e["role"], e["active"]) for e in engines) == [("scheduler", True), ("worker", True)]
    assert len({e["engine_id"] for e in engines}) == 1


def test_corrupted_staged_bytes_change_the_output(tiny_model: str, baseline, tmp_path: Path) -> None:
    """Negative control: loads are really used, so garbage in the arena must show in the output."""
    with running_service(tmp_path / "svc") as svc:
        cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK)
        with running_engine(tiny_model, cfg, **NO_LOCAL_CACHE) as llm:
            first = generate(llm, FOLLOW_UPS[:1], 12)
            (arena,) = svc.arena_files()
            with open(arena, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
                m[:] = bytes([0x5A]) * len(m)  # every stored chunk becomes garbage
            second = generate(llm, FOLLOW_UPS[1:], 12)
        assert svc.hit_tokens()["cpu"] >= 4 * CHUNK
    assert_same_outputs(baseline["follow_ups"].__class__(baseline["follow_ups"].tokens[:1]), first)
    assert second.tokens[0] != baseline["follow_ups"].tokens[1], "corrupt KV must change the output"


def test_preempted_request_reloads_its_chunks(tiny_model: str, tmp_path: Path) -> None:
    prompts = [make_prompt(11, PREEMPTION_PROMPT_LEN), make_prompt(12, PREEMPTION_PROMPT_LEN)]
    with running_engine(tiny_model, **PREEMPTION_ENGINE, **NO_LOCAL_CACHE) as llm:
        expected = generate_each(llm, prompts, PREEMPTION_MAX_TOKENS)
    with running_service(tmp_path / "svc") as svc:
        cfg = kv_transfer_config(service_url=svc.url, chunk_size=32)
        with running_engine(tiny_model, cfg, **PREEMPTION_ENGINE, **NO_LOCAL_CACHE) as llm:
            got = generate(llm, prompts, PREEMPTION_MAX_TOKENS)
            assert preemptions(llm) >= 1
            sched = scheduler_totals(llm)
            work = worker_totals()
    assert_same_outputs(expected, got)
    assert sched["readmissions"] >= 1, "the resumed request is counted as a re-admission"
    assert sched["external_tokens"] >= 32, "the resumed request reloads what it saved"
    # Every external token the scheduler promised was loaded, none failed, every lookup answered.
    assert work["loaded_tokens"] == sched["external_tokens"]
    assert work["failed_load_blocks"] == 0 and sched["lookup_errors"] == 0


@pytest.mark.parametrize("save_decode", [True, False])
def test_decode_saving(tiny_model: str, tmp_path: Path, save_decode: bool) -> None:
    prompt = make_prompt(31, 100)
    with running_engine(tiny_model, **NO_LOCAL_CACHE) as llm:
        answer = generate(llm, [prompt], 100).tokens[0]
        follow = prompt + answer + make_prompt(32, 10)
        expected = generate(llm, [follow], 8)
    with running_service(tmp_path / "svc") as svc:
        cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK, save_decode=save_decode)
        with running_engine(tiny_model, cfg, **NO_LOCAL_CACHE) as llm:
            assert generate(llm, [prompt], 100).tokens[0] == answer
            got = generate(llm, [follow], 8)
            sched = scheduler_totals(llm)
    assert_same_outputs(expected, got)
    # 100 prompt tokens hold one full 64-token chunk; the 200 tokens of prompt + answer hold three.
    if save_decode:
        assert sched["external_tokens"] >= 3 * CHUNK
    else:
        assert sched["external_tokens"] == CHUNK


def test_deleted_chunks_between_lookup_and_load_are_recomputed(
    tiny_model: str, baseline, tmp_path: Path
) -> None:
    disk = tmp_path / "disk"
    with running_service(tmp_path / "svc", disk_path=disk) as svc:
        cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK)
        with running_engine(tiny_model, cfg, **NO_LOCAL_CACHE) as llm:
            first = generate(llm, FOLLOW_UPS[:1], 12)
            svc.client.close()  # keep the control connection out of the way of the drain
            import time

            deadline = time.monotonic() + 10
            while len(list(disk.rglob("*.kvt"))) < 4 and time.monotonic() < deadline:
                time.sleep(0.05)
            svc.__post_init__()
            svc.clear(Tier.CPU)
            # Lower-tier hits load asynchronously: the stage happens a step after the lookup.
            # Remove two chunk files behind the service's back in between, by hooking the lookup.
            sched = scheduler_connector(llm)._sched
            original = sched._start_lookup

            def lookup_then_delete(st, hashes, **kwargs):
                lookup = original(st, hashes, **kwargs)
                lookup.future.result(10)
                for path in sorted(disk.rglob("*.kvt"))[:2]:
                    path.unlink()
                return lookup

            sched._start_lookup = lookup_then_delete
            second = generate(llm, FOLLOW_UPS[1:], 12)
            work = worker_totals()
    assert_same_outputs(baseline["follow_ups"], first.__class__(first.tokens + second.tokens))
    assert work["failed_load_blocks"] > 0, "deleted chunks are reported as failed blocks"
