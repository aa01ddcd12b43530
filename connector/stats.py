"""Connector counters and state, reported through vLLM's KV-connector stats (scheduler and workers).

Counted per admission from fresh values, never decremented: no counter can go negative. Each side
also says whether it serves (``SideState``): vLLM sums the reports of the scheduler and every worker,
so the state travels as counts of sides too, and ``reported_state`` reads it back from a sum.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.app.embedded import RespawnCounts
from kvtier.storage.base import Tier


class _Counts:
    """A dataclass of plain numbers whose counts are handed out and zeroed in one step."""

    def take(self) -> dict[str, Any]:
        """The counts so far, then zero them."""
        # Swapping the instance dict for a copy of an all-zero one: vLLM asks every step, and
        # dataclasses.asdict costs tens of microseconds of the scheduler's time for a dozen ints.
        data = self.__dict__
        zero = _ZEROS.get(type(self))
        if zero is None:  # a fresh instance's fields: every count at its zero default
            zero = _ZEROS[type(self)] = dict(vars(type(self)()))
        self.__dict__ = zero.copy()
        return data


_ZEROS: dict[type[_Counts], dict[str, Any]] = {}  # each counter class's fields, all zero


@dataclass
class SchedulerCounters(_Counts):
    """Scheduler-side counts since the last report."""

    admissions: int = 0
    readmissions: int = 0
    admissions_with_hit: int = 0
    external_tokens: int = 0
    hit_tokens_cpu: int = 0
    hit_tokens_disk: int = 0
    hit_tokens_redis: int = 0
    hit_tokens_object: int = 0
    lookups_deferred: int = 0
    lookup_errors: int = 0
    lookup_count: int = 0
    lookup_seconds: float = 0.0
    preemptions: int = 0
    unsaved_chunks: int = 0  # due for saving, but a sliding window's blocks they hold were freed

    def count_admission(self, request: Any, num_external_tokens: int) -> None:
        """One admission of a request (a re-admission after preemption counts as such)."""
        self.admissions += 1
        if getattr(request, "num_preemptions", 0) > 0:
            self.readmissions += 1
        if num_external_tokens > 0:
            self.admissions_with_hit += 1
            self.external_tokens += num_external_tokens

    def count_hits(self, sources: dict[Tier, int]) -> None:
        """Hit tokens of one admission by tier."""
        for tier, tokens in sources.items():
            name = f"hit_tokens_{tier.label}"
            setattr(self, name, getattr(self, name) + max(0, tokens))

    def observe_lookup_latency(self, seconds: float) -> None:
        """One answered lookup's round trip."""
        self.lookup_count += 1
        self.lookup_seconds += max(0.0, seconds)


@dataclass
class WorkerCounters(_Counts):
    """Worker-side counts since the last report."""

    loaded_tokens: int = 0
    loaded_chunks: int = 0
    failed_load_chunks: int = 0
    failed_load_blocks: int = 0
    saved_tokens: int = 0
    saved_chunks: int = 0
    save_skipped_chunks: int = 0
    save_errors: int = 0
    unwaited_layer_loads: int = 0  # steps whose forward skipped a wait_for_layer_load
    full_graph_loads: int = 0  # steps whose loads a full CUDA graph replay waited for as a whole
    load_seconds: float = 0.0
    save_seconds: float = 0.0
    disk_read_chunks: int = 0  # disk hits this worker read from their files itself (file channel)
    disk_read_fallbacks: int = 0  # loads that found a file gone or the channel down: staged instead
    window_fences: int = 0  # steps that waited for saves still reading sliding-window blocks vLLM reused


def merge_counts(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Sum two count dicts key by key (a itself, not a copy, when b adds nothing to it)."""
    if not any(b.values()) and a.keys() >= b.keys():
        return a  # most steps count nothing: vLLM asks for stats every step
    out = dict(a)
    for key, value in b.items():
        out[key] = out.get(key, 0) + value
    return out


IDLE_SIDES = "idle_sides"  # in every report of an idle side, so an idle engine's report is never empty
ACTIVE_SIDES = "active_sides"  # in a side's first report after it began to serve, once
# A CUDA worker's arena: in every report while its pinning failed (copies run from pageable memory,
# slower), and in the first report once it is pinned.
UNPINNED_ARENAS = "unpinned_arenas"
PINNED_ARENAS = "pinned_arenas"
STATE_KEYS = (IDLE_SIDES, ACTIVE_SIDES, UNPINNED_ARENAS, PINNED_ARENAS)


class SideState:
    """Whether one side (the scheduler or a worker) serves, as its next stats report says it."""

    def __init__(self) -> None:
        self.serving: bool | None = None  # as the last report said; None before the first report

    def stamp(self, data: dict[str, Any], serving: bool) -> None:
        """Add the side's state to a report: idle in every one, serving only when it just began."""
        if not serving:
            data[IDLE_SIDES] = 1
        elif self.serving is not True:
            data[ACTIVE_SIDES] = 1
        self.serving = serving


class PinState:
    """Whether a CUDA worker's arena is pinned for DMA, as its next stats report says it."""

    def __init__(self) -> None:
        self.pinned: bool | None = None  # as the last report said

    def stamp(self, data: dict[str, Any], pinned: bool | None) -> None:
        """Add the arena's state (None: no CUDA arena whose pinning ended) to a report: unpinned in
        every one, pinned only when it just became so."""
        if pinned is False:
            data[UNPINNED_ARENAS] = 1
        elif pinned and self.pinned is not True:
            data[PINNED_ARENAS] = 1
        if pinned is not None:
            self.pinned = pinned


def reported_pinning(data: Mapping[str, Any]) -> bool | None:
    """What a report summed over workers says of their arenas: False when one serves unpinned, True
    when one became pinned and none is unpinned, None when it carries no such state."""
    if data.get(UNPINNED_ARENAS, 0) > 0:
        return False
    if data.get(PINNED_ARENAS, 0) > 0:
        return True
    return None


def reported_state(data: Mapping[str, Any]) -> bool | None:
    """What a report summed over sides says: False when a side is idle, True when a side began to
    serve and none is idle, None when it carries no state (the state is unchanged)."""
    if data.get(IDLE_SIDES, 0) > 0:
        return False
    if data.get(ACTIVE_SIDES, 0) > 0:
        return True
    return None


class RespawnReport:
    """The embedded service's restarts by this process since its last report (RespawnCounts holds
    the totals, which the client's respawner thread counts)."""

    def __init__(self, counts: RespawnCounts) -> None:
        self.counts = counts
        self._told = (0, 0)

    def stamp(self, data: dict[str, Any]) -> None:
        """Add the restarts and failed restarts not reported yet to a report."""
        now = (self.counts.started, self.counts.failed)
        started, failed = now[0] - self._told[0], now[1] - self._told[1]
        if started:
            data["service_respawns"] = started
        if failed:
            data["service_respawn_failures"] = failed
        self._told = now
