"""Disk hits the worker reads from the chunk files itself (the service's file channel): outputs
never change, damaged files fail exactly their blocks, and a channel that is gone falls back to the
service's reads."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvtier.app.file_channel import channel_path
from kvtier.bench.harness import Outputs, generate, kv_transfer_config, running_engine
from kvtier.bench.introspect import scheduler_connector, worker_connector, worker_totals
from kvtier.storage.base import Tier
from tests.app import wait_until
from tests.e2e.oracle import (
    Probe,
    assert_same_outputs,
    damage_after_lookup,
    forget_local_cache,
    generate_each_cold,
    wait_written,
)
from tests.e2e.service import RunningService, running_service
from tests.e2e.test_connector import CHUNK, FOLLOW_UPS, REUSED

pytestmark = pytest.mark.e2e
STORED = 5  # the first follow-up's 340 prompt tokens + 11 decoded with KV: 5 chunks


@pytest.fixture(scope="module")
def expected(tiny_model: str) -> Outputs:
    with running_engine(tiny_model) as llm:
        return generate_each_cold(llm, FOLLOW_UPS, 12)


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _flip(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))


def _disk_only(svc: RunningService, llm: Any) -> None:
    """Store the shared prefix, then leave it only on disk (neither kvtier's CPU tier nor vLLM)."""
    generate(llm, FOLLOW_UPS[:1], 12)
    wait_written(svc, "disk", STORED)
    svc.clear(Tier.CPU)
    forget_local_cache(llm)


def _second_follow_up(llm: Any) -> tuple[Outputs, dict[str, int]]:
    """The second follow-up's output, and the worker's counts while it ran."""
    before = worker_totals()
    second = generate(llm, FOLLOW_UPS[1:], 12)
    after = worker_totals()
    names = ("disk_read_chunks", "disk_read_fallbacks", "loaded_tokens", "failed_load_chunks")
    return second, {n: after.get(n, 0) - before.get(n, 0) for n in names}


def test_damaged_files_fail_exactly_their_blocks(tiny_model: str, expected: Outputs, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    with running_service(tmp_path / "svc", disk_path=disk) as svc:
        cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK)
        with running_engine(tiny_model, cfg) as llm:
            _disk_only(svc, llm)
            probe = Probe(scheduler_connector(llm), worker_connector())
            hit = damage_after_lookup(scheduler_connector(llm), disk, STORED, {1: _truncate, 3: _flip})
            second, work = _second_follow_up(llm)
            # The worker told the service: both files counted corrupt (and removed).
            assert wait_until(lambda: svc.stats()["tiers"]["disk"]["errors_by_kind"] == {"corrupt": 2}, 10)
    assert_same_outputs(Outputs(expected.tokens[1:]), second)
    (req_id,) = hit
    doomed = probe.blocks_of(req_id, [1, 3])
    assert len(doomed) == 4 and probe.failed_blocks == doomed
    assert work["failed_load_chunks"] == 2
    # The other chunks of the hit were read from their files by the worker, none staged instead.
    assert (work["disk_read_chunks"], work["disk_read_fallbacks"]) == (REUSED // CHUNK - 2, 0)


def test_a_missing_file_channel_falls_back_to_the_service(
    tiny_model: str, expected: Outputs, tmp_path: Path
) -> None:
    with running_service(tmp_path / "svc", disk_path=tmp_path / "disk") as svc:
        cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK)
        with running_engine(tiny_model, cfg) as llm:
            _disk_only(svc, llm)
            # The channel's socket is gone (e.g. removed by hand): the worker cannot connect.
            os.unlink(channel_path(svc.url.removeprefix("unix://")))
            second, work = _second_follow_up(llm)
        hits = svc.hit_tokens()
    assert_same_outputs(Outputs(expected.tokens[1:]), second)
    assert hits["disk"] == REUSED
    assert (work["disk_read_fallbacks"], work["disk_read_chunks"], work["loaded_tokens"]) == (1, 0, REUSED)


def test_direct_reads_off_leaves_disk_reads_to_the_service(
    tiny_model: str, expected: Outputs, tmp_path: Path
) -> None:
    settings = dict(disk_path=tmp_path / "disk", disk_direct_reads=False)
    with running_service(tmp_path / "svc", **settings) as svc:
        assert not Path(channel_path(svc.url.removeprefix("unix://"))).exists()
        cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK, disk_direct_reads=False)
        with running_engine(tiny_model, cfg) as llm:
            _disk_only(svc, llm)
            second, work = _second_follow_up(llm)
        hits = svc.hit_tokens()
    assert_same_outputs(Outputs(expected.tokens[1:]), second)
    assert hits["disk"] == REUSED
    assert (work["disk_read_fallbacks"], work["disk_read_chunks"], work["loaded_tokens"]) == (0, 0, REUSED)
