"""Where a prompt's time goes inside an in-process engine: the model's forward, and kvtier's own code.

``PhaseClock`` times the model runner's forward and every connector method vLLM calls, scheduler
side and worker side, by wrapping them on their objects. The per-layer hooks (``wait_for_layer_load``,
``save_kv_layer``) run inside the forward: their time counts as kvtier's and is taken out of the
forward's, so the two phases never overlap. What a prompt took besides both is vLLM's own work
outside the forward (scheduling, sampling, outputs).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

# Every connector method vLLM calls on its scheduler thread while serving.
SCHEDULER_HOOKS = (
    "on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc",
    "get_external_cache_hit_sources", "build_connector_meta", "request_finished",
    "update_connector_output", "get_kv_connector_stats",
)  # fmt: skip
# Every connector method vLLM's model runner calls on the worker side.
WORKER_HOOKS = (
    "bind_connector_metadata", "handle_preemptions", "start_load_kv", "wait_for_layer_load",
    "save_kv_layer", "wait_for_save", "get_finished", "get_block_ids_with_load_errors",
    "get_kv_connector_stats", "clear_connector_metadata",
)  # fmt: skip


@dataclass(frozen=True)
class Phases:
    """Seconds spent in each phase since the clock was last read."""

    forward: float  # the model's forward, kvtier's per-layer hooks left out
    kvtier: float  # every connector method, scheduler and worker side


class PhaseClock:
    """Times the forward and the connector hooks of one engine; ``take()`` reads and resets."""

    def __init__(self) -> None:
        self._forward = 0.0
        self._kvtier = 0.0
        self._kvtier_in_forward = 0.0
        self._in_forward = False
        self._wrapped: list[tuple[Any, str]] = []

    def time_forward(self, runner: Any, name: str = "_model_forward") -> None:
        """Count runner.name (the model's forward) as the forward phase."""
        inner = getattr(runner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._in_forward = True
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._forward += time.perf_counter() - start
                self._in_forward = False

        self._wrap(runner, name, timed)

    def time_hooks(self, connector: Any, names: Iterable[str]) -> None:
        """Count these methods of connector, those it has, as kvtier's phase."""
        for name in names:
            if hasattr(connector, name):
                self._wrap(connector, name, self._hook(getattr(connector, name)))

    def _hook(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                self._kvtier += spent
                if self._in_forward:
                    self._kvtier_in_forward += spent

        return timed

    def _wrap(self, obj: Any, name: str, fn: Callable[..., Any]) -> None:
        setattr(obj, name, fn)  # an instance attribute shadows the method; restore() deletes it
        self._wrapped.append((obj, name))

    def take(self) -> Phases:
        """The phases' seconds since the last take(), and start counting afresh."""
        phases = Phases(self._forward - self._kvtier_in_forward, self._kvtier)
        self._forward = self._kvtier = self._kvtier_in_forward = 0.0
        return phases

    def restore(self) -> None:
        """Put every timed method back."""
        while self._wrapped:
            obj, name = self._wrapped.pop()
            delattr(obj, name)


def model_runner(llm: Any) -> Any:
    """The model runner of an LLM whose engine core and worker run in this process."""
    executor = llm.llm_engine.engine_core.engine_core.model_executor
    worker = getattr(executor, "driver_worker", None)
    worker = getattr(worker, "worker", worker)  # a WorkerWrapperBase holds the worker
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        raise RuntimeError(f"no model runner found under {type(executor).__name__}.driver_worker")
    return runner
