"""Service metrics: latency histograms as plain counts, kvtier_build_info, the process metrics."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.app.metrics import (
    CHECKOUT_SUFFIX,
    LATENCY_BUCKETS,
    UNKNOWN_VERSION,
    ServiceMetrics,
    build_registry,
    kvtier_version,
    stats_dict,
)
from kvtier.app.protocol import PROTOCOL_VERSION
from kvtier.bench.ports import free_port
from kvtier.storage.base import StoreStats, TierStats
from tests.app import thread_service
from tests.support.leak_check import kvtier_leak_session, leak_check, no_kvtier_leaks  # noqa: F401


def test_latency_is_exposed_as_a_cumulative_histogram() -> None:
    metrics = ServiceMetrics()
    for seconds in (10e-6, LATENCY_BUCKETS[0], 300e-6, 9.0):  # a bound counts in its own bucket
        metrics.observe("lookup", seconds)
    stats = StoreStats({"cpu": TierStats()}, 0, 0, 0, 0, 0, 0)
    body = generate_latest(build_registry(lambda: stats, metrics)).decode()
    families = {f.name: f for f in text_string_to_metric_families(body)}
    samples = {(s.name, s.labels.get("le")): s.value for s in families["kvtier_lookup_seconds"].samples}
    assert samples[("kvtier_lookup_seconds_bucket", "5e-05")] == 2
    assert samples[("kvtier_lookup_seconds_bucket", "0.0005")] == 3
    assert samples[("kvtier_lookup_seconds_bucket", "5.0")] == 3
    assert samples[("kvtier_lookup_seconds_bucket", "+Inf")] == 4
    assert samples[("kvtier_lookup_seconds_count", None)] == 4
    assert abs(samples[("kvtier_lookup_seconds_sum", None)] - 9.00036) < 1e-9
    assert "kvtier_commit_seconds" in families and "kvtier_reserve_seconds" in families
    timing = stats_dict(stats, metrics, "i")["service_seconds"]
    assert timing["lookup"]["count"] == 4 and timing["commit"] == {"count": 0, "sum": 0.0}


def test_version_falls_back_to_the_checkout_then_to_unknown(tmp_path: Path) -> None:
    missing = "kvtier-no-such-distribution"
    assert kvtier_version(missing, tmp_path) == UNKNOWN_VERSION
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "kvtier"\nversion = "9.8.7"\n')
    assert kvtier_version(missing, tmp_path) == "9.8.7" + CHECKOUT_SUFFIX
    (tmp_path / "pyproject.toml").write_text("[project\n")
    assert kvtier_version(missing, tmp_path) == UNKNOWN_VERSION
    assert kvtier_version() == importlib.metadata.version("kvtier")


def test_admin_metrics_carry_build_info_and_process_metrics(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    with thread_service(tmp_path, admin_port=str(port)), urllib.request.urlopen(url, timeout=5) as resp:
        body = resp.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(body)}
    (build,) = families["kvtier_build_info"].samples
    assert build.value == 1.0
    assert build.labels == {
        "version": importlib.metadata.version("kvtier"),
        "python": platform.python_version(),
        "protocol": str(PROTOCOL_VERSION),
    }
    assert families["python_info"].samples[0].labels["version"] == platform.python_version()
    (rss,) = families["process_resident_memory_bytes"].samples
    assert rss.value > 0
    (cpu,) = families["process_cpu_seconds"].samples
    assert cpu.name == "process_cpu_seconds_total" and cpu.value > 0
    (start,) = families["process_start_time_seconds"].samples
    assert start.value == pytest.approx(_process_start_time(), abs=1.0)
    assert "process_open_fds" in families and "python_gc_collections" in families


def _process_start_time() -> float:
    """This process's start, in seconds since the epoch, from /proc (as ProcessCollector reads it)."""
    with open("/proc/stat") as f:
        boot = next(float(line.split()[1]) for line in f if line.startswith("btime "))
    with open("/proc/self/stat") as f:
        ticks = float(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def test_saves_refused_for_arena_space_are_exported_and_in_the_stats() -> None:
    stats = StoreStats({"cpu": TierStats()}, 0, 0, 0, 0, 2, 0, reserve_dropped=5, writes_yielded=3)
    body = generate_latest(build_registry(lambda: stats, ServiceMetrics())).decode()
    families = {f.name: f for f in text_string_to_metric_families(body)}
    assert [s.value for s in families["kvtier_reserves_dropped"].samples if s.name.endswith("_total")] == [5]
    assert [s.value for s in families["kvtier_writes_dropped"].samples if s.name.endswith("_total")] == [2]
    assert [s.value for s in families["kvtier_writes_yielded"].samples if s.name.endswith("_total")] == [3]
    as_dict = stats_dict(stats, ServiceMetrics(), "i")
    assert as_dict["reserves_dropped"] == 5 and as_dict["writes_yielded"] == 3
