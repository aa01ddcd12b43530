"""Hits from every tier, and engines sharing one service and one Redis: outputs never change."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvtier.bench.harness import Outputs, generate_each, kv_transfer_config, make_prompt, running_engine
from kvtier.storage.base import Tier
from tests.e2e.engine_script import run_engine_process
from tests.e2e.oracle import assert_same_outputs
from tests.e2e.service import RunningService, running_service

pytestmark = pytest.mark.e2e
NO_LOCAL_CACHE = dict(enable_prefix_caching=False)
CHUNK = 64
PROMPTS = [make_prompt(200, 330), make_prompt(201, 270)]


@pytest.fixture(scope="module")
def expected(tiny_model: str) -> Outputs:
    with running_engine(tiny_model, **NO_LOCAL_CACHE) as llm:
        return generate_each(llm, PROMPTS, 10)


def _wait_written(svc: RunningService, tier: str, chunks: int) -> None:
    """Wait (bounded) until the write-behind queue has put `chunks` chunks into `tier`."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = svc.stats()
        if stats["write_queue_depth"] == 0 and stats["tiers"][tier]["stores"] >= chunks:
            return
        time.sleep(0.05)
    raise AssertionError(f"{tier} tier never stored {chunks} chunks: {svc.stats()}")


def test_hits_from_cpu_then_disk_then_redis(
    tiny_model: str, expected: Outputs, redis_server, tmp_path: Path
) -> None:
    stored = sum(len(p) // CHUNK for p in PROMPTS)  # 5 + 4 full chunks
    settings = dict(disk_path=tmp_path / "disk", redis_url=redis_server.url)
    with running_service(tmp_path / "svc1", **settings) as svc:
        cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK)
        with running_engine(tiny_model, cfg, **NO_LOCAL_CACHE) as llm:
            assert_same_outputs(expected, generate_each(llm, PROMPTS, 10))  # stores
            _wait_written(svc, "disk", stored)
            _wait_written(svc, "redis", stored)
            assert_same_outputs(expected, generate_each(llm, PROMPTS, 10))  # CPU hits
            cpu_hits = svc.hit_tokens()
            assert svc.clear(Tier.CPU) >= stored
            assert_same_outputs(expected, generate_each(llm, PROMPTS, 10))  # disk hits
            disk_hits = svc.hit_tokens()
    assert cpu_hits["cpu"] >= stored * CHUNK - 2 * 32  # all but the last block of a full-hit prompt
    assert disk_hits["disk"] >= stored * CHUNK - 2 * 32
    # A fresh service with no disk tier and an empty CPU tier: only Redis has the chunks.
    with running_service(tmp_path / "svc2", redis_url=redis_server.url) as svc:
        cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK)
        with running_engine(tiny_model, cfg, **NO_LOCAL_CACHE) as llm:
            assert_same_outputs(expected, generate_each(llm, PROMPTS, 10))
        redis_hits = svc.hit_tokens()
    assert redis_hits["redis"] >= stored * CHUNK - 2 * 32
    assert redis_hits["cpu"] == 0 and redis_hits["disk"] == 0


def test_two_engines_share_one_service(tiny_model: str, expected: Outputs, tmp_path: Path) -> None:
    """Engine A (vLLM's default multi-process layout, its own process) stores; engine B hits it."""
    with running_service(tmp_path / "svc") as svc:
        cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK)
        job = {
            "model": tiny_model,
            "prompts": PROMPTS,
            "max_tokens": 10,
            "kv_config": cfg,
            "engine": NO_LOCAL_CACHE,
            "multiprocess": True,
        }
        first = Outputs(run_engine_process(job)["tokens"])
        stores = svc.stats()["tiers"]["cpu"]["stores"]
        with running_engine(tiny_model, cfg, **NO_LOCAL_CACHE) as llm:
            second = generate_each(llm, PROMPTS, 10)
        hits = svc.hit_tokens()
    assert_same_outputs(expected, first)
    assert_same_outputs(expected, second)
    assert stores >= 9, "engine A stored its chunks through the multi-process layout"
    assert hits["cpu"] >= 9 * CHUNK - 2 * 32, "engine B loaded what engine A stored"
