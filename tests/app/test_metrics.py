"""Service metrics: latency histograms kept as plain counts, exposed as Prometheus histograms."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.app.metrics import LATENCY_BUCKETS, ServiceMetrics, build_registry, stats_dict
from kvtier.storage.base import StoreStats, TierStats


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
