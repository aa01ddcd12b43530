"""kvtier bench storage runs end to end on small sizes: disk and Redis tiers against plain file I/O and
the raw redis driver, and the arena's staging, each figure a ratio measured in the same run."""

from __future__ import annotations

import shutil

import pytest

from kvtier.bench import storage


@pytest.mark.redis
def test_the_storage_benchmark_measures_every_tier_on_small_sizes(tmp_path, monkeypatch) -> None:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (make install installs it)")
    monkeypatch.setenv("KVTIER_SHM_DIR", "/dev/shm")
    result = storage.run(["--sizes", "1", "--repeats", "1", "--disk-path", str(tmp_path)])
    for tier in ("disk", "redis"):
        assert result[tier]["put_ratio"] > 0 and result[tier]["get_ratio"] > 0, result[tier]
    assert result["sizes_mib"] == [1]
