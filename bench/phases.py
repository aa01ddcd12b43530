"""Where an engine's time goes: one of vLLM's own calls (the model's forward, the scheduler's
``schedule()``), and kvtier's connector hooks.

``PhaseClock`` times one vLLM method (the span) and every connector method vLLM calls, by wrapping
them on their objects. Hooks that run inside the span (the per-layer hooks inside the forward, the
scheduler hooks inside ``schedule()``) count as kvtier's time and are taken out of the span's, so
the two phases never overlap.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
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

    span: float  # the timed vLLM call, the hooks it ran left out
    calls: int = 0  # how many times the span ran
    by_hook: dict[str, float] = field(default_factory=dict)  # each timed connector hook's seconds

    @property
    def hooks(self) -> float:
        """Every timed connector hook's seconds, inside the span or not."""
        return sum(self.by_hook.values())


class PhaseClock:
    """Times one vLLM call and the connector hooks of one engine; ``take()`` reads and resets."""

    def __init__(self) -> None:
        self._span = 0.0
        self._calls = 0
        self._hooks: dict[str, float] = {}
        self._hooks_in_span = 0.0
        self._in_span = False
        self._wrapped: list[tuple[Any, str]] = []

    def time_span(self, obj: Any, name: str) -> None:
        """Count obj.name (the model's forward, or schedule()) as the span."""
        inner = getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._in_span = True
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._span += time.perf_counter() - start
                self._calls += 1
                self._in_span = False

        self._wrap(obj, name, timed)

    def time_hooks(self, connector: Any, names: Iterable[str]) -> None:
        """Count these methods of connector, those it has, as kvtier's phase."""
        for name in names:
            if hasattr(connector, name):
                self._hooks.setdefault(name, 0.0)
                self._wrap(connector, name, self._hook(name, getattr(connector, name)))

    def _hook(self, name: str, inner: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                self._hooks[name] += spent
                if self._in_span:
                    self._hooks_in_span += spent

        return timed

    def _wrap(self, obj: Any, name: str, fn: Callable[..., Any]) -> None:
        setattr(obj, name, fn)  # an instance attribute shadows the method; restore() deletes it
        self._wrapped.append((obj, name))

    def take(self) -> Phases:
        """The phases' seconds since the last take(), and start counting afresh."""
        phases = Phases(self._span - self._hooks_in_span, self._calls, dict(self._hooks))
        self._span = self._hooks_in_span = 0.0
        self._calls = 0
        self._hooks = dict.fromkeys(self._hooks, 0.0)
        return phases

    def restore(self) -> None:
        """Put every timed method back."""
        while self._wrapped:
            obj, name = self._wrapped.pop()
            delattr(obj, name)
