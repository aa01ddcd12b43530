"""`kvtier bench scale --quick` runs end to end through the CLI: every tier at each small size and
the service at each connection count, with the report's shape and counts as documented."""

from __future__ import annotations

import json
import shutil

import pytest

from kvtier.app import cli
from kvtier.bench import scale_service, scale_tiers
from tests.support.skips import missing

IN_MEMORY = ("dict_floor", "cpu", "disk", "object_index")
COSTS = ("lookup_us", "lookup_spread_us", "commit_us", "commit_evict_us", "evict_us")


@pytest.mark.redis
def test_quick_scale_benchmark_reports_every_tier_size_and_connection_count(tmp_path, monkeypatch) -> None:
    if shutil.which("redis-server") is None:
        missing("redis-server")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "scale", "--quick", "--out", "scale.json"]) == 0
    fig = json.loads((tmp_path / "scale.json").read_text())
    assert fig["quick"] is True

    tiers = fig["tiers"]
    sizes = [str(n) for n in scale_tiers.QUICK_SIZES]
    assert tiers["sizes"] == list(scale_tiers.QUICK_SIZES) and tiers["repeats"] == 1
    assert sorted(tiers["tiers"]) == sorted(scale_tiers.TIERS)
    for name, tier in tiers["tiers"].items():
        assert list(tier["by_chunks"]) == sizes, name
        assert sorted(tier["largest_over_smallest"]) == sorted(COSTS[:4]), name
        for n, f in tier["by_chunks"].items():
            assert f["chunks"] == int(n)
            for cost in COSTS:
                assert len(f[cost]["runs"]) == 1 and f[cost]["median"] == f[cost]["runs"][0], (name, cost)
            for cost in COSTS[:4]:
                assert f[cost]["median"] > 0, (name, n, cost)
            if name in IN_MEMORY:
                assert f["index_bytes"] > 0, (name, n)
    redis = tiers["tiers"]["redis"]["by_chunks"]
    for f in redis.values():
        assert f["server_bytes_per_key"] > f["server_index_bytes"] > 0
        assert f["redis_evicted_keys"] > 0  # its commit_evict phase ran against maxmemory
    assert tiers["tiers"]["cpu"]["by_chunks"][sizes[-1]]["capacity_bytes"] == (
        (scale_tiers.QUICK_SIZES[-1] + scale_tiers.BATCH) * scale_tiers.CPU_SLOT
    )

    service = fig["service"]
    counts = [str(c) for c in scale_service.QUICK_CONNECTIONS]
    assert service["connections"] == list(scale_service.QUICK_CONNECTIONS)
    for load in ("saturated", "paced"):
        assert list(service[load]) == counts
        for count, f in service[load].items():
            assert f["connections"] == int(count)
            requests = f["requests"]["median"]
            assert requests > 0 and f["ops"]["median"] == requests * scale_service.OPS_PER_REQUEST
            assert 0 < f["lookup_p50_us"]["median"] <= f["lookup_p99_us"]["median"]
    assert list(service["paced_lookup_p99_over_one_connection"]) == counts
    assert service["paced_lookup_p99_over_one_connection"]["1"] == 1.0
