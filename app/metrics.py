"""The service's counters, its Prometheus registry and the JSON shape of `kvtier stats --json`.

Who owns what: the service's event loop owns ServiceMetrics (plain ints, no locks); the registry
belongs to one service instance, never the process-global one, and reads the counters at scrape time.
Design: docs/internals.md#metrics-metricspy
"""

from __future__ import annotations

import importlib.metadata
import platform
import time
import tomllib
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvtier.app.protocol import PROTOCOL_VERSION
from kvtier.storage.base import StoreStats, Tier

DISTRIBUTION = "kvtier"
# A checkout's root (pyproject.toml) is two levels above this file; an installed kvtier has none there.
CHECKOUT_ROOT = Path(__file__).resolve().parents[1]
CHECKOUT_SUFFIX = "+checkout"
UNKNOWN_VERSION = "0+unknown"

LATENCY_BUCKETS = (
    50e-6,
    100e-6,
    200e-6,
    500e-6,
    1e-3,
    2e-3,
    5e-3,
    10e-3,
    20e-3,
    50e-3,
    0.1,
    0.25,
    0.5,
    1.0,
    5.0,
)
TIER_LABELS = tuple(t.label for t in Tier)
_TIERS = tuple(zip(Tier, TIER_LABELS, strict=True))  # iterating an Enum runs Python code each time
_LABEL = dict(_TIERS)  # Tier.label is a property: Python code per call
TIMED_CALLS = ("lookup", "stage", "reserve", "commit")


class Latency:
    """One call's latency histogram as plain numbers: a count per LATENCY_BUCKETS bucket (the last
    one for slower calls) and the seconds they add up to."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.total = 0.0

    @property
    def count(self) -> int:
        """Calls observed."""
        return sum(self.counts)

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        """The Prometheus histogram family (cumulative buckets, as a Histogram exposes them)."""
        buckets: list[tuple[str, float]] = []
        below = 0
        for bound, n in zip(LATENCY_BUCKETS, self.counts, strict=False):
            below += n
            buckets.append((floatToGoString(bound), below))
        buckets.append(("+Inf", below + self.counts[-1]))
        return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=self.total)


class PrestageCounts:
    """Reads ahead (lookups with stage set): started, their bytes, skipped over the budget, failed."""

    __slots__ = ("bytes", "errors", "inflight_bytes", "leases", "skipped")

    def __init__(self) -> None:
        self.leases = 0  # leases whose lower-tier hits were staged ahead
        self.bytes = 0  # the bytes those reads brought in (chunk bytes of their lower-tier hits)
        self.skipped = 0  # lookups not staged ahead: their reads would have passed the budget
        self.errors = 0  # reads ahead that raised (each logged)
        self.inflight_bytes = 0  # bytes of the reads ahead running now

    def as_dict(self) -> dict[str, int]:
        """The stats object's "prestage" entry."""
        names = ("leases", "bytes", "skipped", "errors", "inflight_bytes")
        return {name: getattr(self, name) for name in names}


class ServiceMetrics:
    """Counters the service keeps beyond the store's own: calls, hits by tier, protocol errors."""

    def __init__(self, call_names: Iterable[str] = ()) -> None:
        self.started = time.monotonic()
        self.lookups = 0
        self.lookup_chunks = 0
        self.hit_chunks = dict.fromkeys(TIER_LABELS, 0)
        self.hit_tokens = dict.fromkeys(TIER_LABELS, 0)
        # Every call's count exists from the start (exported as 0): counting one is an increment.
        self.calls: dict[str, int] = dict.fromkeys(call_names, 0)
        self.call_errors: dict[tuple[str, str], int] = {}
        self.protocol_errors: dict[str, int] = {}
        self.connections = 0
        self.connections_total = 0
        self.registry = CollectorRegistry(auto_describe=True)
        self.latency = {name: Latency() for name in TIMED_CALLS}
        self.prestage = PrestageCounts()

    def observe(self, call: str, seconds: float) -> None:
        """One timed call (lookup, stage, reserve or commit), as measured inside the service."""
        latency = self.latency[call]
        latency.counts[bisect_left(LATENCY_BUCKETS, seconds)] += 1  # buckets are upper bounds (le)
        latency.total += seconds

    def count_hits(self, tiers: list[Tier], chunk_tokens: int) -> None:
        """Add one lookup's hits (the tier of each hit chunk) by tier."""
        self.lookups += 1
        if not tiers:
            return
        first = tiers[0]
        n = tiers.count(first)  # C-level scan; usually one tier holds every hit
        label = _LABEL[first]
        self.hit_chunks[label] += n
        self.hit_tokens[label] += n * chunk_tokens
        if n == len(tiers):
            return
        for tier, label in _TIERS:
            if tier is not first and (n := tiers.count(tier)):
                self.hit_chunks[label] += n
                self.hit_tokens[label] += n * chunk_tokens

    def count_call_error(self, call: str, code: str) -> None:
        """One failed call, by call name and error code."""
        key = (call, code)
        self.call_errors[key] = self.call_errors.get(key, 0) + 1

    def count_protocol_error(self, kind: str) -> None:
        """One connection closed for a bad frame or failed handshake."""
        self.protocol_errors[kind] = self.protocol_errors.get(kind, 0) + 1

    @property
    def uptime(self) -> float:
        """Seconds since this service started."""
        return time.monotonic() - self.started


def stats_dict(stats: StoreStats, metrics: ServiceMetrics, instance_id: str) -> dict[str, Any]:
    """The object of `kvtier stats --json`, /stats and the stats call (no settings, no secrets)."""
    tiers: dict[str, dict[str, Any]] = {}
    for name, tier in stats.tiers.items():
        tiers[name] = {
            "chunks": tier.chunks,
            "bytes": tier.bytes,
            "capacity": tier.capacity,
            "hits": tier.hits,
            "misses": tier.misses,
            "stores": tier.stores,
            "evictions": tier.evictions,
            "errors": tier.error_total,
            "errors_by_kind": dict(tier.errors),
            "bytes_read": tier.bytes_read,
            "bytes_written": tier.bytes_written,
            "healthy": tier.healthy,
            "loading": tier.loading,
        }
    return {
        "instance_id": instance_id,
        "uptime_s": round(metrics.uptime, 3),
        "tiers": tiers,
        "leases_active": stats.leases_active,
        "slots_in_use": stats.slots_in_use,
        "slots_total_bytes": stats.slots_total_bytes,
        "write_queue_depth": stats.write_queue_depth,
        "writes_dropped": stats.writes_dropped,
        "writes_yielded": stats.writes_yielded,
        "reserves_dropped": stats.reserve_dropped,
        "namespaces": stats.namespaces,
        "connections": metrics.connections,
        "lookups": metrics.lookups,
        "hit_chunks": dict(metrics.hit_chunks),
        "hit_tokens": dict(metrics.hit_tokens),
        "calls": dict(metrics.calls),
        "call_errors": {f"{c}:{k}": n for (c, k), n in metrics.call_errors.items()},
        "protocol_errors": dict(metrics.protocol_errors),
        "prestage": metrics.prestage.as_dict(),
        "service_seconds": {
            name: {"count": latency.count, "sum": round(latency.total, 6)}
            for name, latency in metrics.latency.items()
        },
    }


class StoreCollector(Collector):
    """Turns the store's StoreStats and the service counters into Prometheus families on scrape."""

    def __init__(self, snapshot: Callable[[], StoreStats], metrics: ServiceMetrics) -> None:
        self._snapshot = snapshot
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        """Every kvtier family."""
        stats, m = self._snapshot(), self._metrics
        yield from _tier_families(stats)
        yield _gauge("kvtier_leases_active", "Leases held by lookups.", stats.leases_active)
        yield _gauge("kvtier_slots_in_use", "Arena slots reserved, leased or stored.", stats.slots_in_use)
        yield _gauge("kvtier_slots_bytes", "Bytes of the arena in use.", stats.slots_total_bytes)
        yield _gauge(
            "kvtier_write_queue_depth",
            "Chunks waiting for lower-tier writes.",
            stats.write_queue_depth,
        )
        yield _counter(
            "kvtier_writes_dropped", "Lower-tier writes dropped (queue full).", stats.writes_dropped
        )
        yield _counter(
            "kvtier_writes_yielded",
            "Queued lower-tier writes given up so that a save found an arena slot.",
            stats.writes_yielded,
        )
        yield _counter(
            "kvtier_reserves_dropped",
            "Saves refused for lack of arena space (every slot pinned or leased).",
            stats.reserve_dropped,
        )
        yield _gauge("kvtier_namespaces", "Registered namespaces.", stats.namespaces)
        yield _gauge("kvtier_connections", "Open client connections.", m.connections)
        yield _counter("kvtier_lookups", "Lookup calls served.", m.lookups)
        hits = CounterMetricFamily("kvtier_hit_chunks", "Chunks found by lookups, by tier.", labels=["tier"])
        tokens = CounterMetricFamily(
            "kvtier_hit_tokens", "Tokens found by lookups, by tier.", labels=["tier"]
        )
        for label in TIER_LABELS:
            hits.add_metric([label], m.hit_chunks[label])
            tokens.add_metric([label], m.hit_tokens[label])
        yield hits
        yield tokens
        calls = CounterMetricFamily("kvtier_calls", "Calls served, by call.", labels=["call"])
        for call, n in m.calls.items():
            calls.add_metric([call], n)
        yield calls
        errs = CounterMetricFamily(
            "kvtier_call_errors", "Failed calls, by call and error code.", labels=["call", "code"]
        )
        for (call, code), n in m.call_errors.items():
            errs.add_metric([call, code], n)
        yield errs
        proto = CounterMetricFamily(
            "kvtier_protocol_errors", "Connections closed for bad frames.", labels=["kind"]
        )
        for kind, n in m.protocol_errors.items():
            proto.add_metric([kind], n)
        yield proto
        yield from _prestage_families(m.prestage)
        for name in TIMED_CALLS:
            yield m.latency[name].family(f"kvtier_{name}_seconds", f"Service-side latency of {name} calls.")


def _prestage_families(counts: PrestageCounts) -> Iterator[Metric]:
    yield _counter("kvtier_prestaged_leases", "Leases whose lower-tier hits were read ahead.", counts.leases)
    yield _counter("kvtier_prestaged_bytes", "Bytes of lower-tier hits read ahead.", counts.bytes)
    yield _counter(
        "kvtier_prestage_skipped", "Lookups not read ahead: over the prestage budget.", counts.skipped
    )
    yield _counter("kvtier_prestage_errors", "Reads ahead that failed.", counts.errors)
    yield _gauge("kvtier_prestage_inflight_bytes", "Bytes of the reads ahead running.", counts.inflight_bytes)


def _tier_families(stats: StoreStats) -> Iterator[Metric]:
    gauges = {
        "chunks": ("kvtier_tier_chunks", "Chunks stored in the tier."),
        "bytes": ("kvtier_tier_bytes", "Bytes stored in the tier."),
        "capacity": ("kvtier_tier_capacity_bytes", "Capacity of the tier in bytes."),
    }
    counters = {
        "hits": ("kvtier_tier_hits", "Chunks the tier served."),
        "misses": ("kvtier_tier_misses", "Chunks asked of the tier and not found."),
        "stores": ("kvtier_tier_stores", "Chunks written to the tier."),
        "evictions": ("kvtier_tier_evictions", "Chunks evicted from the tier."),
        "bytes_read": ("kvtier_tier_read_bytes", "Bytes read from the tier."),
        "bytes_written": ("kvtier_tier_written_bytes", "Bytes written to the tier."),
    }
    families: dict[str, Metric] = {}
    for attr, (name, doc) in gauges.items():
        families[attr] = GaugeMetricFamily(name, doc, labels=["tier"])
    for attr, (name, doc) in counters.items():
        families[attr] = CounterMetricFamily(name, doc, labels=["tier"])
    healthy = GaugeMetricFamily("kvtier_tier_healthy", "1 when the tier is serving.", labels=["tier"])
    loading = GaugeMetricFamily(
        "kvtier_tier_loading", "1 while the tier's index is loaded (disk scan, object LIST).", labels=["tier"]
    )
    errors = CounterMetricFamily("kvtier_tier_errors", "Tier errors by kind.", labels=["tier", "kind"])
    for tier_name, tier in stats.tiers.items():
        for attr, family in families.items():
            family.add_metric([tier_name], getattr(tier, attr))  # type: ignore[attr-defined]
        healthy.add_metric([tier_name], 1.0 if tier.healthy else 0.0)
        loading.add_metric([tier_name], 1.0 if tier.loading else 0.0)
        for kind, n in tier.errors.items():
            errors.add_metric([tier_name, kind], n)
    yield from families.values()
    yield healthy
    yield loading
    yield errors


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def kvtier_version(distribution: str = DISTRIBUTION, checkout: Path = CHECKOUT_ROOT) -> str:
    """The installed distribution's version; from a checkout without installed metadata, the version
    in its pyproject.toml plus CHECKOUT_SUFFIX; UNKNOWN_VERSION when neither can be read."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        with (checkout / "pyproject.toml").open("rb") as f:
            version = tomllib.load(f)["project"]["version"]
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError):
        return UNKNOWN_VERSION
    return f"{version}{CHECKOUT_SUFFIX}" if isinstance(version, str) else UNKNOWN_VERSION


def build_labels() -> dict[str, str]:
    """The labels of kvtier_build_info: kvtier's version, Python's and the wire protocol's."""
    return {
        "version": kvtier_version(),
        "python": platform.python_version(),
        "protocol": str(PROTOCOL_VERSION),
    }


class BuildInfoCollector(Collector):
    """``kvtier_build_info``: a constant 1 whose labels say what runs."""

    def __init__(self, labels: dict[str, str]) -> None:
        self._labels = dict(labels)

    def collect(self) -> Iterator[Metric]:
        """The one family."""
        family = GaugeMetricFamily(
            "kvtier_build_info",
            "kvtier's version, Python's version and the wire protocol's version; always 1.",
            labels=list(self._labels),
        )
        family.add_metric(list(self._labels.values()), 1.0)
        yield family


def build_registry(snapshot: Callable[[], StoreStats], metrics: ServiceMetrics) -> CollectorRegistry:
    """The service instance's registry: the scrape-time collector of the store's and service's
    counters, kvtier_build_info, and the process, platform and GC collectors."""
    registry = metrics.registry
    registry.register(StoreCollector(snapshot, metrics))
    registry.register(BuildInfoCollector(build_labels()))
    ProcessCollector(registry=registry)  # process_*: CPU seconds, memory, open fds (Linux /proc)
    PlatformCollector(registry=registry)  # python_info
    GCCollector(registry=registry)  # python_gc_*
    return registry
