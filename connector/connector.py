"""KVTierConnector: the vLLM KV connector class. It only dispatches to the side of its role.

A cache is best effort: where kvtier cannot serve, the connector stays idle (every lookup a miss,
nothing saved) and says why at WARNING, or stops the engine with ``fail_when_idle``.
Design: docs/internals.md#connector-class-connectorpy
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.logger import init_logger

from kvtier.app.client import ServiceClient
from kvtier.app.embedded import RespawnCounts
from kvtier.app.settings import KVTierSettings, load_settings
from kvtier.connector import faults
from kvtier.connector.config import ConnectorConfig, UnsupportedEngine, build_config
from kvtier.connector.logs import configure as configure_logs
from kvtier.connector.logs import vllm_log_stream
from kvtier.connector.metadata import KVTierMetadata
from kvtier.connector.scheduler import SchedulerSide
from kvtier.connector.stats import IDLE_SIDES, STATE_KEYS, RespawnReport, SideState, merge_counts
from kvtier.connector.worker import WorkerSide
from kvtier.storage.base import Tier

if TYPE_CHECKING:
    import torch
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# Under vLLM's "vllm" logger: vLLM's handler, format and level, which a logger of our own lacks.
log = init_logger("vllm.kvtier.connector")

FIRST_ANSWER_S = 5.0  # how long the constructor waits for the service's first answer


class KVTierIdle(RuntimeError):
    """kvtier cannot serve this engine and fail_when_idle asks to stop rather than run without it."""


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
        """One interval's figures for vLLM's logger; ``idle=1`` when a side was idle in it."""
        data = self.data
        out: dict[str, int | float] = {
            k: v for k, v in data.items() if isinstance(v, int | float) and k not in STATE_KEYS
        }
        count = data.get("lookup_count", 0)
        if count:
            out["lookup_avg_ms"] = round(1000.0 * data.get("lookup_seconds", 0.0) / count, 3)
        if data.get(IDLE_SIDES, 0):  # summed over steps: a count of reports, not of sides
            out["idle"] = 1
        return out

    def is_empty(self) -> bool:
        """True when nothing was counted and no state was reported (an idle side always reports)."""
        return not any(self.data.values())


@dataclass(frozen=True)
class ConnectorSnapshot:
    """One side of a KVTierConnector as ``KVTierConnector.snapshot()`` saw it: for benchmarks, tests
    and tools that hold the connector object (docs/architecture.md, "Observing a connector")."""

    side: str  # "scheduler" or "worker"
    serving: bool  # nothing keeps it idle and its service is connected
    idle_reason: str  # why it stays idle for good; '' while it serves or may serve
    namespace: str  # this side's namespace ('' when idle from the start)
    generation: str  # the namespaces' generation, moved on by reset_cache ('' until the first reset)
    # Counters (the keys of vLLM's kvtier stats) summed over every report vLLM has taken so far;
    # what happened since the last get_kv_connector_stats() is not in them yet.
    totals: dict[str, Any] = field(default_factory=dict)


def _hit_source(tier: Tier) -> Any:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    return {Tier.CPU: CacheHitSource.HOST, Tier.DISK: CacheHitSource.DISK}.get(
        tier, CacheHitSource.EXTERNAL_UNSPECIFIED
    )


def _connect(cfg: ConnectorConfig, respawns: RespawnCounts) -> ServiceClient:
    from kvtier.app.embedded import connect

    # service_url set: that service; empty: the engine's private service, restarted if it dies
    # (counted in respawns). An embedded service writes its lines where vLLM writes its own.
    return connect(
        cfg.settings, cfg.engine_id, name="kvtier-client", log_stream=vllm_log_stream(), respawns=respawns
    )


def _first_answer(client: ServiceClient) -> str:
    """'' once the service answers a hello, else why it did not (the client keeps trying)."""
    try:
        # A unix socket nobody listens on fails at once; a silent TCP peer within the client's
        # connect timeout; the call's own timeout bounds the rest.
        client.hello(timeout=FIRST_ANSWER_S).result(FIRST_ANSWER_S + 1.0)
    except Exception as exc:
        return f"no answer from the service: {exc}"
    return ""


def _transfer_config(vllm_config: VllmConfig) -> KVTransferConfig:
    """vLLM's --kv-transfer-config, which names this connector (so it is set)."""
    config = vllm_config.kv_transfer_config
    assert config is not None, "vLLM builds a KV connector only from a kv_transfer_config"
    return config


def _settings_of(vllm_config: VllmConfig) -> KVTierSettings:
    # build_config validated them before it refused the engine: loading them again cannot fail.
    return load_settings(extra=dict(_transfer_config(vllm_config).kv_connector_extra_config or {}))


def _idle_error(reason: str) -> KVTierIdle:
    return KVTierIdle(
        f"kvtier cannot serve this engine: {reason}. The setting fail_when_idle "
        "(KVTIER_FAIL_WHEN_IDLE) is true, so vLLM stops instead of running without kvtier; set it "
        "to false to let vLLM run without kvtier"
    )


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """kvtier's vLLM KV connector: CPU, disk and Redis tiers behind one lookup.

    It declares ``SupportsHMA``, so vLLM keeps its hybrid KV cache manager on: engines with several
    KV cache groups (sliding-window hybrids) keep freeing the blocks behind each window.
    """

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._client: ServiceClient | None = None
        is_worker = role == KVConnectorRole.WORKER
        self._side = "worker" if is_worker else "scheduler"
        self._engine_id = str(_transfer_config(vllm_config).engine_id)
        self._idle = ""  # why this side stays idle for good; '' while it serves or may serve
        self._state = SideState()
        self._respawns = RespawnReport(RespawnCounts())
        self._said_serving = False  # what the log said last: serving, or idle
        try:
            cfg = build_config(vllm_config, kv_cache_config, role_is_worker=is_worker)
        except UnsupportedEngine as exc:
            self._refused(str(exc), _settings_of(vllm_config))
            return
        self._settings = cfg.settings
        configure_logs(cfg.settings, self._side)
        if cfg.failure_policy != "recompute" and not is_worker:  # one warning per engine
            log.warning(
                "kvtier: kv_load_failure_policy is %r; a failed load then fails the request. "
                'Use "kv_load_failure_policy":"recompute" so a failed tier only costs a recompute.',
                cfg.failure_policy,
            )
        try:
            self._client = _connect(cfg, self._respawns.counts)
        except Exception as exc:  # best effort: run without the cache rather than not at all
            faults.caught(exc, "starting the connector")
            self._stay_idle(f"cannot reach or start the kvtier service: {exc}")
            return
        self._wait_first_answer()
        if is_worker:
            self._worker = WorkerSide(cfg, self._client)  # tells the service once its KV is mapped
        else:
            self._sched = SchedulerSide(cfg, self._client)
            self._tell_service()
        if self._said_serving:
            log.info(
                "kvtier connector (%s) ready: namespace %s, chunk %d tokens, service %s",
                self._side,
                cfg.namespace,
                cfg.settings.chunk_size,
                cfg.settings.service_url or "embedded",
            )

    # ---------------------------------------------------------------------------------- state
    def _refused(self, reason: str, settings: KVTierSettings) -> None:
        """The engine is of a shape kvtier does not serve: idle, and a shared service hears of it."""
        self._settings = settings
        configure_logs(settings, self._side)
        self._stay_idle(reason)
        if self._side == "scheduler" and settings.service_url:  # one report per engine
            self._client = ServiceClient(settings.service_url, settings.auth_token, name="kvtier-report")
            self._tell_service()

    def _stay_idle(self, reason: str) -> None:
        """Run without kvtier for good, or stop the engine when fail_when_idle asks to."""
        if self._settings.fail_when_idle:
            if self._client is not None:
                self._client.close()
            raise _idle_error(reason)
        log.warning("kvtier (%s) stays idle, vLLM runs without it: %s", self._side, reason)
        self._idle = reason
        self._said_serving = False

    def _wait_first_answer(self) -> None:
        """Wait (bounded) until the service answers; without an answer, idle until it does."""
        assert self._client is not None
        why = _first_answer(self._client)
        if not why:
            self._said_serving = True
            return
        if self._settings.fail_when_idle:
            self._client.close()
            raise _idle_error(why)
        log.warning("kvtier (%s) is idle until the service answers: %s", self._side, why)

    def _serving(self) -> bool:
        """True while this side serves: nothing keeps it idle and its service is connected."""
        client = self._client
        return not self._idle and client is not None and client.connected

    def _tell_service(self) -> None:
        """Report this side's lasting state; the client keeps it and tells it again on reconnect."""
        if self._client is not None:
            self._client.report(self._engine_id, self._side, not self._idle, self._idle)

    def _log_change(self, serving: bool) -> None:
        """Say in vLLM's log when the service went away or came back."""
        if serving == self._said_serving:
            return
        self._said_serving = serving
        url = self._client.url if self._client is not None else "?"
        if serving:
            log.info("kvtier (%s) serves again: the service at %s answers", self._side, url)
        else:
            log.warning("kvtier (%s) is idle until the service at %s answers again", self._side, url)

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache is best effort: vLLM never waits for kvtier to deliver KV."""
        return False

    # ------------------------------------------------------------------------------ scheduler
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens kvtier can load for this request; (None, False) asks vLLM to try next step."""
        if self._sched is None:
            return 0, False
        try:
            return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception as exc:
            faults.caught(exc, "get_num_new_matched_tokens")
            log.warning("kvtier lookup failed; treating it as a miss: %s", exc)
            return 0, False

    def on_new_request(self, request: Request) -> None:
        """Prefetch the lookup of a request the moment vLLM receives it."""
        if self._sched is not None:
            try:
                self._sched.on_new_request(request)
            except Exception as exc:
                faults.caught(exc, "on_new_request")
                log.warning("kvtier prefetch failed; the lookup happens at admission instead: %s", exc)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Plan the load of the external tokens into the allocated blocks."""
        if self._sched is not None:
            self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's plan for the workers."""
        if self._sched is None:
            return KVTierMetadata()
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Completions reported by the workers."""
        if self._sched is not None:
            self._sched.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Release the request's lease; hold its blocks while copies may still read them (one group)."""
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Release the request's lease; hold its blocks of every group while copies may read them."""
        if self._sched is None:
            return False, None
        return self._sched.request_finished(request, block_ids)

    def reset_cache(self) -> bool | None:
        """vLLM reset its caches (``reset_prefix_cache(reset_connector=True)``, e.g. after a weight
        update): this engine moves to new namespaces, so no chunk stored before is used again."""
        if self._sched is None:
            return None
        return self._sched.reset_cache()

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict:
        """Split the external tokens of the last admission by tier."""
        if self._sched is None or num_external_tokens == 0:
            return {}
        sources: dict[Any, int] = {}
        for tier, tokens in self._sched.get_external_cache_hit_sources(request, num_external_tokens).items():
            key = _hit_source(tier)
            sources[key] = sources.get(key, 0) + tokens
        return sources

    # --------------------------------------------------------------------------------- worker
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Map vLLM's KV tensors (one per layer) for block copies; a refused layout leaves this worker
        idle (or stops the engine, with fail_when_idle)."""
        if self._worker is None:
            return
        try:
            self._worker.register_kv_caches(kv_caches)
        except Exception as exc:
            self._cannot_copy(exc, "register_kv_caches")
        self._tell_service()

    def _cannot_copy(self, exc: Exception, where: str) -> None:
        """This worker's KV cache cannot be copied: idle for good (or stop, with fail_when_idle)."""
        faults.caught(exc, where)
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None
        self._stay_idle(f"this worker's KV cache cannot be copied: {exc}")

    @classmethod
    def supports_sleep_mode(cls) -> bool:
        """kvtier follows vLLM's sleep mode: it lets go of the KV cache in unregister_kv_caches and
        takes it up again in restore_kv_caches."""
        return True

    def unregister_kv_caches(self) -> None:
        """vLLM releases its KV cache (sleep mode): end every copy and read of it, fail pending async
        loads, release the copier's staging buffers and unpin the arena."""
        if self._worker is None:
            return
        try:
            self._worker.unregister_kv_caches()
        except Exception as exc:  # nothing may touch the released memory: this worker stops serving
            self._cannot_copy(exc, "unregister_kv_caches")

    def restore_kv_caches(self, kv_caches: dict[str, torch.Tensor] | None = None) -> None:
        """vLLM's KV cache is back after sleep mode: copy from and into it again (the tensors handed
        over, else those registered before), with the arena mapped and pinned again."""
        if self._worker is None:
            return
        try:
            self._worker.restore_kv_caches(kv_caches)
        except Exception as exc:
            self._cannot_copy(exc, "restore_kv_caches")

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Receive this step's plan and start its reserves."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KVTierMetadata):
            self._worker.bind(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Fence copies of preempted requests before their blocks are reused."""
        if self._worker is not None and isinstance(kv_connector_metadata, KVTierMetadata):
            self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
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

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Saves copy all layers at once in wait_for_save."""
        return

    def finish_forward(self) -> None:
        """The target model's forward ended (V2 model runner): order the drafter after the loads."""
        if self._worker is not None:
            self._worker.finish_forward()

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

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """get_finished's requests, and the async loads that failed as a whole (hybrid engines: vLLM
        maps failed blocks back to requests only where an engine has one KV cache group)."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = self._worker.take_failed_loads() if self._worker is not None else set()
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()) | failed,
            failed_recving=failed,
        )

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """The step through which this worker's saves have ended (finished requests need not wait)."""
        return self._worker.worker_meta() if self._worker is not None else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Exactly the blocks whose load failed."""
        return self._worker.take_load_errors() if self._worker is not None else set()

    # ---------------------------------------------------------------------------------- both
    def snapshot(self) -> ConnectorSnapshot:
        """This side's state and running counters (a copy: later steps do not change it)."""
        side: SchedulerSide | WorkerSide | None = self._sched if self._sched is not None else self._worker
        cfg = side.cfg if side is not None else None
        return ConnectorSnapshot(
            side=self._side,
            serving=self._serving(),
            idle_reason=self._idle,
            namespace=cfg.namespace if cfg is not None else "",
            generation=cfg.generation if cfg is not None else "",
            totals=dict(side.totals) if side is not None else {},
        )

    def wait_connected(self, timeout: float) -> bool:
        """Block until this side's service connection is up (or timeout): for tools and tests, never
        from a hook. False when this side has no service to connect to."""
        return self._client is not None and self._client.wait_connected(timeout)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Counters since the last report, and this side's state (see kvtier.connector.stats.SideState)."""
        side = self._worker or self._sched
        data = side.stats() if side is not None else {}
        serving = self._serving()
        self._state.stamp(data, serving)
        self._respawns.stamp(data)
        if not self._idle:
            self._log_change(serving)
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
        from kvtier.connector.prom import KVTierPromMetrics

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
        if self._client is not None:
            self._client.close()
