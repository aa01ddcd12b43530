"""Hits from every tier, and engines sharing one service and one Redis: outputs never change."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.bench.harness import Outputs, generate_each, kv_transfer_config, make_prompt, running_engine
from kvtier.bench.introspect import worker_totals
from kvtier.storage.base import Tier
from tests.app import wait_until
from tests.e2e.engine_script import run_engine_process
from tests.e2e.oracle import assert_same_outputs, expected_external, forget_local_cache, wait_written
from tests.e2e.service import running_service

pytestmark = pytest.mark.e2e
CHUNK = 64
PROMPTS = [make_prompt(200, 330), make_prompt(201, 270)]
STORED = sum(len(p) // CHUNK for p in PROMPTS)  # 5 + 4 full chunks
# Each prompt's stored chunks, all but the last token's block: 320 + 256 tokens.
HIT = sum(expected_external(len(p) // CHUNK, 0, len(p), CHUNK) for p in PROMPTS)


@pytest.fixture(scope="module")
def expected(tiny_model: str) -> Outputs:
    with running_engine(tiny_model) as llm:
        return generate_each(llm, PROMPTS, 10)


def test_hits_from_cpu_then_disk_then_redis(
    tiny_model: str, expected: Outputs, redis_server, tmp_path: Path
) -> None:
    settings = dict(disk_path=tmp_path / "disk", redis_url=redis_server.url)
    with running_service(tmp_path / "svc1", **settings) as svc:
        cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK)
        with running_engine(tiny_model, cfg) as llm:
            assert_same_outputs(expected, generate_each(llm, PROMPTS, 10))  # stores
            wait_written(svc, "disk", STORED)
            wait_written(svc, "redis", STORED)
            # Each round starts with vLLM's own cache emptied, else it would serve the repeats.
            forget_local_cache(llm)
            assert_same_outputs(expected, generate_each(llm, PROMPTS, 10))  # CPU hits
            cpu_hits = svc.hit_tokens()
            assert svc.clear(Tier.CPU) == STORED
            forget_local_cache(llm)
            read_before = worker_totals().get("disk_read_chunks", 0)
            assert_same_outputs(expected, generate_each(llm, PROMPTS, 10))  # disk hits
            disk_hits = svc.hit_tokens()
            # The worker read them from their files itself (the service's file channel), and told
            # the service, which counts them as its disk tier's hits.
            assert worker_totals()["disk_read_chunks"] - read_before == STORED
            assert wait_until(lambda: svc.stats()["tiers"]["disk"]["hits"] == STORED, 10)
    assert HIT == STORED * CHUNK
    assert cpu_hits == {"cpu": HIT, "disk": 0, "redis": 0, "object": 0}
    assert disk_hits == {"cpu": HIT, "disk": HIT, "redis": 0, "object": 0}
    # A fresh service with no disk tier and an empty CPU tier: only Redis has the chunks.
    with running_service(tmp_path / "svc2", redis_url=redis_server.url) as svc:
        cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK)
        with running_engine(tiny_model, cfg) as llm:
            assert_same_outputs(expected, generate_each(llm, PROMPTS, 10))
        redis_hits = svc.hit_tokens()
    assert redis_hits == {"cpu": 0, "disk": 0, "redis": HIT, "object": 0}


def test_two_engines_share_one_service(tiny_model: str, expected: Outputs, tmp_path: Path) -> None:
    """Engine A (vLLM's default multi-process layout, its own process) stores; engine B hits it."""
    with running_service(tmp_path / "svc") as svc:
        cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK)
        job = {
            "model": tiny_model,
            "prompts": PROMPTS,
            "max_tokens": 10,
            "kv_config": cfg,
            "engine": {},
            "multiprocess": True,
        }
        first = Outputs(run_engine_process(job)["tokens"])
        stores = svc.stats()["tiers"]["cpu"]["stores"]
        with running_engine(tiny_model, cfg) as llm:
            second = generate_each(llm, PROMPTS, 10)
        hits = svc.hit_tokens()
    assert_same_outputs(expected, first)
    assert_same_outputs(expected, second)
    assert stores == STORED, "engine A stored its chunks through the multi-process layout"
    assert hits == {"cpu": HIT, "disk": 0, "redis": 0, "object": 0}, "engine B loaded what engine A stored"
