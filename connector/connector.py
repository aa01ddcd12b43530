"""KVTierConnector: the vLLM KV connector class. It only dispatches to the side of its role.

A cache is best effort: when the engine's KV cache is of a shape kvtier does not serve, or the service
cannot be reached, the connector stays idle (every lookup a miss, nothing saved) and vLLM runs as if it
were absent. Invalid kvtier settings are the exception: they stop the engine with a clear message.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from app.client import ServiceClient
from connector.config import ConnectorConfig, UnsupportedEngine, build_config
from connector.metadata import KVTierMetadata
from connector.scheduler import SchedulerSide
from connector.stats import merge_counts
from connector.worker import WorkerSide
from storage.base import Tier

log = logging.getLogger(__name__)


class KVTierStats(KVConnectorStats):
    """kvtier's counters as vLLM's connector stats: summed across workers and the scheduler."""

    def reset(self) -> None:
        """Forget the counts."""
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Sum with another report."""
        self.data = merge_counts(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        """One interval's figures for vLLM's logger."""
        out: dict[str, int | float] = {k: v for k, v in self.data.items() if isinstance(v, int | float)}
        count = self.data.get("lookup_count", 0)
        if count:
            out["lookup_avg_ms"] = round(1000.0 * self.data.get("lookup_seconds", 0.0) / count, 3)
        return out

    def is_empty(self) -> bool:
        """True when nothing was counted."""
        return not any(self.data.values())


def _hit_source(tier: Tier) -> Any:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    return {Tier.CPU: CacheHitSource.HOST, Tier.DISK: CacheHitSource.DISK}.get(
        tier, CacheHitSource.EXTERNAL_UNSPECIFIED
    )


def _connect(cfg: ConnectorConfig) -> ServiceClient:
    from app.embedded import connect

    # service_url set: that service; empty: the engine's private service, restarted if it dies.
    return connect(cfg.settings, cfg.engine_id, name="kvtier-client")


class KVTierConnector(KVConnectorBase_V1):
    """kvtier's vLLM KV connector: CPU, disk and Redis tiers behind one lookup."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        is_worker = role == KVConnectorRole.WORKER
        try:
            cfg = build_config(vllm_config, kv_cache_config, role_is_worker=is_worker)
        except UnsupportedEngine as exc:
            log.warning("kvtier stays idle: %s", exc)
            return
        if cfg.failure_policy != "recompute" and not is_worker:  # one warning per engine
            log.warning(
                "kvtier: kv_load_failure_policy is %r; a failed load then fails the request. "
                'Use "kv_load_failure_policy":"recompute" so a failed tier only costs a recompute.',
                cfg.failure_policy,
            )
        try:
            client: ServiceClient | None = _connect(cfg)
        except Exception as exc:  # best effort: run without the cache rather than not at all
            log.warning("kvtier stays idle: cannot reach or start the service: %s", exc)
            client = None
        self._client = client
        if is_worker:
            self._worker = WorkerSide(cfg, client)
        else:
            self._sched = SchedulerSide(cfg, client)
        log.info(
            "kvtier connector (%s) ready: namespace %s, chunk %d tokens, service %s",
            role.name.lower(),
            cfg.namespace,
            cfg.settings.chunk_size,
            cfg.settings.service_url or "embedded",
        )

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache is best effort: vLLM never waits for kvtier to deliver KV."""
        return False

    # ------------------------------------------------------------------------------ scheduler
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens kvtier can load for this request; (None, False) asks vLLM to try next step."""
        if self._sched is None:
            return 0, False
        try:
            return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception:
            log.exception("kvtier lookup failed; treating it as a miss")
            return 0, False

    def on_new_request(self, request: Any) -> None:
        """Prefetch the lookup of a request the moment vLLM receives it."""
        if self._sched is not None:
            try:
                self._sched.on_new_request(request)
            except Exception:
                log.exception("kvtier prefetch failed; the lookup happens at admission instead")

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plan the load of the external tokens into the allocated blocks."""
        if self._sched is not None:
            self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """This step's plan for the workers."""
        if self._sched is None:
            return KVTierMetadata()
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        """Completions reported by the workers."""
        if self._sched is not None:
            self._sched.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Release the request's lease; hold its blocks while copies may still read them."""
        if self._sched is None:
            return False, None
        return self._sched.request_finished(request, block_ids)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict:
        """Split the external tokens of the last admission by tier."""
        if self._sched is None or num_external_tokens == 0:
            return {}
        sources: dict[Any, int] = {}
        for tier, tokens in self._sched.get_external_cache_hit_sources(request, num_external_tokens).items():
            key = _hit_source(tier)
            sources[key] = sources.get(key, 0) + tokens
        return sources

    # --------------------------------------------------------------------------------- worker
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Map vLLM's KV tensors (one per layer) for block copies."""
        if self._worker is None:
            return
        try:
            self._worker.register_kv_caches(kv_caches)
        except Exception as exc:
            log.warning("kvtier stays idle on this worker: %s", exc)
            self._worker.shutdown()
            self._worker = None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Receive this step's plan and start its reserves."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KVTierMetadata):
            self._worker.bind(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Fence copies of preempted requests before their blocks are reused."""
        if self._worker is not None and isinstance(kv_connector_metadata, KVTierMetadata):
            self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Load CPU-tier hits now; start staging lower-tier hits."""
        if self._worker is None:
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, KVTierMetadata):
            self._worker.start_load(meta, forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Hold the layer's attention until this step's loads of that layer are in place."""
        if self._worker is not None:
            self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Saves copy all layers at once in wait_for_save."""
        return

    def wait_for_save(self) -> None:
        """Copy this step's finished chunks to the arena and commit them."""
        if self._worker is not None:
            self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Held requests whose copies are done, and async loads that completed."""
        if self._worker is None:
            return None, None
        sending, recving = self._worker.get_finished(finished_req_ids)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Exactly the blocks whose load failed."""
        return self._worker.take_load_errors() if self._worker is not None else set()

    # ---------------------------------------------------------------------------------- both
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Counters since the last report."""
        side = self._worker or self._sched
        if side is None:
            return None
        data = side.stats()
        return KVTierStats(data=data) if any(data.values()) else None

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        """vLLM's /metrics gets kvtier's counters as ``vllm:kvtier_*``."""
        from connector.prom import KVTierPromMetrics

        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        """Rebuild stats sent from another process."""
        return KVTierStats(data=dict(data or {}))

    def shutdown(self) -> None:
        """Release leases, unmap the arena and close the client."""
        if self._sched is not None:
            self._sched.shutdown()
        if self._worker is not None:
            self._worker.shutdown()
        client = getattr(self, "_client", None)
        if client is not None:
            client.close()
