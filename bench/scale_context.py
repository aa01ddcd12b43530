"""`kvtier bench scale context`: a hit against its floor as the context grows.

One engine with kvtier and vLLM's prefix cache, the LONG model (``bench/models.py``: a served
family's KV per token per layer, two thin layers) and one prompt per context length. Each tier's hit
is timed against its floor exactly as `kvtier bench connector` does (``bench/hit_floors.py``):
vLLM's own prefix-cache hit of the prompt plus the tier's plain move of the same bytes. The lengths
take turns sample by sample (``bench/turns.py``), so a change in the machine's load reaches every
length alike and the curve's slope stays fair. Tiers run one after the other (a disk hit leaves the
CPU tier empty, a Redis hit the disk tier): CPU, then disk (page cache warm), then Redis.
"""

from __future__ import annotations

import math
import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvtier.bench import hit_floors
from kvtier.bench.engine_proc import Sample, engine_clock, hook_ms, phase_ms, time_prompt
from kvtier.bench.floors import HIT_FLOOR_TARGETS, ColdCopy, FileRead, hit_floor
from kvtier.bench.harness import kv_transfer_config, make_prompt, running_engine
from kvtier.bench.loopback import LoopbackFloor
from kvtier.bench.models import LONG, build_model
from kvtier.bench.progress import note
from kvtier.bench.services import (
    check_hits,
    hit_tokens,
    kvtier_service,
    off_the_model_core,
    redis_server,
    wait_stored,
)
from kvtier.bench.turns import take_turns
from kvtier.storage.base import Tier

# Tokens of each prompt's stored prefix. 128k is left out: its miss alone takes this 2-core machine
# about 6 minutes, and its 1 GiB of KV fills the benchmark service's CPU tier (services.ARENA_BYTES).
CONTEXTS = (1024, 4096, 16384, 32768, 65536)
QUICK_CONTEXTS = (1024, 2048)
CHUNK = 256  # chunk_size of the engine, in tokens, as `kvtier bench connector`'s
ROUNDS = 5  # samples of each length per run, taken in turn
SEED = 77_000
# The CPU floor's pools: bigger than the CPU's caches, so each copy is cold.
COLD_POOL_BYTES = 256 << 20


class ServiceCpu:
    """CPU seconds the service process serving url has run, from the scheduler's per-thread clocks
    (``/proc/<pid>/task/*/schedstat``, in ns: the 10 ms ticks of ``/proc/<pid>/stat`` are too coarse
    for a 1k-token hit). The service's threads live as long as it does, so none drops out."""

    def __init__(self, url: str) -> None:
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                args = cmdline.read_bytes().split(b"\0")
            except OSError:  # a process that ended meanwhile
                continue
            if b"kvtier.app.server" in args and url.encode() in args:
                self._tasks = cmdline.parent / "task"
                return
        raise RuntimeError(f"no kvtier.app.server process serves {url}")

    def seconds(self) -> float:
        """CPU seconds so far, every thread's."""
        total = 0
        for stat in self._tasks.glob("*/schedstat"):
            try:
                total += int(stat.read_text().split()[0])
            except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
                continue
        return total / 1e9


def loaded_tokens(context: int) -> int:
    """Tokens a full hit of a prompt of context + 1 tokens loads (Invariant 3)."""
    from kvtier.connector.planning import Geometry, external_tokens

    return external_tokens(context // CHUNK, 0, context + 1, Geometry(32, CHUNK))


def store_each(
    llm: Any, client: Any, prompts: Sequence[list[int]], disk: Path, cpu: ServiceCpu
) -> tuple[list[float], list[float], list[list[str]]]:
    """Run each prompt as a miss (kvtier stores it): each miss's TTFT, the service's CPU seconds
    for it (lookup, commit, writes behind) and each prompt's chunk files, told apart by waiting for
    its chunks to be written before the next prompt."""
    seen = hit_floors.chunk_files(disk)
    misses, spent, files, stored = [], [], [], 0
    for i, prompt in enumerate(prompts):
        start = cpu.seconds()
        misses.append(hit_floors.ttft_once(llm, prompt))
        stored += len(prompt) // CHUNK
        wait_stored(client, stored)
        spent.append(cpu.seconds() - start)
        now = hit_floors.chunk_files(disk)
        new = sorted(now - seen)
        if len(new) != len(prompt) // CHUNK:
            raise RuntimeError(
                f"prompt {i} left {len(new)} chunk files in {disk}, {len(prompt) // CHUNK} expected"
            )
        files.append(new)
        seen = now
    return misses, spent, files


def tier_runs(
    bench: hit_floors.HitBench,
    tier: str,
    hit: Callable[[int], float],
    move: Callable[[int], float],
    repeats: int,
    cpu: ServiceCpu,
) -> list[list[dict[str, Any]]]:
    """repeats runs of hit, ceiling and move of every length in turn; result[r][i] is run r's
    hit_floor of length i, with the service's CPU seconds over its hits (the tiers above cleared
    included). Each run's hits are checked to be exactly the tier's, every token."""
    return [_one_run(bench, tier, hit, move, cpu) for _ in range(repeats)]


def _one_run(
    bench: hit_floors.HitBench,
    tier: str,
    hit: Callable[[int], float],
    move: Callable[[int], float],
    cpu: ServiceCpu,
) -> list[dict[str, Any]]:
    """One run of tier_runs."""
    count = len(bench.prompts)
    spent = [0.0] * count

    def counted(i: int) -> float:
        start = cpu.seconds()
        took = hit(i)
        spent[i] += cpu.seconds() - start
        return took

    before = hit_tokens(bench.client)
    hits, ceilings, moves = take_turns([counted, bench.ceiling, move], count, bench.rounds)
    check_hits(bench.client, before, tier, bench.loaded_tokens * bench.rounds)
    target = HIT_FLOOR_TARGETS[tier]
    return [
        {**hit_floor(hits[i::count], ceilings[i::count], moves[i::count], target), "service_cpu_s": spent[i]}
        for i in range(count)
    ]


def _median_spread(values: Sequence[float]) -> dict[str, Any]:
    return {
        "median": round(statistics.median(values), 3),
        "runs": list(values),
        "spread": [min(values), max(values)],
    }


def tier_figures(runs: list[list[dict[str, Any]]], contexts: Sequence[int], rounds: int) -> dict[str, Any]:
    """A tier's figures by length: hit / floor and its parts, medians over runs with every run's;
    kvtier's time over the floor per chunk moved."""
    out: dict[str, Any] = {}
    for i, context in enumerate(contexts):
        per_run = [run[i] for run in runs]
        fig = {key: _median_spread([f[key] for f in per_run]) for key in ("ratio", "hit_ms", "floor_ms")}
        fig.update(
            {key: round(statistics.median(f[key] for f in per_run), 2) for key in ("ceiling_ms", "move_ms")}
        )
        over = fig["hit_ms"]["median"] - fig["floor_ms"]["median"]
        fig["over_floor_us_per_chunk"] = round(1000 * over / (context // CHUNK), 1)
        spent = sum(f["service_cpu_s"] for f in per_run) / (len(per_run) * rounds * (context // CHUNK))
        fig["service_cpu_us_per_chunk"] = round(1e6 * spent, 1)
        out[str(context)] = fig
    return out


def fit_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys against xs (0 with fewer than two points)."""
    if len(xs) < 2:
        return 0.0
    mx, my = statistics.mean(xs), statistics.mean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def slopes(contexts: Sequence[int], by_tokens: dict[str, Any]) -> dict[str, float | None]:
    """A tier's curve in two slopes: hit / floor per doubling of the context (0: flat), and the
    medians' ms per 1k more tokens of the hit and of its floor, whose ratio is what hit / floor
    tends to as the context grows (each tier's fixed costs left behind)."""
    figs = [by_tokens[str(n)] for n in contexts]
    per_doubling = fit_slope([math.log2(n) for n in contexts], [f["ratio"]["median"] for f in figs])
    hit = 1000 * fit_slope(contexts, [f["hit_ms"]["median"] for f in figs])
    floor = 1000 * fit_slope(contexts, [f["floor_ms"]["median"] for f in figs])
    return {
        "ratio_per_doubling": round(per_doubling, 4),
        "hit_ms_per_1k_tokens": round(hit, 3),
        "floor_ms_per_1k_tokens": round(floor, 3),
        "hit_slope_over_floor_slope": round(hit / floor, 3) if floor > 0 else None,
    }


def hook_profile(bench: hit_floors.HitBench, contexts: Sequence[int]) -> dict[str, Any]:
    """Where a CPU hit's time goes at each length: the model's forward, kvtier's connector hooks
    (each hook's median ms) and vLLM's rest, from samples of their own taken in turn."""
    clock = engine_clock(bench.llm, kvtier=True)
    taken: list[list[Sample]] = [[] for _ in contexts]
    try:
        for _ in range(bench.rounds):
            for i, prompt in enumerate(bench.prompts):
                hit_floors.reset_vllm_cache(bench.llm)
                taken[i].append(time_prompt(bench.llm, clock, prompt))
    finally:
        clock.restore()
    out = {}
    for context, samples in zip(contexts, taken, strict=True):
        phases = phase_ms(samples)
        out[str(context)] = {
            "ttft_ms_by_phase": phases,
            "kvtier_us_per_chunk": round(1000 * phases["kvtier"] / (context // CHUNK), 2),
            "kvtier_ms_by_hook": hook_ms(samples),
        }
    return out


def _engine(contexts: Sequence[int]) -> dict[str, Any]:
    """Engine arguments: the longest prompt and its first token fit, its KV twice over."""
    longest = max(contexts) + CHUNK
    kv_bytes = max(256 << 20, 2 * longest * LONG.kv_bytes_per_token)
    return dict(enable_prefix_caching=True, max_model_len=longest, kv_cache_memory_bytes=kv_bytes)


def measure(contexts: Sequence[int], repeats: int, rounds: int = ROUNDS) -> dict[str, Any]:
    """Each tier's hit / floor at each context length (medians of repeats runs of rounds samples
    each), the slope of the curve, the misses' TTFT and where a CPU hit's time goes."""
    from kvtier.app.client import ServiceClient

    contexts = sorted(contexts)
    prompts = [make_prompt(SEED + i, n + 1) for i, n in enumerate(contexts)]
    sizes = [loaded_tokens(n) * LONG.kv_bytes_per_token for n in contexts]
    with tempfile.TemporaryDirectory(prefix="kvtier-scale-context-") as name:
        tmp = Path(name)
        model = str(build_model(tmp / "long", LONG))
        with redis_server(tmp) as redis_url:
            settings: dict[str, Any] = {"disk_path": tmp / "disk"}
            if redis_url:
                settings["redis_url"] = redis_url
            with kvtier_service(tmp / "svc", **settings) as url, ServiceClient(url) as client:
                client.wait_connected(10)
                kv = kv_transfer_config(service_url=url, chunk_size=CHUNK)
                lengths = ", ".join(map(str, contexts))
                note(f"  scale context: an engine for prompts of {lengths} tokens starting")
                with running_engine(model, kv, **_engine(contexts)) as llm:
                    hit_floors.reset_vllm_cache(llm)
                    cpu = ServiceCpu(url)
                    misses, spent, files = store_each(llm, client, prompts, tmp / "disk", cpu)
                    loaded = sum(loaded_tokens(n) for n in contexts)
                    bench = hit_floors.HitBench(llm, client, prompts, files, loaded, rounds)
                    runs, hooks = _tiers(bench, sizes, redis_url, repeats, contexts, cpu)
    tiers = {tier: tier_figures(r, contexts, rounds) for tier, r in runs.items()}
    ratios = {tier: {n: fig["ratio"]["median"] for n, fig in by.items()} for tier, by in tiers.items()}
    return {
        "contexts": list(contexts),
        "chunk_size": CHUNK,
        "model": asdict(LONG),
        "kv_bytes_per_token": LONG.kv_bytes_per_token,
        "repeats": repeats,
        "rounds": rounds,
        "miss_ttft_ms": {str(n): round(1000 * s, 1) for n, s in zip(contexts, misses, strict=True)},
        # The service's CPU for each miss: its lookup, the commits, the disk and Redis writes behind.
        "miss_service_cpu_us_per_chunk": {
            str(n): round(1e6 * s / (n // CHUNK), 1) for n, s in zip(contexts, spent, strict=True)
        },
        "tiers": tiers,
        "hit_floor_ratio": ratios,
        "longest_over_first": {
            tier: round(by[str(contexts[-1])] / by[str(contexts[0])], 3) for tier, by in ratios.items()
        },
        "slopes": {tier: slopes(contexts, by) for tier, by in tiers.items()},
        "cpu_hit_by_phase": hooks,
    }


def _tiers(
    bench: hit_floors.HitBench,
    sizes: Sequence[int],
    redis_url: str | None,
    repeats: int,
    contexts: Sequence[int],
    cpu: ServiceCpu,
) -> tuple[dict[str, list[list[dict[str, Any]]]], dict[str, Any]]:
    """The CPU, disk and (with a Redis) Redis runs, in that order, and the CPU hits' phases."""
    runs: dict[str, list[list[dict[str, Any]]]] = {}
    note("  scale context: CPU hits")
    cold = [ColdCopy(n, max(COLD_POOL_BYTES, 2 * n)) for n in sizes]
    runs["cpu"] = tier_runs(bench, "cpu", bench.hit, lambda i: cold[i].once(), repeats, cpu)
    cold.clear()  # the pools' memory goes back before the next tiers
    hooks = hook_profile(bench, contexts)  # while the CPU tier still holds the prompts
    note("  scale context: disk hits")
    reads = [FileRead(paths) for paths in bench.files]
    runs["disk"] = tier_runs(
        bench, "disk", lambda i: bench.hit(i, [Tier.CPU]), lambda i: reads[i].once(), repeats, cpu
    )
    if redis_url:
        note("  scale context: Redis hits")
        chunk_sizes = [[Path(p).stat().st_size for p in paths] for paths in bench.files]
        with LoopbackFloor(max(sum(s) for s in chunk_sizes), off_the_model_core()) as loopback:
            runs["redis"] = tier_runs(
                bench, "redis", lambda i: bench.hit(i, [Tier.CPU, Tier.DISK]),
                lambda i: loopback.move(chunk_sizes[i]), repeats, cpu,
            )  # fmt: skip
    return runs, hooks
