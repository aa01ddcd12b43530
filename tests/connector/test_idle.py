"""The connector is never quietly idle: for each reason it goes idle, vLLM's log says why at WARNING,
vllm:kvtier_active reads 0, and a service that can hear of it lists the engine as idle; with
fail_when_idle the engine stops instead. An engine that serves reads 1, listed as active."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

from kvtier.app.embedded import RespawnCounts, paths_for
from kvtier.connector.connector import KVTierConnector, KVTierIdle, KVTierStats
from kvtier.connector.prom import ACTIVE, KVTierPromMetrics
from kvtier.connector.stats import ACTIVE_SIDES, IDLE_SIDES, STATE_KEYS, RespawnReport
from tests.app import ThreadService, settings_for, thread_service

SCHEDULER, WORKER = KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER
BLOCK, CHUNK, NUM_BLOCKS = 16, 32, 8
KV_SPEC = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
LAYERS = ("layer0", "layer1")
LABELS = {"model_name": "tiny", "engine": "0"}

Make = Callable[..., KVTierConnector]


def _engine(engine_id: str, state_space: bool, extra: dict[str, Any]) -> tuple[Any, KVCacheConfig]:
    """A vLLM config reduced to what the connector reads, and a KV cache config: one group of
    attention, and a group of Mamba state beside it if `state_space` (a hybrid kvtier refuses)."""
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"chunk_size": CHUNK, **extra},
            engine_id=engine_id,
            kv_load_failure_policy="recompute",
        ),
        cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype="auto", prefix_caching_hash_algo="sha256"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        model_config=SimpleNamespace(model="tiny", revision=None),
        scheduler_config=SimpleNamespace(async_scheduling=False),
        speculative_config=None,
    )
    kv_groups = [KVCacheGroupSpec(layer_names=list(LAYERS), kv_cache_spec=KV_SPEC)]
    if state_space:
        mamba = MambaSpec(block_size=BLOCK, shapes=((3, 384),), dtypes=(torch.bfloat16,))
        kv_groups.append(KVCacheGroupSpec(layer_names=["mamba0"], kv_cache_spec=mamba))
    return vllm_config, KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=kv_groups)


def _kv_caches() -> dict[str, torch.Tensor]:
    """One KV tensor per layer whose pages are the size vLLM's spec says."""
    return {
        name: torch.zeros(NUM_BLOCKS, KV_SPEC.page_size_bytes // 2, dtype=torch.bfloat16) for name in LAYERS
    }


@pytest.fixture
def make() -> Iterator[Make]:
    """Builds connectors of one engine (role, state_space, engine_id, extra config); shuts them down."""
    made: list[KVTierConnector] = []

    def build(
        role: KVConnectorRole, state_space: bool = False, engine_id: str = "engine-1", **extra: Any
    ) -> Any:
        vllm_config, kv_cache_config = _engine(engine_id, state_space, extra)
        conn = KVTierConnector(vllm_config, role, kv_cache_config)
        made.append(conn)
        return conn

    yield build
    for conn in made:
        conn.shutdown()


CONNECTOR_LOG = "vllm.kvtier.connector"


class _Records(logging.Handler):
    """Keeps every record it is handed."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def vllm_log() -> Iterator[list[logging.LogRecord]]:
    """Records that reach vLLM's "vllm" logger, whose handler vLLM configures (it does not propagate
    to the root logger once vLLM configured it, so caplog alone would miss them)."""
    handler = _Records()
    logger = logging.getLogger("vllm")
    logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)


def _warnings(records: list[logging.LogRecord]) -> list[str]:
    """The messages the connector class logged at WARNING (its sides log their own details too)."""
    return [r.getMessage() for r in records if r.levelno == logging.WARNING and r.name == CONNECTOR_LOG]


def _engines(*connectors: KVTierConnector) -> list[dict[str, Any]]:
    """The service's engines once each connector's report is in: calls on one connection are
    answered in order, so a stats call on each connection comes after that connection's report."""
    engines: list[dict[str, Any]] = []
    for conn in connectors:
        assert conn._client is not None
        engines = conn._client.stats().result(5)["engines"]
    return engines


def _engine_report(*connectors: KVTierConnector) -> dict[str, Any] | None:
    """One step's stats as vLLM's frontend gets them: the workers' and the scheduler's, summed."""
    total: KVTierStats | None = None
    for conn in connectors:
        stats = conn.get_kv_connector_stats()
        if stats is not None and not stats.is_empty():
            total = stats if total is None else total.aggregate(stats)  # type: ignore[assignment]
    return None if total is None else total.data


class _Prom:
    """KVTierPromMetrics on a registry of its own, as vLLM builds it in its frontend."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        types = {
            kind: functools.partial(kind, registry=self.registry) for kind in (Gauge, Counter, Histogram)
        }
        self.metrics = KVTierPromMetrics(
            SimpleNamespace(kv_transfer_config=None), types, list(LABELS), {0: list(LABELS.values())}
        )

    def active_after(self, *reports: dict[str, Any] | None) -> float | None:
        """vllm:kvtier_active of engine 0 once these reports were observed (None: no sample)."""
        for report in reports:
            if report is not None:
                self.metrics.observe(report, engine_idx=0)
        return self.registry.get_sample_value(ACTIVE, LABELS)


# ------------------------------------------------------------------------------------------ serving
def test_an_engine_kvtier_serves_reads_active_once_and_is_listed(
    make: Make, tmp_path: Path, vllm_log: list[logging.LogRecord]
) -> None:
    with thread_service(tmp_path) as svc:
        sched = make(SCHEDULER, service_url=svc.url)
        worker = make(WORKER, service_url=svc.url)
        worker.register_kv_caches(_kv_caches())
        first = _engine_report(worker, sched)
        assert first is not None and first[ACTIVE_SIDES] == 2 and IDLE_SIDES not in first
        # Later steps that count nothing report nothing: no line in vLLM's log for an idle interval.
        assert worker.get_kv_connector_stats() is None and sched.get_kv_connector_stats() is None
        assert _Prom().active_after(first, _engine_report(worker, sched)) == 1
        assert "active_sides" not in KVTierStats(data=first).reduce()
        assert _engines(sched, worker) == [
            {"engine_id": "engine-1", "role": "scheduler", "active": True, "reason": ""},
            {"engine_id": "engine-1", "role": "worker", "active": True, "reason": ""},
        ]
    assert _warnings(vllm_log) == []


def test_the_active_gauge_follows_the_state_each_report_carries() -> None:
    prom = _Prom()
    assert prom.active_after({"admissions": 3}) is None  # no state reported yet: no sample
    assert prom.active_after({IDLE_SIDES: 1}) == 0
    assert prom.active_after({"admissions": 1}) == 0  # a report without state changes nothing
    assert prom.active_after({ACTIVE_SIDES: 2}) == 1
    assert prom.active_after({ACTIVE_SIDES: 1, IDLE_SIDES: 1}) == 0  # any idle side makes it idle


def test_each_report_carries_the_respawns_counted_since_the_last_one() -> None:
    counts = RespawnCounts()
    report = RespawnReport(counts)
    data: dict[str, int] = {}
    report.stamp(data)
    assert data == {}  # nothing happened: nothing reported
    counts.failed += 2
    counts.started += 1
    report.stamp(data)
    assert data == {"service_respawns": 1, "service_respawn_failures": 2}
    later: dict[str, int] = {}
    report.stamp(later)
    assert later == {}  # each restart is reported once
    counts.started += 1
    report.stamp(later)
    assert later == {"service_respawns": 1}


# ------------------------------------------------------------------------------- unsupported engine
def test_a_state_space_hybrid_stays_idle_and_says_why(make: Make, vllm_log: list[logging.LogRecord]) -> None:
    sched, worker = make(SCHEDULER, state_space=True), make(WORKER, state_space=True)
    worker.register_kv_caches({})
    warnings = _warnings(vllm_log)
    assert len(warnings) == 2 and all("this engine has a KV cache group of MambaSpec" in w for w in warnings)
    assert all("stays idle" in w for w in warnings)
    assert sched.get_num_new_matched_tokens(SimpleNamespace(request_id="r"), 0) == (0, False)
    reports = [_engine_report(worker, sched) for _ in range(3)]
    assert all(r is not None and r[IDLE_SIDES] == 2 for r in reports)  # in every report
    assert KVTierStats(data=reports[0]).reduce() == {"idle": 1}  # type: ignore[arg-type]
    assert _Prom().active_after(*reports) == 0
    # The embedded default starts no private service only to hear of it.
    assert not paths_for("engine-1")[0].exists()


def test_a_shared_service_hears_of_an_engine_it_does_not_serve(
    make: Make, tmp_path: Path, vllm_log: list[logging.LogRecord]
) -> None:
    with thread_service(tmp_path) as svc:
        sched = make(SCHEDULER, state_space=True, service_url=svc.url)
        make(WORKER, state_space=True, service_url=svc.url)
        engines = _engines(sched)
    assert [(e["engine_id"], e["role"], e["active"]) for e in engines] == [("engine-1", "scheduler", False)]
    assert "this engine has a KV cache group of MambaSpec" in engines[0]["reason"]
    assert len(_warnings(vllm_log)) == 2


# ---------------------------------------------------------------------------------------- no service
def test_a_service_that_does_not_answer_leaves_the_engine_idle_until_it_does(
    make: Make, tmp_path: Path, vllm_log: list[logging.LogRecord]
) -> None:
    url = f"unix://{tmp_path}/svc.sock"  # nothing listens there yet: connects fail at once
    sched, worker = make(SCHEDULER, service_url=url), make(WORKER, service_url=url)
    worker.register_kv_caches(_kv_caches())
    warnings = _warnings(vllm_log)
    assert len(warnings) == 2
    assert all("idle until the service answers" in w and "cannot connect" in w for w in warnings)
    idle = _engine_report(worker, sched)
    assert idle is not None and idle[IDLE_SIDES] == 2
    prom = _Prom()
    assert prom.active_after(idle) == 0
    svc = ThreadService(url, settings_for(tmp_path)).start()
    try:
        assert sched._client is not None and worker._client is not None
        assert sched._client.wait_connected(10) and worker._client.wait_connected(10)
        back = _engine_report(worker, sched)
        assert back is not None and back[ACTIVE_SIDES] == 2 and IDLE_SIDES not in back
        assert prom.active_after(back) == 1
        # Each side's report, kept by its client, reached the service when it connected.
        engines = _engines(sched, worker)
        assert [(e["role"], e["active"]) for e in engines] == [("scheduler", True), ("worker", True)]
    finally:
        svc.stop()


# ------------------------------------------------------------------------------------ refused layout
def test_a_kv_layout_the_worker_cannot_copy_leaves_it_idle(
    make: Make, tmp_path: Path, vllm_log: list[logging.LogRecord]
) -> None:
    with thread_service(tmp_path) as svc:
        sched = make(SCHEDULER, service_url=svc.url)
        worker = make(WORKER, service_url=svc.url)
        flat = torch.zeros(2 * NUM_BLOCKS + 1, dtype=torch.bfloat16)  # no block dimension at all
        worker.register_kv_caches(dict.fromkeys(LAYERS, flat))
        (warning,) = _warnings(vllm_log)
        assert "worker" in warning and "cannot be copied" in warning and "(17,)" in warning
        reports = [_engine_report(worker, sched) for _ in range(2)]
        assert reports[0] is not None and (reports[0][ACTIVE_SIDES], reports[0][IDLE_SIDES]) == (1, 1)
        assert reports[1] is not None and reports[1][IDLE_SIDES] == 1 and ACTIVE_SIDES not in reports[1]
        assert _Prom().active_after(*reports) == 0
        engines = _engines(sched, worker)
    assert [(e["role"], e["active"]) for e in engines] == [("scheduler", True), ("worker", False)]
    assert "cannot be copied" in engines[1]["reason"] and "(17,)" in engines[1]["reason"]


# ------------------------------------------------------------------------------------ fail_when_idle
def test_fail_when_idle_stops_an_engine_kvtier_does_not_serve(make: Make) -> None:
    for role in (SCHEDULER, WORKER):
        with pytest.raises(KVTierIdle) as refused:
            make(role, state_space=True, fail_when_idle=True)
        message = str(refused.value)
        assert "this engine has a KV cache group of MambaSpec" in message
        assert "fail_when_idle" in message and "KVTIER_FAIL_WHEN_IDLE" in message


def test_fail_when_idle_stops_an_engine_whose_service_does_not_answer(make: Make, tmp_path: Path) -> None:
    with pytest.raises(KVTierIdle, match=r"cannot connect.*KVTIER_FAIL_WHEN_IDLE"):
        make(SCHEDULER, service_url=f"unix://{tmp_path}/none.sock", fail_when_idle=True)


def test_fail_when_idle_stops_a_worker_whose_kv_layout_is_refused(make: Make, tmp_path: Path) -> None:
    with thread_service(tmp_path) as svc:
        worker = make(WORKER, service_url=svc.url, fail_when_idle=True)
        flat = torch.zeros(2 * NUM_BLOCKS + 1, dtype=torch.bfloat16)
        with pytest.raises(KVTierIdle, match=r"cannot be copied.*\(17,\).*KVTIER_FAIL_WHEN_IDLE"):
            worker.register_kv_caches(dict.fromkeys(LAYERS, flat))


# ----------------------------------------------------------------------------------------- snapshot
def test_a_snapshot_says_what_a_serving_side_is_and_sums_its_reports(make: Make, tmp_path: Path) -> None:
    with thread_service(tmp_path) as svc:
        sched = make(SCHEDULER, service_url=svc.url)
        worker = make(WORKER, service_url=svc.url)
        worker.register_kv_caches(_kv_caches())
        assert sched.wait_connected(10) and worker.wait_connected(10)
        before = sched.snapshot()
        assert (before.side, before.serving, before.idle_reason, before.generation) == (
            "scheduler",
            True,
            "",
            "",
        )
        assert before.namespace and worker.snapshot().namespace == before.namespace
        assert before.totals == {}  # vLLM has taken no report yet
        report = sched.get_kv_connector_stats()
        assert report is not None and report.data[ACTIVE_SIDES] == 1
        counts = {k: v for k, v in report.data.items() if k not in STATE_KEYS}
        assert counts and sched.snapshot().totals == counts  # the state a report carries is no count
        assert sched.reset_cache() is True
        after = sched.snapshot()
        assert len(after.generation) == 16 and after.namespace != before.namespace
        assert before.generation == "" and before.totals == {}  # a snapshot is a copy


def test_a_snapshot_of_an_idle_side_says_why_and_counts_nothing(make: Make) -> None:
    sched = make(SCHEDULER, state_space=True)
    got = sched.snapshot()
    assert not got.serving and "this engine has a KV cache group of MambaSpec" in got.idle_reason
    assert (got.side, got.namespace, got.generation, got.totals) == ("scheduler", "", "", {})
    assert sched.wait_connected(0.01) is False  # no service to connect to
