"""Each tier's hit against its floor, in one engine with kvtier and vLLM's prefix cache both.

Per prompt, in turn (``bench/turns.py``): a kvtier hit from the tier (vLLM's cache reset, the tiers
above cleared), then vLLM's own prefix-cache hit of the same prompt with kvtier bypassed (the
ceiling: the KV the hit just loaded is in the engine, nothing is copied), then the tier's plain move
of the same bytes (``bench/floors.py``, ``bench/loopback.py``); floor = ceiling + move. Every tier's
hits are checked to have come from that tier alone.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvtier.bench.engine_proc import Sample, engine_clock, hook_ms, kvtier_bypassed, phase_ms, time_prompt
from kvtier.bench.floors import HIT_FLOOR_TARGETS, ColdCopy, FileRead, drop_cached, hit_floor, resident_bytes
from kvtier.bench.harness import generate
from kvtier.bench.hit_object import ObjectFloor, object_paths
from kvtier.bench.loopback import LoopbackFloor, redis_benchmark_get
from kvtier.bench.services import (
    check_hits,
    hit_tokens,
    off_the_model_core,
    wait_drained,
    wait_released,
    wait_stored,
)
from kvtier.bench.turns import median_time, take_turns
from kvtier.storage.base import Tier
from kvtier.storage.keys import DISK_SUFFIX
from kvtier.storage.tiers.disk_files import TEMP_PREFIX

RESET_TRIES = 50  # steps run to let vLLM free a finished request's blocks before its cache resets
SOCKET_SAMPLES = 21  # loopback moves of one value, for the comparison with redis-benchmark


def ttft_once(llm: Any, prompt: list[int]) -> float:
    """Seconds from submitting prompt alone to its first token."""
    return median_time(lambda: generate(llm, [prompt], 1), 1)


def reset_vllm_cache(llm: Any) -> None:
    """Empty vLLM's prefix cache. The blocks of a request whose saves kvtier still runs are freed
    once a step reports the saves done, so a step of a one-token prompt runs between tries."""
    for _ in range(RESET_TRIES):
        if llm.reset_prefix_cache():
            return
        generate(llm, [[5]], 1)  # with kvtier: its worker reports the finished saves
        time.sleep(0.01)  # the save thread's copy may still be running
    raise RuntimeError(f"vLLM did not reset its prefix cache in {RESET_TRIES} tries")


def chunk_files(root: Path) -> set[str]:
    """The disk tier's chunk files under root (no temp files of writes in flight)."""
    return {str(p) for p in root.rglob(f"*{DISK_SUFFIX}") if not p.name.startswith(TEMP_PREFIX)}


@dataclass
class HitBench:
    """An engine with kvtier and vLLM's prefix cache, its service's client, and the prompts it
    stored (with each prompt's chunk files on disk)."""

    llm: Any
    client: Any
    prompts: list[list[int]]
    files: list[list[str]]
    loaded_tokens: int  # tokens one full hit loads
    rounds: int = 3

    def hit(self, i: int, clear: Sequence[Tier] = (), before: Callable[[], None] | None = None) -> float:
        """Seconds of a kvtier hit of prompt i: vLLM's cache reset and the tiers in clear emptied
        first (leases ended, writes done), then before(), all untimed."""
        reset_vllm_cache(self.llm)
        if clear:
            wait_released(self.client)
            wait_drained(self.client)
            self.client.clear(list(clear)).result(30)
        if before is not None:
            before()
        return ttft_once(self.llm, self.prompts[i])

    def ceiling(self, i: int) -> float:
        """Seconds of vLLM's own hit of prompt i (its cache holds it: the hit before put it there)."""
        with kvtier_bypassed(self.llm):
            return ttft_once(self.llm, self.prompts[i])

    def tier(self, tier: str, hit: Callable[[int], float], move: Callable[[int], float]) -> dict[str, Any]:
        """hit, ceiling and move of every prompt in turn; hit / floor, the hits checked to be tier's."""
        before = hit_tokens(self.client)
        hits, ceilings, moves = take_turns([hit, self.ceiling, move], len(self.prompts), self.rounds)
        check_hits(self.client, before, tier.removesuffix("_cold"), self.loaded_tokens * len(hits))
        return hit_floor(hits, ceilings, moves, HIT_FLOOR_TARGETS[tier])


def store_prompts(
    llm: Any, client: Any, prompts: list[list[int]], disk: Path, chunks_each: int
) -> tuple[float, list[list[str]]]:
    """Run each prompt as a miss (kvtier stores it); the misses' median TTFT, and each prompt's
    chunk files, told apart by waiting for its chunks to be written before the next prompt."""
    seen = chunk_files(disk)
    misses, files = [], []
    for i, prompt in enumerate(prompts):
        misses.append(ttft_once(llm, prompt))
        wait_stored(client, (i + 1) * chunks_each)
        now = chunk_files(disk)
        new = sorted(now - seen)
        if len(new) != chunks_each:
            raise RuntimeError(f"prompt {i} left {len(new)} chunk files in {disk}, {chunks_each} expected")
        files.append(new)
        seen = now
    return statistics.median(misses), files


def cpu_and_disk(bench: HitBench, kv_bytes: int) -> dict[str, Any]:
    """The CPU, disk and cold-disk hits against their floors, and where a CPU hit's time goes."""
    cold = ColdCopy(kv_bytes)
    reads = [FileRead(paths) for paths in bench.files]
    floors = {"cpu": bench.tier("cpu", bench.hit, lambda _: cold.once())}
    # While the CPU tier still holds the prompts: disk hits are not promoted into it, so after the
    # disk figures every hit would be a disk hit.
    phases = hit_phases(bench)
    floors["disk"] = bench.tier("disk", lambda i: bench.hit(i, [Tier.CPU]), lambda i: reads[i].once())
    resident: list[int] = []

    def dropped(i: int) -> None:
        drop_cached(bench.files[i])
        resident.append(resident_bytes(bench.files[i]))

    def cold_read(i: int) -> float:
        dropped(i)
        return reads[i].once()

    floors["disk_cold"] = bench.tier(
        "disk_cold", lambda i: bench.hit(i, [Tier.CPU], lambda: dropped(i)), cold_read
    )
    return {
        "floors": floors,
        # 0 where dropping the page cache worked (a tmpfs disk_path keeps every byte cached).
        "disk_cold_resident_bytes_max": max(resident),
        "cold_memcpy_gbps": round(kv_bytes / (floors["cpu"]["move_ms"] / 1000) / 1e9, 2),
        "disk_read_bytes": reads[0].nbytes,
        **phases,
    }


def redis(bench: HitBench, redis_url: str) -> dict[str, Any]:
    """The Redis hits against their floor (the bytes over loopback TCP), and redis-benchmark's GET
    of one chunk's value size against the same socket moving that value."""
    sizes = [[Path(p).stat().st_size for p in paths] for paths in bench.files]
    value = max(max(s) for s in sizes)
    with LoopbackFloor(max(sum(s) for s in sizes), off_the_model_core()) as loopback:
        floor = bench.tier(
            "redis", lambda i: bench.hit(i, [Tier.CPU, Tier.DISK]), lambda i: loopback.move(sizes[i])
        )
        socket_ms = 1000 * statistics.median(loopback.move([value]) for _ in range(SOCKET_SAMPLES))
    port = urlsplit(redis_url).port
    assert port is not None, redis_url
    compared = redis_benchmark_get(port, value, preexec_fn=off_the_model_core())
    if compared is not None:
        compared["socket_ms_per_value"] = round(socket_ms, 3)
        compared["socket_gbps"] = round(value / socket_ms / 1e6, 2)
    return {"floor": floor, "redis_benchmark": compared}


def object_tier(bench: HitBench, url: str, endpoint: str, above: Sequence[Tier]) -> dict[str, Any]:
    """The object tier's hits (the tiers above cleared) against their floor: the same objects
    fetched with obstore's plain GETs, all at once, from a process off the model's core."""
    paths = [object_paths(files) for files in bench.files]
    with ObjectFloor(url, endpoint, off_the_model_core()) as floor:
        return bench.tier("object", lambda i: bench.hit(i, above), lambda i: floor.move(paths[i]))


def hit_phases(bench: HitBench) -> dict[str, Any]:
    """Where a CPU hit's time goes, a disk hit's (page cache warm) and their ceiling's, split as the
    misses' are (phase_ms,
    hook_ms): samples of their own, taken in turn after the figures', since timing every connector
    hook costs a little."""
    clock = engine_clock(bench.llm, kvtier=True)
    hits: list[Sample] = []
    ceilings: list[Sample] = []
    disk_hits: list[Sample] = []
    try:
        for _ in range(bench.rounds):
            for prompt in bench.prompts:
                reset_vllm_cache(bench.llm)
                hits.append(time_prompt(bench.llm, clock, prompt))
                ceilings.append(time_prompt(bench.llm, clock, prompt, bypass=True))
        # Last: a disk hit leaves the CPU tier empty (it is read from disk, not promoted).
        for _ in range(bench.rounds):
            for prompt in bench.prompts:
                reset_vllm_cache(bench.llm)
                wait_released(bench.client)
                wait_drained(bench.client)
                bench.client.clear([Tier.CPU]).result(30)
                disk_hits.append(time_prompt(bench.llm, clock, prompt))
    finally:
        clock.restore()
    return {
        "ttft_ms_by_phase": {
            "cpu_hit": phase_ms(hits),
            "disk_hit": phase_ms(disk_hits),
            "ceiling": phase_ms(ceilings),
        },
        "cpu_hit_kvtier_by_hook": hook_ms(hits),
        "disk_hit_kvtier_by_hook": hook_ms(disk_hits),
    }
