"""Disk hits of 4 requests whose prompts are all on the disk tier, submitted at once.

One engine with kvtier (and vLLM's prefix cache, reset before every sample) and one service with a
disk tier. Each sample clears the CPU tier, so every chunk of the 4 prompts is a disk hit, then
submits the 4 prompts together and takes each one's TTFT (vLLM's first-token latency from
arrival) and the time until all 4 have their first token. In turns, every round, three ways of
reading: ``direct`` (the default: the worker reads the chunk files itself, over the service's file
channel, when vLLM schedules the requests), ``ahead`` (the service reads them into its CPU tier as
the lookups arrive, and the worker copies them from there) and ``off`` (the service reads them when
vLLM schedules the requests), each with the page cache warm and cold (``posix_fadvise(DONTNEED)``
on the prompts' chunk files).

    python -m tools.prestage --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvtier.bench import hit_floors
from kvtier.bench.engine_proc import kvtier_bypassed
from kvtier.bench.floors import drop_cached, resident_bytes
from kvtier.bench.harness import generate_each, kv_transfer_config, make_prompt, running_engine
from kvtier.bench.introspect import scheduler_connector, worker_connector
from kvtier.bench.models import BENCH, build_model
from kvtier.bench.services import kvtier_service, wait_drained, wait_released
from kvtier.bench.ttft import TTFT_CHUNK, warm_up_prompts
from kvtier.bench.turns import take_turns
from kvtier.storage.base import Tier

REQUESTS = 4  # submitted at once
PROMPT_CHUNKS = 6  # whole chunks per prompt, plus one token: a full hit leaves one token to compute
MODES = ("direct", "ahead", "off")


@contextlib.contextmanager
def reading(llm: Any, mode: str) -> Iterator[None]:
    """The engine reads disk hits one way: its worker reads the files (direct), or the service does,
    ahead as the lookups arrive (ahead) or when the worker stages the lease (off)."""
    client = scheduler_connector(llm)._sched.client
    worker = worker_connector()._worker
    original, reader = client.lookup, worker._disk
    if reader is None:
        raise RuntimeError("the worker reads no disk files itself: is the service's file channel off?")
    flags = {"stage": mode != "off", "direct_disk": mode == "direct"}

    def lookup(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **{**kwargs, **flags})

    client.lookup = lookup  # an instance attribute shadows the method
    worker._disk = reader if mode == "direct" else None
    try:
        yield
    finally:
        del client.lookup
        worker._disk = reader


class Batches:
    """The 4 stored prompts, submitted together against the disk tier, and what each sample took."""

    def __init__(self, llm: Any, client: Any, prompts: list[list[int]], files: list[str]) -> None:
        self.llm, self.client, self.prompts, self.files = llm, client, prompts, files
        self.per_request: dict[str, list[list[float]]] = {}
        self.resident: list[int] = []

    def sampler(self, mode: str, cold: bool) -> Callable[[int], float]:
        """One sample of mode (see MODES), page cache warm or cold: the seconds until every request
        has its first token."""
        name = f"{mode}_{'cold' if cold else 'warm'}"
        self.per_request[name] = []

        def sample(_: int) -> float:
            hit_floors.reset_vllm_cache(self.llm)
            wait_released(self.client)
            wait_drained(self.client)
            self.client.clear([Tier.CPU]).result(30)
            if cold:
                drop_cached(self.files)
                self.resident.append(resident_bytes(self.files))
            ttfts, total = self._submit(mode)
            self.per_request[name].append(ttfts)
            return total

        return sample

    def _submit(self, mode: str) -> tuple[list[float], float]:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        inputs = [{"prompt_token_ids": list(p)} for p in self.prompts]
        before = self.client.stats().result(10)
        with reading(self.llm, mode):
            start = time.perf_counter()
            results = self.llm.generate(inputs, params, use_tqdm=False)
            total = time.perf_counter() - start
        _check(before, self.client.stats().result(10), mode == "ahead", len(self.prompts))
        return [r.metrics.first_token_latency for r in results], total


def _check(before: dict[str, Any], after: dict[str, Any], stage: bool, requests: int) -> None:
    """Fail unless every hit came from the disk tier, and reads ahead ran exactly when asked for."""
    cpu = after["hit_chunks"]["cpu"] - before["hit_chunks"]["cpu"]
    disk = after["hit_chunks"]["disk"] - before["hit_chunks"]["disk"]
    if cpu or disk < requests * PROMPT_CHUNKS:
        raise RuntimeError(f"expected only disk hits, got {cpu} CPU and {disk} disk hit chunks")
    leases = after["prestage"]["leases"] - before["prestage"]["leases"]
    if stage and leases < requests:
        raise RuntimeError(
            f"reads ahead ran for {leases} of {requests} requests: is the service's prestage_bytes "
            f"0, or under {requests} prompts' KV ({after['prestage']})?"
        )
    if not stage and leases:
        raise RuntimeError(f"{leases} reads ahead ran with the flag off")


def _figures(samples: list[float], per_request: list[list[float]]) -> dict[str, Any]:
    ms = sorted(1000 * s for s in samples)
    each = [sorted(1000 * t for t in ttfts) for ttfts in per_request]
    return {
        "total_ms": round(statistics.median(ms), 2),
        "total_ms_min_max": [round(ms[0], 2), round(ms[-1], 2)],
        # The k-th request to get its first token, median over the samples.
        "ttft_ms_by_rank": [round(statistics.median(s[k] for s in each), 2) for k in range(len(each[0]))],
        "samples": len(ms),
    }


def bench_prestage(model: str, tmp: Path, rounds: int = 3) -> dict[str, Any]:
    """TTFT of 4 disk hits submitted at once, read each of the three ways, page cache warm and cold."""
    from kvtier.app.client import ServiceClient

    prompt_tokens = PROMPT_CHUNKS * TTFT_CHUNK + 1
    engine = dict(enable_prefix_caching=True, max_model_len=4096, kv_cache_memory_bytes=512 << 20)
    prompts = [make_prompt(31_000 + i, prompt_tokens) for i in range(REQUESTS)]
    warm_up = [make_prompt(610_000 + i, prompt_tokens) for i in range(warm_up_prompts(engine, prompt_tokens))]
    disk = tmp / "disk"
    with (
        kvtier_service(tmp / "svc", disk_path=disk) as url,
        ServiceClient(url) as client,
    ):
        client.wait_connected(10)
        kv = kv_transfer_config(service_url=url, chunk_size=TTFT_CHUNK)
        with running_engine(model, kv, **engine) as llm:
            with kvtier_bypassed(llm):
                generate_each(llm, warm_up, 1)
            hit_floors.reset_vllm_cache(llm)
            _, files = hit_floors.store_prompts(llm, client, prompts, disk, PROMPT_CHUNKS)
            batches = Batches(llm, client, prompts, [f for paths in files for f in paths])
            names = [f"{mode}_{temp}" for temp in ("warm", "cold") for mode in MODES]
            samplers = [batches.sampler(n.split("_")[0], n.endswith("cold")) for n in names]
            taken = take_turns(samplers, 1, rounds)
            counts = client.stats().result(10)["prestage"]
    out: dict[str, Any] = {
        "requests": REQUESTS,
        "prompt_tokens": prompt_tokens,
        "kv_bytes_per_request": PROMPT_CHUNKS * TTFT_CHUNK * BENCH.kv_bytes_per_token,
        "rounds": rounds,
        "cold_resident_bytes_max": max(batches.resident),  # 0 where dropping the page cache worked
        "prestage_counts": counts,
    }
    for name, samples in zip(names, taken, strict=True):
        out[name] = _figures(samples, batches.per_request[name])
    for temp in ("warm", "cold"):
        for mode in ("direct", "ahead"):
            out[f"total_{mode}_over_off_{temp}"] = round(
                out[f"{mode}_{temp}"]["total_ms"] / out[f"off_{temp}"]["total_ms"], 3
            )
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its figures."""
    parser = argparse.ArgumentParser(prog="python -m tools.prestage", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--rounds", type=int, default=3, help="samples of each case, taken in turn (>= 3)")
    args = parser.parse_args(argv)
    if args.rounds < 3:
        parser.error(f"--rounds must be at least 3 (a median with a spread), not {args.rounds}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    with tempfile.TemporaryDirectory(prefix="kvtier-prestage-") as tmp:
        os.environ.setdefault("VLLM_RPC_BASE_PATH", tmp)
        work = Path(tmp)
        result = bench_prestage(str(build_model(work / "bench", BENCH)), work, args.rounds)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
