"""Part (c) of `kvtier bench connector`: time to first token of a long prompt.

A miss with kvtier against no kvtier, on pairs of engines in processes of their own; then, in one
engine with kvtier and vLLM's prefix cache, hits from each tier against their floors
(``bench/hit_floors.py``). docs/performance.md ("Connector benchmark") says what each figure means.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench import hit_floors
from kvtier.bench.bootstrap import pair_bootstrap_interval, pooled_median_ratio
from kvtier.bench.engine_proc import EngineProcess, Sample, hook_ms, kvtier_bypassed, phase_ms
from kvtier.bench.harness import generate_each, kv_transfer_config, make_prompt, running_engine
from kvtier.bench.hit_object import wait_uploaded
from kvtier.bench.models import BENCH
from kvtier.bench.progress import note
from kvtier.bench.seaweed import bench_credentials, seaweed_server
from kvtier.bench.services import kvtier_service, off_the_model_core, redis_server, wait_stored
from kvtier.storage.base import Tier

TTFT_CHUNK = 256  # chunk_size of the TTFT benchmarks' engines, in tokens


def warm_up_prompts(engine: dict[str, Any], prompt_tokens: int) -> int:
    """How many fresh prompts of prompt_tokens an engine runs, untimed, before it is timed: enough
    to use each of its KV blocks once.

    vLLM hands out free blocks oldest-freed first, so a fresh engine's prompts go to blocks it never
    touched until the whole KV cache was used once, and those first prompts run slower and erratically.
    """
    return int(engine["kv_cache_memory_bytes"]) // (prompt_tokens * BENCH.kv_bytes_per_token) + 1


# The miss figure: pairs of engines in processes of their own, one with kvtier and one without, up
# side by side and sampled in turn (bench/engine_proc.py). Each engine start has a speed of its own,
# so the ratio pools several pairs, and which engine starts first alternates so the order cannot
# lean it either way (docs/performance.md has the spreads that set these numbers).
MISS_PAIRS = 8
MISS_SAMPLES = 9  # per case and pair
MISS_CASES = ("off", "miss", "bypassed")


def _kvtier_first(pair: int) -> bool:
    """Whether the engine with kvtier starts first in this pair (every second pair)."""
    return pair % 2 == 1


def bench_miss(model: str, tmp: Path, engine: dict[str, Any], prompt_tokens: int) -> dict[str, Any]:
    """TTFT of fresh prompts without kvtier, with kvtier (a miss: looked up, computed, saved) and
    with kvtier bypassed, on engines side by side; every sample starts once the previous one's
    background work (the save copy, the service's disk writes) is done, whatever its case."""
    from kvtier.runtime.affinity import engine_cpus

    cpus = engine_cpus()  # not the one core an in-process engine may have bound this thread to
    seeds = iter(range(20_000, 1_000_000))
    taken: dict[str, list[list[Sample]]] = {case: [] for case in MISS_CASES}
    for pair in range(MISS_PAIRS):
        got = _miss_pair(model, tmp, engine, prompt_tokens, pair, cpus, seeds)
        for case in MISS_CASES:
            taken[case].append(got[case])
    return _miss_figures(taken)


def _miss_pair(
    model: str, tmp: Path, engine: dict[str, Any], prompt_tokens: int, pair: int, cpus: frozenset[int],
    seeds: Iterator[int],
) -> dict[str, list[Sample]]:  # fmt: skip
    """One pair of engines, with and without kvtier: MISS_SAMPLES samples of each case."""
    from kvtier.app.client import ServiceClient

    note(f"  TTFT miss: engine pair {pair + 1}/{MISS_PAIRS} (with and without kvtier) starting")
    # The tiers a user gets by default: CPU + disk, as embedded mode runs them.
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(
            kvtier_service(tmp / f"default-{pair}", disk_path=tmp / f"disk-default-{pair}")
        )
        client = stack.enter_context(ServiceClient(url))
        # Which engine starts first alternates (see MISS_PAIRS).
        configs = {"off": None, "on": kv_transfer_config(service_url=url, chunk_size=TTFT_CHUNK)}
        order = ("on", "off") if _kvtier_first(pair) else ("off", "on")
        procs = {
            name: stack.enter_context(EngineProcess(model, configs[name], engine, cpus)) for name in order
        }
        off, on = procs["off"], procs["on"]
        off.wait_ready()
        on.wait_ready()
        for _ in range(warm_up_prompts(engine, prompt_tokens)):
            # kvtier bypassed: the engine warms up, and no tier fills with unmeasured chunks
            # (so no prompt leaves background work behind: no wait needed in between).
            for engine_proc, bypass in ((off, False), (on, True)):
                engine_proc.ttft(make_prompt(next(seeds), prompt_tokens), bypass)
        runs = [("off", off, False), ("miss", on, False), ("bypassed", on, True)]
        got: dict[str, list[Sample]] = {case: [] for case in MISS_CASES}
        for i in range(MISS_SAMPLES):
            # Each case goes first in turn, so none always follows the same other.
            for case, engine_proc, bypass in runs[i % 3 :] + runs[: i % 3]:
                # The last miss's save (copy, commit, disk writes) has ended: none runs under
                # the next sample, whatever its case.
                wait_stored(client, len(got["miss"]) * (prompt_tokens // TTFT_CHUNK))
                got[case].append(engine_proc.sample(make_prompt(next(seeds), prompt_tokens), bypass))
    return got


def _miss_figures(taken: dict[str, list[list[Sample]]]) -> dict[str, Any]:
    """bench_miss's figures from each case's samples, one list per pair."""

    def pooled(case: str, phase: str = "ttft") -> float:
        return statistics.median(getattr(s, phase) for samples in taken[case] for s in samples)

    def per_pair(case: str) -> list[float]:
        return [statistics.median(s.ttft for s in samples) for samples in taken[case]]

    ratios = [m / o for m, o in zip(per_pair("miss"), per_pair("off"), strict=True)]
    forward_ratios = [
        statistics.median(m.forward for m in ms) / statistics.median(o.forward for o in os_)
        for ms, os_ in zip(taken["miss"], taken["off"], strict=True)
    ]
    # How far the two ratios could move with other engines (see bench/bootstrap.py).
    ttfts = {case: [[s.ttft for s in samples] for samples in taken[case]] for case in MISS_CASES}
    orders = [_kvtier_first(pair) for pair in range(MISS_PAIRS)]
    miss_low, miss_high = pair_bootstrap_interval(ttfts["miss"], ttfts["off"], strata=orders)
    bypassed_low, bypassed_high = pair_bootstrap_interval(ttfts["bypassed"], ttfts["off"], strata=orders)

    def by_order(kvtier_first: bool) -> float:
        pairs = [pair for pair in range(MISS_PAIRS) if _kvtier_first(pair) == kvtier_first]
        return pooled_median_ratio([ttfts["miss"][i] for i in pairs], [ttfts["off"][i] for i in pairs])

    same_engine = [
        m.ttft / b.ttft
        for ms, bs in zip(taken["miss"], taken["bypassed"], strict=True)
        for m, b in zip(ms, bs, strict=True)
    ]
    phases = {case: phase_ms([s for samples in taken[case] for s in samples]) for case in MISS_CASES}
    return {
        "miss_pairs": MISS_PAIRS,
        "miss_samples_per_pair": MISS_SAMPLES,
        "ttft_off_ms": 1000 * pooled("off"),
        "ttft_miss_fresh_ms": 1000 * pooled("miss"),
        "ttft_bypassed_ms": 1000 * pooled("bypassed"),
        # Each pair's own medians, in the order they ran, to show the spread between engines.
        "ttft_off_ms_per_engine": [round(1000 * t, 2) for t in per_pair("off")],
        "ttft_miss_ms_per_engine": [round(1000 * t, 2) for t in per_pair("miss")],
        "ttft_bypassed_ms_per_engine": [round(1000 * t, 2) for t in per_pair("bypassed")],
        "ttft_miss_ratio": round(pooled_median_ratio(ttfts["miss"], ttfts["off"]), 3),
        "ttft_miss_ratio_low95": round(miss_low, 3),
        "ttft_miss_ratio_high95": round(miss_high, 3),
        "ttft_miss_ratio_per_pair": [round(r, 3) for r in ratios],
        "ttft_miss_ratio_geomean": round(float(np.exp(np.mean(np.log(ratios)))), 3),
        # The start-order effect: each half's pooled ratio, and each pair's forward ratio.
        "miss_pairs_kvtier_first": orders,
        "ttft_miss_ratio_kvtier_first": round(by_order(True), 3),
        "ttft_miss_ratio_kvtier_second": round(by_order(False), 3),
        "ttft_miss_forward_ratio_per_pair": [round(r, 3) for r in forward_ratios],
        "ttft_bypassed_ratio": round(pooled_median_ratio(ttfts["bypassed"], ttfts["off"]), 3),
        "ttft_bypassed_ratio_low95": round(bypassed_low, 3),
        "ttft_bypassed_ratio_high95": round(bypassed_high, 3),
        "ttft_miss_same_engine_ratio": round(statistics.median(same_engine), 3),
        "ttft_ms_by_phase": phases,
        "ttft_miss_forward_ratio": round(pooled("miss", "forward") / pooled("off", "forward"), 3),
        "ttft_bypassed_forward_ratio": round(pooled("bypassed", "forward") / pooled("off", "forward"), 3),
        "ttft_miss_kvtier_fraction": round(pooled("miss", "kvtier") / pooled("off"), 4),
        "ttft_miss_kvtier_by_hook": hook_ms([s for samples in taken["miss"] for s in samples]),
    }


def _tier_hits(bench: Any, kv_bytes: int, redis_url: str | None, store: Any) -> dict[str, Any]:
    """Each tier's hits against its floor: CPU and disk always, Redis and the object tier where
    their servers run (store: the SeaweedFS server, or None)."""
    hits = hit_floors.cpu_and_disk(bench, kv_bytes)
    if redis_url:
        redis = hit_floors.redis(bench, redis_url)
        hits["floors"]["redis"] = redis["floor"]
        hits["redis_benchmark"] = redis["redis_benchmark"]
    if store:
        above = [Tier.CPU, Tier.DISK, *([Tier.REDIS] if redis_url else [])]
        hits["floors"]["object"] = hit_floors.object_tier(bench, store.url("ttft"), store.endpoint, above)
    return hits


def bench_ttft(
    model: str, tmp: Path, prompt_tokens: int = 6 * TTFT_CHUNK + 1, repeat: int = 5, miss: bool = True,
    quick: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """TTFT (prefill + first token) of a miss and of hits from each tier, against recompute and
    each tier's floor: medians over `repeat` distinct prompts (the miss and its reference over
    several pairs of engines, see bench_miss).

    The prompt is whole chunks plus one token, so a full hit leaves exactly one token to compute,
    as vLLM's own hit of it (the floors' ceiling) does. miss=False: the hits engine alone; quick: no
    warm-up and one round (a smoke test: its figures are not to be reported).
    """
    from kvtier.app.client import ServiceClient
    from kvtier.connector.planning import Geometry, external_tokens

    engine = dict(enable_prefix_caching=False, max_model_len=4096, kv_cache_memory_bytes=512 << 20)
    loaded = external_tokens(prompt_tokens // TTFT_CHUNK, 0, prompt_tokens, Geometry(32, TTFT_CHUNK))
    kv_bytes = loaded * BENCH.kv_bytes_per_token  # what a full hit loads
    prompts = [make_prompt(9000 + i, prompt_tokens) for i in range(repeat)]
    fresh_all = [make_prompt(9700 + i, prompt_tokens) for i in range(repeat)]
    warm_ups = 0 if quick else warm_up_prompts(engine, prompt_tokens)
    warm_up = [make_prompt(600_000 + i, prompt_tokens) for i in range(warm_ups)]

    missed = bench_miss(model, tmp, engine, prompt_tokens) if miss else None
    with (
        redis_server(tmp) as redis_url,
        seaweed_server(preexec_fn=off_the_model_core()) as store,
        bench_credentials() if store else contextlib.nullcontext(),
    ):
        settings: dict[str, Any] = {"disk_path": tmp / "disk"}
        if redis_url:
            settings["redis_url"] = redis_url
        if store:
            settings.update(object_url=store.url("ttft"), object_endpoint=store.endpoint)
        with kvtier_service(tmp / "svc", **settings) as url, ServiceClient(url) as client:
            client.wait_connected(10)
            kv = kv_transfer_config(service_url=url, chunk_size=TTFT_CHUNK)
            note("  TTFT hits: an engine with kvtier and vLLM's prefix cache starting (hits, floors)")
            with running_engine(model, kv, **{**engine, "enable_prefix_caching": True}) as llm:
                with kvtier_bypassed(llm):  # warmed as bench_miss warms: nothing stored
                    generate_each(llm, warm_up, 1)
                hit_floors.reset_vllm_cache(llm)
                miss_s, files = hit_floors.store_prompts(
                    llm, client, prompts, tmp / "disk", prompt_tokens // TTFT_CHUNK
                )
                if store:  # uploads run behind the write queue: none may run under a sample
                    wait_uploaded(client, len(prompts) * (prompt_tokens // TTFT_CHUNK))
                bench = hit_floors.HitBench(llm, client, prompts, files, loaded, rounds=1 if quick else 3)
                hits = _tier_hits(bench, kv_bytes, redis_url, store)
                # With Redis too: each miss is also written to a redis-server on the same cores.
                fresh_s = statistics.median(hit_floors.ttft_once(llm, p) for p in fresh_all)
                hits["hit_tokens"] = client.stats().result(10)["hit_tokens"]
    hits["ttft_miss_ms"] = round(1000 * miss_s, 2)
    hits["ttft_miss_fresh_all_tiers_ms"] = round(1000 * fresh_s, 2)
    if missed is None:
        floors = hits.pop("floors")
        ratios = {tier: figures["ratio"] for tier, figures in floors.items()}
        return {"prompt_tokens": prompt_tokens, **hits, "hit_floors": floors, "hit_floor_ratio": ratios}
    return _ttft_figures(missed, hits, prompt_tokens, kv_bytes)


def _ttft_figures(
    miss: dict[str, Any], hits: dict[str, Any], prompt_tokens: int, kv_bytes: int
) -> dict[str, Any]:
    """bench_ttft's figures from bench_miss's and the hits engine's."""
    floors = hits.pop("floors")
    phases = hits.pop("ttft_ms_by_phase")
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "kv_bytes_loaded": kv_bytes}
    out.update({k: (round(v, 2) if k.endswith("_ms") else v) for k, v in miss.items()})
    out["ttft_ms_by_phase"].update(phases)
    out.update(hits)
    out["hit_floors"] = floors
    out["hit_floor_ratio"] = {tier: figures["ratio"] for tier, figures in floors.items()}
    for tier, figures in floors.items():
        out[f"ttft_{tier}_hit_ms"] = figures["hit_ms"]
    cpu = floors["cpu"]
    out["ttft_vllm_prefix_hit_ms"] = cpu["ceiling_ms"]  # vLLM's own hit, in the engine of the CPU hits
    out["cold_memcpy_ms"] = cpu["move_ms"]
    out["cpu_hit_over_prefix_hit_ms"] = round(cpu["hit_ms"] - cpu["ceiling_ms"], 2)
    out["cpu_hit_load_over_memcpy_ratio"] = round(out["cpu_hit_over_prefix_hit_ms"] / cpu["move_ms"], 3)
    out["ttft_cpu_hit_speedup"] = round(out["ttft_off_ms"] / cpu["hit_ms"], 2)
    out["ttft_miss_ratio_all_tiers"] = round(out["ttft_miss_fresh_all_tiers_ms"] / out["ttft_off_ms"], 3)
    return out
