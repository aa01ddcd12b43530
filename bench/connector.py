"""`kvtier bench connector`: the connector's costs, each as a ratio to a reference from the same run.

(a) worker block copies against a plain memory copy of the same bytes; (b) the scheduler-side
connector's time per step against vLLM's own ``schedule()``; (c) time to first token of a long prompt
for hits from each tier, a miss, and no kvtier, against recompute and a floor. docs/performance.md
("Connector benchmark") says what each figure means and records what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench.arena_dir import arena_dir
from kvtier.bench.bootstrap import pair_bootstrap_interval, pooled_median_ratio
from kvtier.bench.engine_core import run_engine_core
from kvtier.bench.engine_proc import (
    EngineProcess,
    Sample,
    engine_clock,
    environment,
    hook_ms,
    kvtier_bypassed,
    phase_ms,
    time_prompt,
)
from kvtier.bench.harness import generate, generate_each, kv_transfer_config, make_prompt, running_engine
from kvtier.bench.models import BENCH, TINY, build_model
from kvtier.bench.phases import SCHEDULER_HOOKS, PhaseClock
from kvtier.bench.progress import note

ARENA_BYTES = 1 << 30  # the CPU tier of every service the benchmark starts
TTFT_CHUNK = 256  # chunk_size of the TTFT benchmarks' engines, in tokens
SCHEDULER_REQUESTS = 256  # requests running together in the scheduler part
QUICK_REQUESTS = 16  # the same under --quick


def _median_time(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def in_turns(samplers: Sequence[Callable[[int], float]], count: int, rounds: int = 3) -> list[float]:
    """Each sampler's median over single samples taken in turn (sampler by sampler, in the order
    given, for indexes 0..count-1, rounds times over), so every figure sees the same drift of the
    machine's speed."""
    taken = [[sample(i) for sample in samplers] for _ in range(rounds) for i in range(count)]
    return [statistics.median(turn[k] for turn in taken) for k in range(len(samplers))]


def _ttft_once(llm: Any, prompt: list[int]) -> float:
    """Seconds from submitting prompt alone to its first token."""
    return _median_time(lambda: generate(llm, [prompt], 1), 1)


# ------------------------------------------------------------------------------------------ (a) copies
def bench_copy(repeat: int = 7) -> dict[str, float]:
    """Block copier save/load throughput vs np.copyto of the same bytes into a pre-touched mmap
    (best of `repeat` interleaved rounds each).

    The copier runs as the worker runs it: with its copy thread when this process may use two CPUs
    or more (``copy_threads`` says which); the reference is one np.copyto on one thread.
    """
    import mmap

    import torch

    from kvtier.connector.copy import BlockCopier
    from kvtier.runtime.affinity import engine_cpus

    layers, num_blocks, bpc = 8, 512, 8  # BENCH model: 8 layers, 64 KiB pages at block size 32
    kv = [torch.randn(num_blocks, 8, 32, 128).to(torch.bfloat16) for _ in range(layers)]
    copier = BlockCopier(kv, num_blocks, bpc, helper_cpus=engine_cpus())
    nbytes = copier.chunk_bytes
    arena = mmap.mmap(-1, nbytes)
    arena[:] = b"\x01" * nbytes  # pre-touch, as the arena is
    slot = copier.slot_view(memoryview(arena))
    ids = list(range(3, 3 + 7 * bpc, 7))
    src = np.concatenate([k[ids].view(torch.uint8).numpy().reshape(-1) for k in kv])
    dst = np.frombuffer(arena, dtype=np.uint8)
    # Interleaved round by round and best of each: a stall of the host must not land on one side only.
    save_s = load_s = memcpy_s = float("inf")
    for _ in range(repeat):
        save_s = min(save_s, _median_time(lambda: (copier.save(slot, ids), copier.wait()), 1))
        load_s = min(load_s, _median_time(lambda: (copier.load(slot, 0, ids), copier.wait()), 1))
        memcpy_s = min(memcpy_s, _median_time(lambda: np.copyto(dst, src), 1))
    copier.close()
    slot = dst = None  # drop the views so the mapping can close
    arena.close()
    gbps = nbytes / 1e9
    return {
        "chunk_bytes": nbytes,
        "copy_threads": copier.cpu_threads,
        "memcpy_gbps": round(gbps / memcpy_s, 2),
        "save_gbps": round(gbps / save_s, 2),
        "load_gbps": round(gbps / load_s, 2),
        "copy_ratio": round(min(memcpy_s / save_s, memcpy_s / load_s), 3),
    }


class ColdCopy:
    """np.copyto of nbytes between pre-touched pools bigger than the CPU's caches: each copy takes
    the next piece of a source and a destination pool, so its bytes were not touched since the
    pools were filled (or since a whole round of pieces ago)."""

    def __init__(self, nbytes: int, pool_bytes: int = 512 << 20) -> None:
        self.nbytes = nbytes
        self._pieces = max(2, pool_bytes // nbytes)
        self._src = np.full((self._pieces, nbytes), 1, dtype=np.uint8)
        self._dst = np.full((self._pieces, nbytes), 2, dtype=np.uint8)
        self._turn = 0

    def once(self) -> float:
        """Seconds one cold copy of nbytes took."""
        i = self._turn % self._pieces
        self._turn += 1
        start = time.perf_counter()
        np.copyto(self._dst[i], self._src[(i + self._pieces // 2) % self._pieces])
        return time.perf_counter() - start


# -------------------------------------------------------------------------------------- services
def _off_the_model_core() -> Callable[[], None]:
    """A preexec_fn that runs the child on the CPUs this process started with.

    Once an in-process engine has run, vLLM has bound this thread to the model's core; a service or
    Redis started from here would inherit that, which no deployment does (see runtime/affinity.py).
    """
    from kvtier.runtime.affinity import engine_cpus, run_on

    cpus = engine_cpus()

    def preexec() -> None:
        run_on(cpus)

    return preexec


@contextlib.contextmanager
def _service(tmp: Path, **settings: Any) -> Iterator[str]:
    """A standalone kvtier service (`python -m kvtier.app.server`) on a unix socket, its arena on tmpfs."""
    tmp.mkdir(parents=True, exist_ok=True)
    sock = tmp / "kvtier.sock"
    with arena_dir(tmp, ARENA_BYTES) as shm:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        # No PYTHONPATH: the service imports kvtier as this interpreter does (installed, or the checkout).
        env.update({"KVTIER_SHM_DIR": str(shm), "KVTIER_CPU_SIZE": str(ARENA_BYTES)})
        env.update({f"KVTIER_{k.upper()}": str(v) for k, v in settings.items()})
        with open(tmp / "service.log", "w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvtier.app.server", "--url", f"unix://{sock}"],
                env=env,
                stdout=log,
                stderr=log,
                preexec_fn=_off_the_model_core(),
            )
        try:
            deadline = time.monotonic() + 30
            while not sock.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError((tmp / "service.log").read_text())
                time.sleep(0.05)
            yield f"unix://{sock}"
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


@contextlib.contextmanager
def _redis(tmp: Path) -> Iterator[str | None]:
    """A redis-server on a free loopback port, once it answers PING; None where none is installed."""
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    from kvtier.bench.demo import free_port

    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_off_the_model_core(),
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        _wait_pong(proc, url)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def _wait_pong(proc: subprocess.Popen[bytes], url: str, timeout: float = 30) -> None:
    """Wait until the redis-server at url answers PING (it listens a moment after it starts)."""
    import redis

    deadline = time.monotonic() + timeout
    with redis.Redis.from_url(url, socket_connect_timeout=1) as client:
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"redis-server at {url} did not answer within {timeout:.0f} s"
                    ) from None
                time.sleep(0.05)


def _wait_drained(client: Any) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and client.stats().result(10)["write_queue_depth"]:
        time.sleep(0.05)


def _wait_released(client: Any) -> None:
    """Wait until no lease is held: the engine ends a finished request's lease with its client's
    next call or sweep, and a clear() before that keeps the leased chunks in their tier."""
    deadline = time.monotonic() + 60
    while client.stats().result(10)["leases_active"]:
        if time.monotonic() > deadline:
            raise RuntimeError("the engine's leases did not end within 60 s")
        time.sleep(0.02)


def _hit_tokens(client: Any) -> dict[str, int]:
    return dict(client.stats().result(10)["hit_tokens"])


def _check_hits(client: Any, before: dict[str, int], tier: str, tokens: int) -> None:
    """Fail unless the hits since before were exactly tokens, all from tier: a figure measured on
    hits from another tier would be reported under the wrong name."""
    after = _hit_tokens(client)
    got = {t: n - before.get(t, 0) for t, n in after.items() if n != before.get(t, 0)}
    if got != {tier: tokens}:
        raise RuntimeError(f"expected {tokens} hit tokens from the {tier} tier, got {got}")


def _full_chunks(prompts: list[list[int]]) -> int:
    """Chunks a miss of each of these prompts saves (whole chunks only)."""
    return sum(len(p) // TTFT_CHUNK for p in prompts)


def _wait_stored(client: Any, chunks: int) -> None:
    """Wait until the CPU tier holds `chunks` chunks, then for the write queue: an empty queue alone
    does not say the engine's saves were committed (they copy at a lower priority, after the prompt)."""
    deadline = time.monotonic() + 60
    while client.stats().result(10)["tiers"]["cpu"]["chunks"] < chunks:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the engine's saves did not reach {chunks} chunks within 60 s")
        time.sleep(0.02)
    _wait_drained(client)


# ---------------------------------------------------------------------------- (b) scheduler share


def bench_scheduler(model: str, tmp: Path, num_requests: int = SCHEDULER_REQUESTS) -> dict[str, Any]:
    """Connector time on the scheduler thread with num_requests running requests, vs vLLM's schedule().

    The numerator is every connector hook vLLM calls on its scheduler thread (from add_request and
    update_from_output too, stats included); the denominator is schedule() without the hooks it
    calls. ``hook_ms_per_step`` splits the numerator by hook.

    The requests arrive once the connector is connected to the service: behind vLLM's API server
    an engine is up, and its connector connected, long before its first request, whereas an
    EngineCore given its requests the moment it is built would have the first step wait for the
    handshake, a cost of starting up, not of a step.
    """
    clock = PhaseClock()

    def instrument(core: Any) -> None:
        connector = core.scheduler.connector
        if not connector._client.wait_connected(30):
            raise RuntimeError("the scheduler's connector did not connect to the service within 30 s")
        clock.time_hooks(connector, SCHEDULER_HOOKS)
        clock.time_span(core.scheduler, "schedule")

    prompts = [list(np.random.default_rng(i).integers(2, 1000, 96)) for i in range(num_requests)]
    prompts = [[int(t) for t in p] for p in prompts]
    note(f"  scheduler share: an engine with {num_requests} requests starting")
    with _service(tmp / "sched") as url:
        run_engine_core(
            model, prompts, 64, kv_transfer_config(service_url=url, chunk_size=32), async_scheduling=False,
            enable_prefix_caching=False, max_num_seqs=num_requests, max_model_len=256,
            on_start=instrument,
        )  # fmt: skip
    took = clock.take()
    steps = max(1, took.calls)
    return {
        "steps": took.calls,
        "schedule_ms_per_step": round(1000 * took.span / steps, 3),
        "connector_ms_per_step": round(1000 * took.hooks / steps, 3),
        "scheduler_overhead_fraction": round(took.hooks / max(took.span, 1e-9), 4),
        "hook_ms_per_step": {name: round(1000 * spent / steps, 4) for name, spent in took.by_hook.items()},
    }


# One engine's fraction moves with a single stall of the host: the median engine of several is reported.
SCHEDULER_RUNS = 5


def bench_scheduler_runs(
    model: str, tmp: Path, runs: int = SCHEDULER_RUNS, num_requests: int = SCHEDULER_REQUESTS
) -> dict[str, Any]:
    """bench_scheduler in `runs` engines: the run with the median fraction, and every fraction."""
    taken = sorted(
        (bench_scheduler(model, tmp / f"sched-{i}", num_requests) for i in range(runs)),
        key=lambda fig: fig["scheduler_overhead_fraction"],
    )
    return {**taken[len(taken) // 2], "fractions": [fig["scheduler_overhead_fraction"] for fig in taken]}


# ------------------------------------------------------------------------------------------ (c) TTFT
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
    from kvtier.app.client import ServiceClient
    from kvtier.runtime.affinity import engine_cpus

    cpus = engine_cpus()  # not the one core an in-process engine may have bound this thread to
    seeds = iter(range(20_000, 1_000_000))
    taken: dict[str, list[list[Sample]]] = {case: [] for case in MISS_CASES}
    for pair in range(MISS_PAIRS):
        note(f"  TTFT miss: engine pair {pair + 1}/{MISS_PAIRS} (with and without kvtier) starting")
        # The tiers a user gets by default: CPU + disk, as embedded mode runs them.
        with contextlib.ExitStack() as stack:
            url = stack.enter_context(
                _service(tmp / f"default-{pair}", disk_path=tmp / f"disk-default-{pair}")
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
                    _wait_stored(client, len(got["miss"]) * (prompt_tokens // TTFT_CHUNK))
                    got[case].append(engine_proc.sample(make_prompt(next(seeds), prompt_tokens), bypass))
            for case in MISS_CASES:
                taken[case].append(got[case])

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
    kvtier_by_hook = hook_ms([s for samples in taken["miss"] for s in samples])
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
        "ttft_miss_kvtier_by_hook": kvtier_by_hook,
    }


def bench_ttft(
    model: str, tmp: Path, prompt_tokens: int = 6 * TTFT_CHUNK + 1, repeat: int = 5
) -> dict[str, Any]:
    """TTFT (prefill + first token) per case, medians over `repeat` distinct prompts (the miss and
    its reference over several pairs of engines, see bench_miss).

    The prompt is whole chunks plus one token, so a full hit leaves exactly one token to compute, as
    the floor assumes.
    """
    from kvtier.app.client import ServiceClient
    from kvtier.connector.planning import Geometry, external_tokens
    from kvtier.storage.base import Tier

    engine = dict(enable_prefix_caching=False, max_model_len=4096, kv_cache_memory_bytes=512 << 20)
    loaded = external_tokens(prompt_tokens // TTFT_CHUNK, 0, prompt_tokens, Geometry(32, TTFT_CHUNK))
    kv_bytes = loaded * BENCH.kv_bytes_per_token  # what a full CPU hit copies
    prompts = [make_prompt(9000 + i, prompt_tokens) for i in range(repeat)]
    fresh_all = [make_prompt(9700 + i, prompt_tokens) for i in range(repeat)]
    warm_up = [make_prompt(600_000 + i, prompt_tokens) for i in range(warm_up_prompts(engine, prompt_tokens))]

    def ttft(llm: Any, batch: list[list[int]]) -> float:
        return statistics.median(_ttft_once(llm, p) for p in batch)

    miss = bench_miss(model, tmp, engine, prompt_tokens)
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens}
    with _redis(tmp) as redis_url:
        settings: dict[str, Any] = {"disk_path": tmp / "disk"}
        if redis_url:
            settings["redis_url"] = redis_url
        with _service(tmp / "svc", **settings) as url:
            client = ServiceClient(url)
            client.wait_connected(10)
            kv = kv_transfer_config(service_url=url, chunk_size=TTFT_CHUNK)
            note("  TTFT hits: an engine with kvtier starting (CPU, disk, Redis hits)")
            with running_engine(model, kv, **engine) as llm:
                with kvtier_bypassed(llm):  # warmed as bench_miss warms: nothing stored
                    generate_each(llm, warm_up, 1)
                out["ttft_miss_ms"] = ttft(llm, prompts)  # stores them
                _wait_stored(client, _full_chunks(prompts))
                # The floor's parts come from this engine and process, each sample next to a hit's,
                # so engine-to-engine differences and memory-speed drift land on both sides.
                figures, memcpy_s, hit_phases = _cpu_hit_and_floor(llm, prompts, kv_bytes)
                out.update(figures)
                _wait_released(client)
                client.clear([Tier.CPU]).result(30)
                before = _hit_tokens(client)
                out["ttft_disk_hit_ms"] = ttft(llm, prompts)
                _check_hits(client, before, "disk", loaded * repeat)
                if redis_url:
                    _wait_released(client)
                    client.clear([Tier.CPU, Tier.DISK]).result(30)
                    before = _hit_tokens(client)
                    out["ttft_redis_hit_ms"] = ttft(llm, prompts)
                    _check_hits(client, before, "redis", loaded * repeat)
                # With Redis too: each miss is also written to a redis-server on the same cores.
                out["ttft_miss_fresh_all_tiers_ms"] = ttft(llm, fresh_all)
                out["hit_tokens"] = client.stats().result(10)["hit_tokens"]
            client.close()
    # vLLM's own prefix cache, no kvtier: the first pass stores the prompts, the second hits.
    note("  TTFT: an engine with vLLM's prefix cache, no kvtier, starting")
    with running_engine(model, None, **{**engine, "enable_prefix_caching": True}) as llm:
        generate_each(llm, warm_up, 1)
        ttft(llm, prompts)
        out["ttft_vllm_prefix_hit_ms"] = ttft(llm, prompts)
        out["ttft_vllm_one_token_ms"] = ttft(llm, [[5]] * repeat)
    out.update(bench_hit_over_prefix_hit(model, tmp, engine, prompts, warm_up))
    # A hit copies bytes untouched since they were stored: the floor takes a cold memcpy's speed,
    # not that of bench_copy's reference, whose one chunk stays in cache.
    memcpy = round(kv_bytes / memcpy_s / 1e9, 2)
    memcpy_ms = memcpy_s * 1000
    floor_ms = memcpy_ms + out["ttft_one_token_ms"] * 1000
    warm_one_token_floor_ms = memcpy_ms + out["ttft_one_token_warm_ms"] * 1000
    warm_memcpy_ms = kv_bytes / (bench_copy(3)["memcpy_gbps"] * 1e9) * 1000
    warm_floor_ms = warm_memcpy_ms + out["ttft_one_token_warm_ms"] * 1000
    out["cold_memcpy_gbps"] = memcpy
    out = {k: (round(v * 1000, 2) if k.endswith("_ms") else v) for k, v in out.items()}
    out.update({k: (round(v, 2) if k.endswith("_ms") else v) for k, v in miss.items()})
    out["ttft_ms_by_phase"].update(hit_phases["ttft_ms_by_phase"])
    out["cpu_hit_kvtier_by_hook"] = hit_phases["cpu_hit_kvtier_by_hook"]
    out["kv_bytes_loaded"] = kv_bytes
    out["cold_memcpy_ms"] = round(memcpy_ms, 2)
    out["cpu_hit_load_over_memcpy_ratio"] = round(
        out["cpu_hit_over_prefix_hit_ms"] / out["cold_memcpy_ms"], 3
    )
    out["cpu_hit_floor_ms"] = round(floor_ms, 2)
    if "ttft_miss_fresh_all_tiers_ms" in out:
        out["ttft_miss_ratio_all_tiers"] = round(out["ttft_miss_fresh_all_tiers_ms"] / out["ttft_off_ms"], 3)
    out["ttft_cpu_hit_floor_ratio"] = round(out["ttft_cpu_hit_ms"] / floor_ms, 3)
    out["ttft_cpu_hit_warm_floor_ratio"] = round(out["ttft_cpu_hit_ms"] / warm_floor_ms, 3)
    out["ttft_cpu_hit_warm_one_token_floor_ratio"] = round(
        out["ttft_cpu_hit_ms"] / warm_one_token_floor_ms, 3
    )
    out["ttft_cpu_hit_speedup"] = round(out["ttft_off_ms"] / out["ttft_cpu_hit_ms"], 2)
    out["ttft_cpu_hit_one_token_ratio"] = round(out["ttft_cpu_hit_ms"] / out["ttft_one_token_warm_ms"], 3)
    out["ttft_vllm_prefix_hit_one_token_ratio"] = round(
        out["ttft_vllm_prefix_hit_ms"] / out["ttft_vllm_one_token_ms"], 3
    )
    return out


def _cpu_hit_and_floor(
    llm: Any, prompts: list[list[int]], kv_bytes: int
) -> tuple[dict[str, float], float, dict[str, Any]]:
    """CPU hits of prompts and the floor's parts, sampled in turn (see bench_ttft): the TTFTs in
    seconds (under the _ms names bench_ttft gives them in ms), the cold memcpy's seconds, and
    where the hit's time went (_hit_phases)."""
    cold = ColdCopy(kv_bytes)
    hit_s, one_warm_s, memcpy_s, one_s = in_turns(
        [
            lambda i: _ttft_once(llm, prompts[i]),
            lambda i: _ttft_once(llm, [5]),
            lambda _: cold.once(),
            lambda i: _ttft_once(llm, [5]),
        ],
        len(prompts),
    )
    figures = {"ttft_cpu_hit_ms": hit_s, "ttft_one_token_ms": one_s, "ttft_one_token_warm_ms": one_warm_s}
    return figures, memcpy_s, _hit_phases(llm, prompts, cold)


def _hit_phases(llm: Any, prompts: list[list[int]], cold: ColdCopy, rounds: int = 3) -> dict[str, Any]:
    """Where a CPU hit's time goes, and a one-token prompt's after a cold memcpy (the floor's
    parts), split as the misses' are (phase_ms, hook_ms): samples of their own, taken in turn
    after the figure's, since timing every connector hook costs a little."""
    clock = engine_clock(llm, kvtier=True)
    hits: list[Sample] = []
    ones: list[Sample] = []
    try:
        for _ in range(rounds):
            for prompt in prompts:
                hits.append(time_prompt(llm, clock, prompt))
                cold.once()
                ones.append(time_prompt(llm, clock, [5]))
    finally:
        clock.restore()
    return {
        "ttft_ms_by_phase": {"cpu_hit": phase_ms(hits), "one_token": phase_ms(ones)},
        "cpu_hit_kvtier_by_hook": hook_ms(hits),
    }


def bench_hit_over_prefix_hit(
    model: str,
    tmp: Path,
    engine: dict[str, Any],
    prompts: list[list[int]],
    warm_up: list[list[int]],
    rounds: int = 3,
) -> dict[str, float]:
    """What a kvtier CPU hit costs over vLLM's own prefix-cache hit of the same prompt, in one engine
    with both (the hit that copies nothing; docs/performance.md says why the floor is below it).

    Rounds of: vLLM hits of every prompt (its cache holds them), its cache reset, kvtier CPU hits of
    every prompt (which vLLM caches again). Medians of single samples, in seconds.
    """
    from kvtier.app.client import ServiceClient

    vllm_hits: list[float] = []
    kvtier_hits: list[float] = []
    with _service(tmp / "svc-prefix") as url, ServiceClient(url) as client:
        client.wait_connected(10)
        note("  TTFT: an engine with kvtier and vLLM's prefix cache starting")
        with running_engine(
            model,
            kv_transfer_config(service_url=url, chunk_size=TTFT_CHUNK),
            **{**engine, "enable_prefix_caching": True},
        ) as llm:
            with kvtier_bypassed(llm):
                generate_each(llm, warm_up, 1)
            llm.reset_prefix_cache()
            generate_each(llm, prompts, 1)  # misses: kvtier stores them, vLLM caches them
            _wait_stored(client, _full_chunks(prompts))
            for _ in range(rounds):
                vllm_hits += [_ttft_once(llm, p) for p in prompts]
                if not llm.reset_prefix_cache():
                    raise RuntimeError("vLLM did not reset its prefix cache")
                kvtier_hits += [_ttft_once(llm, p) for p in prompts]
    vllm_hit, kvtier_hit = statistics.median(vllm_hits), statistics.median(kvtier_hits)
    return {  # seconds, under the _ms names bench_ttft gives them in ms
        "ttft_prefix_engine_vllm_hit_ms": vllm_hit,
        "ttft_prefix_engine_cpu_hit_ms": kvtier_hit,
        "cpu_hit_over_prefix_hit_ms": kvtier_hit - vllm_hit,
    }


def _env_default(name: str, value: str) -> contextlib.AbstractContextManager[None]:
    """name=value in os.environ while inside, unless name is set already."""
    return environment({} if name in os.environ else {name: value})


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """Run every part and return the figures."""
    parser = argparse.ArgumentParser(prog="kvtier bench connector", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--skip-ttft", action="store_true", help="only the copy and scheduler parts")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"one copy round and one scheduler engine of {QUICK_REQUESTS} requests, no TTFT part: "
        "shows the benchmark runs end to end (its figures are not meant to be reported)",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # Engines (and this process: torch reads it at its first allocation) keep weights and KV cache
    # on transparent huge pages where the kernel allows, which steadies engine-to-engine speed.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    # vLLM logs to stdout unless told otherwise; --json promises one JSON object there.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    result: dict[str, Any] = {"copy": bench_copy(1 if args.quick else 7)}
    with (
        tempfile.TemporaryDirectory(prefix="kvtier-bench-") as tmp,
        # vLLM's engines leave their ZeroMQ socket files behind (in /tmp by default): here they go
        # with the benchmark's directory.
        _env_default("VLLM_RPC_BASE_PATH", tmp),
    ):
        work = Path(tmp)
        tiny = str(build_model(work / "tiny", TINY))
        if args.quick:
            result["scheduler"] = bench_scheduler_runs(tiny, work, runs=1, num_requests=QUICK_REQUESTS)
        else:
            result["scheduler"] = bench_scheduler_runs(tiny, work)
        if not (args.skip_ttft or args.quick):
            result["ttft"] = bench_ttft(str(build_model(work / "bench", BENCH)), work)
    result["copy_ratio"] = result["copy"]["copy_ratio"]
    result["scheduler_overhead_fraction"] = result["scheduler"]["scheduler_overhead_fraction"]
    if "ttft" in result:
        result["ttft_miss_ratio"] = result["ttft"]["ttft_miss_ratio"]
        result["ttft_cpu_hit_floor_ratio"] = result["ttft"]["ttft_cpu_hit_floor_ratio"]
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for section, figures in result.items():
            print(f"{section}: {figures}")
    return result


def main(argv: list[str] | None = None) -> int:
    """Entry point for `python -m kvtier.bench.connector` and `kvtier bench connector`."""
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
