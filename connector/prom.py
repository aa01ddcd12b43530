"""kvtier's connector counters and state as Prometheus metrics on vLLM's /metrics (``vllm:kvtier_*``)."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from kvtier.connector.stats import reported_pinning, reported_state

ACTIVE = "vllm:kvtier_active"
ACTIVE_DOC = (
    "1 while kvtier serves this engine (the scheduler and every worker), 0 while any of them is idle "
    "(the engine's log says why); absent until the engine's first step."
)

ARENA_PINNED = "vllm:kvtier_arena_pinned"
ARENA_PINNED_DOC = (
    "1 while every CUDA worker's arena is pinned for DMA, 0 while one serves from pageable memory "
    "(its pinning failed; vLLM's log says why); absent without CUDA."
)

# stats key -> (metric name, help text, extra label (name, value) or None)
COUNTERS: dict[str, tuple[str, str, tuple[str, str] | None]] = {
    "admissions": ("vllm:kvtier_admissions", "Requests admitted with a kvtier lookup.", None),
    "readmissions": (
        "vllm:kvtier_readmissions",
        "Admissions of requests resumed after preemption.",
        None,
    ),
    "admissions_with_hit": ("vllm:kvtier_admissions_with_hit", "Admissions that loaded KV.", None),
    "external_tokens": ("vllm:kvtier_external_tokens", "Prompt tokens loaded instead of computed.", None),
    "hit_tokens_cpu": ("vllm:kvtier_hit_tokens", "Hit tokens by tier.", ("tier", "cpu")),
    "hit_tokens_disk": ("vllm:kvtier_hit_tokens", "Hit tokens by tier.", ("tier", "disk")),
    "hit_tokens_redis": ("vllm:kvtier_hit_tokens", "Hit tokens by tier.", ("tier", "redis")),
    "hit_tokens_object": ("vllm:kvtier_hit_tokens", "Hit tokens by tier.", ("tier", "object")),
    "lookups_deferred": (
        "vllm:kvtier_lookups_deferred",
        "Lookups not answered within the budget (asked again next step).",
        None,
    ),
    "lookup_errors": ("vllm:kvtier_lookup_errors", "Lookups that failed and counted as misses.", None),
    "lookup_count": ("vllm:kvtier_lookups", "Lookups answered.", None),
    "lookup_seconds": ("vllm:kvtier_lookup_seconds", "Seconds spent in answered lookups.", None),
    "loaded_tokens": ("vllm:kvtier_loaded_tokens", "Tokens of KV copied into vLLM's cache.", None),
    "failed_load_blocks": (
        "vllm:kvtier_failed_load_blocks",
        "Blocks whose load failed (recomputed).",
        None,
    ),
    "disk_read_chunks": (
        "vllm:kvtier_disk_read_chunks",
        "Disk-hit chunks the worker read from their files itself (the service's file channel).",
        None,
    ),
    "disk_read_fallbacks": (
        "vllm:kvtier_disk_read_fallbacks",
        "Loads whose disk files were gone or whose file channel failed: the service read them.",
        None,
    ),
    "saved_tokens": ("vllm:kvtier_saved_tokens", "Tokens of KV stored into kvtier.", None),
    "save_skipped_chunks": (
        "vllm:kvtier_save_skipped_chunks",
        "Chunks not saved: already stored, no space, or the service was slow.",
        None,
    ),
    "save_errors": ("vllm:kvtier_save_errors", "Save calls that failed.", None),
    "service_respawns": (
        "vllm:kvtier_service_respawns",
        "Restarts of the embedded service (it had died) that served, by any process of the engine.",
        None,
    ),
    "service_respawn_failures": (
        "vllm:kvtier_service_respawn_failures",
        "Restarts of the embedded service that did not serve in time (killed and tried again).",
        None,
    ),
    "unsaved_chunks": (
        "vllm:kvtier_unsaved_chunks",
        "Chunks not saved: vLLM had freed sliding-window blocks they must hold.",
        None,
    ),
    "window_fences": (
        "vllm:kvtier_window_fences",
        "Steps that waited for saves still reading sliding-window blocks vLLM handed out again.",
        None,
    ),
    "unwaited_layer_loads": (
        "vllm:kvtier_unwaited_layer_loads",
        "Steps whose forward did not wait for a layer's loads (loads recomputed, then fenced).",
        None,
    ),
}


class KVTierPromMetrics(KVConnectorPromMetrics):
    """Registers the counters and the state gauge once and adds each step's figures to them."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        families: dict[str, Any] = {}
        self._bound: dict[tuple[int, str], Any] = {}
        for key, (name, doc, extra) in COUNTERS.items():
            if name not in families:
                labels = labelnames + ([extra[0]] if extra else [])
                families[name] = self._counter_cls(name=name, documentation=doc, labelnames=labels)
            for engine, values in per_engine_labelvalues.items():
                label_values = list(values) + ([extra[1]] if extra else [])
                self._bound[(engine, key)] = families[name].labels(*label_values)
        # Each engine's child is made at its first report that carries a state: a 0 before then
        # would claim an idle engine that has only not run a step yet.
        gauge_cls: Any = self._gauge_cls  # typed by vLLM as any of its metric classes
        self._active_family = gauge_cls(
            name=ACTIVE, documentation=ACTIVE_DOC, labelnames=labelnames, multiprocess_mode="mostrecent"
        )
        self._active: dict[int, Any] = {}
        self._pinned_family = gauge_cls(
            name=ARENA_PINNED,
            documentation=ARENA_PINNED_DOC,
            labelnames=labelnames,
            multiprocess_mode="mostrecent",
        )
        self._pinned: dict[int, Any] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Set the state the report carries, if any, and add its counts."""
        for state, family, children in (
            (reported_state(transfer_stats_data), self._active_family, self._active),
            (reported_pinning(transfer_stats_data), self._pinned_family, self._pinned),
        ):
            if state is not None:
                gauge = children.get(engine_idx)
                if gauge is None:
                    gauge = children[engine_idx] = family.labels(*self.per_engine_labelvalues[engine_idx])
                gauge.set(1 if state else 0)
        for key, value in transfer_stats_data.items():
            metric = self._bound.get((engine_idx, key))
            if metric is not None and isinstance(value, int | float) and value > 0:
                metric.inc(value)
