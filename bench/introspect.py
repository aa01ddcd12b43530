"""Reach the kvtier connectors and model runner of an engine running in this process.

The connectors are read through their public API (``KVTierConnector.snapshot()``), never their sides.
"""

from __future__ import annotations

from typing import Any


def scheduler_connector(llm: Any) -> Any:
    """The scheduler-side KVTierConnector of an LLM running in this process."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def worker_connector() -> Any:
    """The worker-side KVTierConnector of the engine running in this process."""
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

    return get_kv_transfer_group()


def scheduler_totals(llm: Any) -> dict[str, Any]:
    """Scheduler-side counters accumulated since the engine started (as vLLM's stats reported them)."""
    return scheduler_connector(llm).snapshot().totals


def worker_totals() -> dict[str, Any]:
    """Worker-side counters accumulated since the engine started (as vLLM's stats reported them)."""
    return worker_connector().snapshot().totals


def model_runner(llm: Any) -> Any:
    """The model runner of an LLM whose engine core and worker run in this process."""
    executor = llm.llm_engine.engine_core.engine_core.model_executor
    worker = getattr(executor, "driver_worker", None)
    worker = getattr(worker, "worker", worker)  # a WorkerWrapperBase holds the worker
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        raise RuntimeError(f"no model runner found under {type(executor).__name__}.driver_worker")
    return runner
