"""The benchmarks' object-tier parts: the object floor GETs the objects of a prompt's disk chunk
files (same keys); (e2e) `kvtier bench connector --hits-only --quick` measures every tier's hit
against its floor, the object tier's included (its GET process fetching what the tier wrote), and
`kvtier bench signing --ttft --quick` runs its two engines end to end, every hit checked to come
from its tier."""

from __future__ import annotations

import json

import pytest

from kvtier.bench import connector, signing, signing_ttft
from kvtier.bench.floors import HIT_FLOOR_TARGETS
from kvtier.bench.hit_object import object_paths
from kvtier.bench.ports import distinct_free_ports, free_port
from kvtier.storage.base import ChunkKey
from kvtier.storage.keys import disk_relpath
from kvtier.storage.tiers.object_index import object_path
from tests.support.object_fixtures import need_weed

NS = "0123456789abcdef"


def test_a_prompts_object_paths_are_its_disk_chunk_files_keys() -> None:
    keys = [ChunkKey(NS, bytes([7, i])) for i in range(3)]
    files = [f"/var/kvtier/disk/{disk_relpath(k)}" for k in keys]
    assert object_paths(files) == [object_path(k) for k in keys]


def test_ports_handed_out_are_never_handed_out_again() -> None:
    # Ports chosen one after another by binding port 0 and letting go can come back equal, and a
    # server given one port twice (weed takes eight) fails to bind.
    ports = distinct_free_ports(64) + [free_port() for _ in range(64)]
    assert len(set(ports)) == 128
    assert all(1024 <= port < 65536 for port in ports)


@pytest.mark.e2e
@pytest.mark.redis
def test_signing_ttft_quick_runs_both_engines_and_every_hit_comes_from_its_tier(capsys) -> None:
    need_weed()
    assert signing.main(["--ttft", "--quick"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["rounds"], result["prompts"], result["object_tier"]) == (1, 1, True)
    assert set(result["ttft_ratio"]) == {"redis", "object"}
    for tier in ("redis", "object"):
        fig = result[tier]
        assert fig["samples"] == 1
        for variant in signing_ttft.VARIANTS:
            assert fig[f"{variant}_hit_ms"] > 0 and fig[f"{variant}_ceiling_ms"] > 0, fig
        assert fig["ttft_ratio"] > 0 and fig["ttft_ratio_paired"] > 0 and fig["ceiling_ratio"] > 0


@pytest.mark.e2e
@pytest.mark.redis
def test_connector_hits_only_quick_measures_every_tier_against_its_floor_object_included() -> None:
    need_weed()
    result = connector.run(["--hits-only", "--quick", "--json"])
    assert "copy" not in result and "scheduler" not in result and "ttft_miss_ratio" not in result
    tiers = ["cpu", "disk", "disk_cold", "redis", "object"]
    assert list(result["hit_floor_ratio"]) == tiers
    for tier in tiers:
        fig = result["hit_floors"][tier]
        assert fig["hit_ms"] > 0 and fig["ceiling_ms"] > 0 and fig["move_ms"] > 0, (tier, fig)
        assert fig["target"] == HIT_FLOOR_TARGETS[tier]
    # One prompt of 6 chunks stored; every hit checked to come from its tier (bench.tier raises otherwise).
    assert result["ttft"]["hit_tokens"]["object"] == 6 * 256
