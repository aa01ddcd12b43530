"""`kvtier bench connector`: the connector's costs, each as a ratio to a reference from the same run.

(a) worker block copies against a plain memory copy of the same bytes; (b) the scheduler-side
connector's time per step against vLLM's own ``schedule()``; (c) time to first token of a long prompt
for a miss against no kvtier (bench/ttft.py), and for hits from each tier against that tier's floor:
vLLM's own prefix-cache hit of the prompt plus one plain move of the bytes (bench/hit_floors.py).
docs/performance.md ("Connector benchmark") says what each figure means and records what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench.engine_core import run_engine_core
from kvtier.bench.environ import environment
from kvtier.bench.floors import HIT_FLOOR_TARGETS
from kvtier.bench.harness import kv_transfer_config
from kvtier.bench.models import BENCH, TINY, build_model
from kvtier.bench.phases import SCHEDULER_HOOKS, PhaseClock
from kvtier.bench.progress import note
from kvtier.bench.services import kvtier_service
from kvtier.bench.ttft import bench_ttft
from kvtier.bench.turns import median_time

SCHEDULER_REQUESTS = 256  # requests running together in the scheduler part
QUICK_REQUESTS = 16  # the same under --quick


# ------------------------------------------------------------------------------------------ (a) copies
def _copy_rounds(
    copier: Any, slot: Any, dst: np.ndarray, src: np.ndarray, ids: list[int], repeat: int
) -> tuple[float, float, float]:
    """Seconds of the best save, load and np.copyto, interleaved round by round: a stall of the host
    must not land on one side only."""

    def save() -> None:
        copier.save(slot, ids)
        copier.wait()

    def load() -> None:
        copier.load(slot, 0, ids)
        copier.wait()

    save_s = load_s = memcpy_s = float("inf")
    for _ in range(repeat):
        save_s = min(save_s, median_time(save, 1))
        load_s = min(load_s, median_time(load, 1))
        memcpy_s = min(memcpy_s, median_time(lambda: np.copyto(dst, src), 1))
    return save_s, load_s, memcpy_s


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
    ids = list(range(3, 3 + 7 * bpc, 7))
    src = np.concatenate([k[ids].view(torch.uint8).numpy().reshape(-1) for k in kv])
    # The views of the arena live in _copy_rounds alone, so the mapping can close after it.
    save_s, load_s, memcpy_s = _copy_rounds(
        copier, copier.slot_view(memoryview(arena)), np.frombuffer(arena, dtype=np.uint8), src, ids, repeat
    )
    copier.close()
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
        if not connector.wait_connected(30):
            raise RuntimeError("the scheduler's connector did not connect to the service within 30 s")
        clock.time_hooks(connector, SCHEDULER_HOOKS)
        clock.time_span(core.scheduler, "schedule")

    prompts = [list(np.random.default_rng(i).integers(2, 1000, 96)) for i in range(num_requests)]
    prompts = [[int(t) for t in p] for p in prompts]
    note(f"  scheduler share: an engine with {num_requests} requests starting")
    with kvtier_service(tmp / "sched") as url:
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


def _defaults(tmp: str) -> dict[str, str]:
    """The variables the benchmark sets for its engines, each only where the caller has not."""
    wanted = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        # Engines (and this process: torch reads it at its first allocation) keep weights and KV
        # cache on transparent huge pages where the kernel allows, which steadies their speed.
        "THP_MEM_ALLOC_ENABLE": "1",
        # vLLM logs to stdout unless told otherwise; --json promises one JSON object there.
        "VLLM_LOGGING_STREAM": "ext://sys.stderr",
        # vLLM's engines leave their ZeroMQ socket files behind (in /tmp by default): here they go
        # with the benchmark's directory.
        "VLLM_RPC_BASE_PATH": tmp,
    }
    return {name: value for name, value in wanted.items() if name not in os.environ}


def _parser() -> argparse.ArgumentParser:
    """The benchmark's command line."""
    parser = argparse.ArgumentParser(prog="kvtier bench connector", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--skip-ttft", action="store_true", help="only the copy and scheduler parts")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"one copy round and one scheduler engine of {QUICK_REQUESTS} requests, no TTFT part: "
        "shows the benchmark runs end to end (its figures are not meant to be reported)",
    )
    parser.add_argument(
        "--hits-only",
        action="store_true",
        help="only part (c)'s hits engine: each tier's hit against its floor (no copies, scheduler or "
        "miss pairs; the object tier's where SeaweedFS's weed is installed); with --quick: one prompt, "
        "one round, no warm-up",
    )
    return parser


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """Run every part and return the figures."""
    args = _parser().parse_args(argv)
    result: dict[str, Any] = {}
    # The variables hold while the benchmark runs and are put back after, so a caller (the tests
    # run it in their own process) keeps its environment.
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as tmp, environment(_defaults(tmp)):
        if not args.hits_only:
            result["copy"] = bench_copy(1 if args.quick else 7)
        work = Path(tmp)
        tiny = str(build_model(work / "tiny", TINY))
        if args.hits_only:
            model = str(build_model(work / "bench", BENCH))
            repeat = 1 if args.quick else 5
            result["ttft"] = bench_ttft(model, work, repeat=repeat, miss=False, quick=args.quick)
        elif args.quick:
            result["scheduler"] = bench_scheduler_runs(tiny, work, runs=1, num_requests=QUICK_REQUESTS)
        else:
            result["scheduler"] = bench_scheduler_runs(tiny, work)
        if not (args.skip_ttft or args.quick or args.hits_only):
            result["ttft"] = bench_ttft(str(build_model(work / "bench", BENCH)), work)
    if not args.hits_only:
        result["copy_ratio"] = result["copy"]["copy_ratio"]
        result["scheduler_overhead_fraction"] = result["scheduler"]["scheduler_overhead_fraction"]
    if "ttft_miss_ratio" in result.get("ttft", {}):
        result["ttft_miss_ratio"] = result["ttft"]["ttft_miss_ratio"]
    if "ttft" in result:
        result["hit_floor_ratio"] = result["ttft"].pop("hit_floor_ratio")
        result["hit_floors"] = result["ttft"].pop("hit_floors")
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for section, figures in result.items():
            print(f"{section}: {figures}")
    if "hit_floors" in result:
        # On stderr under --json, whose stdout is one JSON object.
        print(floor_table(result["hit_floors"]), file=sys.stderr if args.json else sys.stdout)
    return result


def floor_table(floors: dict[str, dict[str, Any]]) -> str:
    """Each tier's hit against its floor (ms), the ratio and its target (reported, not asserted)."""
    lines = [f"{'hit / floor':<12}{'hit ms':>9}{'ceiling':>9}{'move':>9}{'floor':>9}{'ratio':>8}  target"]
    for tier, fig in floors.items():
        target = HIT_FLOOR_TARGETS.get(tier)
        verdict = (
            "" if target is None else f"<= {target:g}: " + ("met" if fig["ratio"] <= target else "NOT met")
        )
        lines.append(
            f"{tier:<12}{fig['hit_ms']:>9.2f}{fig['ceiling_ms']:>9.2f}{fig['move_ms']:>9.2f}"
            f"{fig['floor_ms']:>9.2f}{fig['ratio']:>8.3f}  {verdict}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point for `python -m kvtier.bench.connector` and `kvtier bench connector`."""
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
