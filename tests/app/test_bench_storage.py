"""kvtier bench storage runs end to end on small sizes: disk, Redis and object tiers against plain file
I/O, the raw redis driver and obstore, and the arena's staging, each figure a ratio measured in the
same run."""

from __future__ import annotations

import shutil

import pytest

from kvtier.bench import storage, storage_object
from tests.support.object_fixtures import need_weed


@pytest.mark.redis
def test_the_storage_benchmark_measures_every_tier_on_small_sizes(tmp_path, monkeypatch) -> None:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (make install installs it)")
    need_weed()
    monkeypatch.setenv("KVTIER_SHM_DIR", "/dev/shm")
    monkeypatch.delenv("KVTIER_OBJECT_URL", raising=False)  # the benchmark's own SeaweedFS
    # No --index-files count: the disk index's start (100,000 files) is left out, it takes half a minute.
    result = storage.run(["--sizes", "1", "--repeats", "1", "--disk-path", str(tmp_path), "--index-files"])
    for tier in ("disk", "redis", "object"):
        assert result[tier]["put_ratio"] > 0 and result[tier]["get_ratio"] > 0, result[tier]
    assert result["sizes_mib"] == [1]
    assert "disk_index" not in result
    objects = result["object"]
    assert objects["source"] == "private SeaweedFS"
    assert [row["size_mib"] for row in objects["sizes"]] == [1]
    row = objects["sizes"][0]
    assert row["objects"] == storage_object.objects_per_round(1 << 20)
    for phase in storage_object.PHASES:
        assert row[f"{phase}_gbps"] > 0, (phase, row)
    assert {"put_ratio_parallel", "get_ratio_parallel"} <= set(objects)


def test_the_storage_benchmark_can_leave_the_object_tier_out(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVTIER_SHM_DIR", "/dev/shm")
    result = storage.run(
        ["--sizes", "1", "--repeats", "1", "--disk-path", str(tmp_path), "--index-files", "--no-object",
         "--no-redis"]
    )  # fmt: skip
    assert result["object"] == {"skipped": "disabled by --no-object"}
    assert "skipped" in result["redis"] and result["disk"]["put_ratio"] > 0
