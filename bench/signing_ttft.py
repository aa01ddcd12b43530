"""`kvtier bench signing --ttft`: what signing the shared tiers costs a user's time to first token.

Two engines with kvtier (the BENCH model, prompts of 1537 tokens: a full hit loads 24 MiB), in
processes of their own and up side by side, each against a service of its own: ``unsigned`` without
``tier_key``, ``signed`` with one. Each service has its own disk directory and redis-server and an
object prefix of its own on one SeaweedFS (where weed is installed). Both engines store the same
prompts, then take turns, prompt by prompt and round by round, which engine goes first alternating:
a Redis hit (vLLM's cache reset, CPU and disk tiers emptied) and vLLM's own prefix-cache hit of the
same prompt (the ceiling); then, all rounds again, the same for object hits (CPU, disk and Redis
emptied first, so they come after every Redis hit). Every hit is checked to have loaded all its
tokens from that tier, so a refused (forged) chunk cannot pass for a fast hit.

Figures per tier: ``ttft_ratio`` = the signed engine's median hit over the unsigned one's
(``ttft_ratio_paired``: the median of each turn's signed hit over the unsigned hit taken beside it);
``ceiling_ratio`` = the same for their ceilings (how much the two engines differ with no kvtier load
at all); ``load_ratio`` = (hit - ceiling) signed over unsigned, medians of the per-turn differences:
what the load itself took.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from kvtier.bench import hit_floors
from kvtier.bench.engine_proc import ChildEngine, kvtier_bypassed
from kvtier.bench.environ import environment
from kvtier.bench.harness import generate_each, kv_transfer_config, make_prompt, running_engine
from kvtier.bench.hit_object import wait_uploaded
from kvtier.bench.models import BENCH, build_model
from kvtier.bench.progress import note
from kvtier.bench.seaweed import ObjectStore, bench_credentials, seaweed_server
from kvtier.bench.services import check_hits, hit_tokens, kvtier_service, off_the_model_core, redis_server
from kvtier.bench.ttft import TTFT_CHUNK, warm_up_prompts
from kvtier.storage.base import Tier

VARIANTS = ("unsigned", "signed")
ENGINE = dict(enable_prefix_caching=True, max_model_len=4096, kv_cache_memory_bytes=512 << 20)
START_TIMEOUT_S = 900.0
SAMPLE_TIMEOUT_S = 120.0
_ABOVE = {"redis": ("cpu", "disk"), "object": ("cpu", "disk", "redis")}  # tiers emptied before a hit


def _serve(conn: Connection, model: str, url: str, disk: str, prompts: list[list[int]], objects: bool,
           cpus: frozenset[int], warm_up: bool) -> None:  # fmt: skip
    """The child: an engine with kvtier stores the prompts, then answers ("hit", i, tier) and
    ("ceiling", i) with seconds until None."""
    from kvtier.app.client import ServiceClient
    from kvtier.runtime.affinity import run_on

    try:
        os.dup2(2, 1)  # vLLM logs to stdout: keep the parent's stdout (its --json output) clean
        run_on(cpus)
        tiers = {t.label: t for t in Tier}
        chunks = len(prompts[0]) // TTFT_CHUNK
        kv = kv_transfer_config(service_url=url, chunk_size=TTFT_CHUNK)
        with running_engine(model, kv, **ENGINE) as llm, ServiceClient(url) as client:
            client.wait_connected(10)
            count = warm_up_prompts(ENGINE, len(prompts[0])) if warm_up else 0
            warm = [make_prompt(600_000 + i, len(prompts[0])) for i in range(count)]
            with kvtier_bypassed(llm):  # warmed with nothing stored
                generate_each(llm, warm, 1)
            hit_floors.reset_vllm_cache(llm)
            _, files = hit_floors.store_prompts(llm, client, prompts, Path(disk), chunks)
            if objects:
                wait_uploaded(client, len(prompts) * chunks)
            bench = hit_floors.HitBench(llm, client, prompts, files, chunks * TTFT_CHUNK)
            conn.send(("ready", None))
            while (request := conn.recv()) is not None:
                kind, i, tier = request
                if kind == "ceiling":
                    conn.send(("seconds", bench.ceiling(i)))
                    continue
                before = hit_tokens(client)
                took = bench.hit(i, [tiers[name] for name in _ABOVE[tier]])
                check_hits(client, before, tier, bench.loaded_tokens)
                conn.send(("seconds", took))
    except BaseException:  # reported to the parent, which raises it
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


class HitEngine(ChildEngine):
    """An engine with kvtier in a spawned child that stored the prompts; ``hit`` and ``ceiling``
    time one prompt there."""

    start_timeout_s = START_TIMEOUT_S  # it also stores every prompt before it answers
    sample_timeout_s = SAMPLE_TIMEOUT_S

    def __init__(self, *args: Any) -> None:
        super().__init__(_serve, *args)

    def hit(self, i: int, tier: str) -> float:
        """Seconds of a hit of prompt i from tier (the tiers above it emptied first)."""
        return float(self.ask(("hit", i, tier)))

    def ceiling(self, i: int) -> float:
        """Seconds of vLLM's own hit of prompt i."""
        return float(self.ask(("ceiling", i, "")))


def _figures(samples: dict[tuple[str, str, str], list[float]], tiers: list[str]) -> dict[str, Any]:
    """Per tier: each variant's median hit and ceiling (ms) and the signed / unsigned ratios."""
    out: dict[str, Any] = {}
    for tier in tiers:
        ms = {
            (v, k): 1000 * statistics.median(samples[(v, tier, k)])
            for v in VARIANTS
            for k in ("hit", "ceiling")
        }
        loads = {
            v: statistics.median(
                h - c for h, c in zip(samples[(v, tier, "hit")], samples[(v, tier, "ceiling")], strict=True)
            )
            for v in VARIANTS
        }
        out[tier] = {
            **{f"{v}_{k}_ms": round(value, 2) for (v, k), value in ms.items()},
            "ttft_ratio": round(ms[("signed", "hit")] / ms[("unsigned", "hit")], 3),
            # Each turn's two hits ran back to back: their ratio sees the least drift of the machine.
            "ttft_ratio_paired": round(
                statistics.median(
                    s / u
                    for s, u in zip(
                        samples[("signed", tier, "hit")], samples[("unsigned", tier, "hit")], strict=True
                    )
                ),
                3,
            ),
            "ceiling_ratio": round(ms[("signed", "ceiling")] / ms[("unsigned", "ceiling")], 3),
            "load_ratio": round(loads["signed"] / loads["unsigned"], 3) if loads["unsigned"] > 0 else None,
            "samples": len(samples[("signed", tier, "hit")]),
        }
    return out


@contextlib.contextmanager
def _services(tmp: Path, store: ObjectStore | None) -> Iterator[dict[str, str]]:
    """Each variant's service URL: its own disk directory and redis-server, and object prefix."""
    with contextlib.ExitStack() as stack:
        urls = {}
        for variant in VARIANTS:
            redis_url = stack.enter_context(redis_server(tmp))
            if redis_url is None:
                raise RuntimeError("redis-server is not installed: the signed tiers cannot be measured")
            # A Redis call of over 1 s (the default timeout) trips the tier's breaker and the rest of
            # a hit comes from the object tier, which the hit check would then refuse.
            settings: dict[str, Any] = {
                "disk_path": tmp / f"disk-{variant}", "redis_url": redis_url, "redis_timeout": 5.0,
            }  # fmt: skip
            if store is not None:
                settings.update(object_url=store.url(variant), object_endpoint=store.endpoint)
            if variant == "signed":
                settings["tier_key"] = os.urandom(32).hex()
            urls[variant] = stack.enter_context(kvtier_service(tmp / f"svc-{variant}", **settings))
        yield urls


def measure(rounds: int = 3, prompts_each: int = 5, warm: bool = True) -> dict[str, Any]:
    """Both engines' Redis and object hits in turn; the figures (see the module's docstring).
    warm=False skips the engines' warm-up (a smoke test's figures are not to be reported)."""
    from kvtier.runtime.affinity import engine_cpus

    wanted = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "THP_MEM_ALLOC_ENABLE": "1"}
    wanted["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"  # stdout is the report's
    prompts = [make_prompt(9000 + i, 6 * TTFT_CHUNK + 1) for i in range(prompts_each)]
    cpus = engine_cpus()
    with (
        # Put back on the way out: a caller (the tests run it in their own process) keeps its own.
        environment({k: v for k, v in wanted.items() if k not in os.environ}),
        tempfile.TemporaryDirectory(prefix="kvtier-bench-signing-") as name,
        seaweed_server(preexec_fn=off_the_model_core()) as store,
        bench_credentials() if store else contextlib.nullcontext(),
    ):
        tmp = Path(name)
        model = str(build_model(tmp / "bench", BENCH))
        tiers = ["redis", "object"] if store else ["redis"]
        with _services(tmp, store) as urls, contextlib.ExitStack() as stack:
            note(
                "  signing TTFT: two engines with kvtier (unsigned, signed) starting and storing the prompts"
            )
            engines = {
                v: stack.enter_context(
                    HitEngine(model, urls[v], str(tmp / f"disk-{v}"), prompts, store is not None, cpus, warm)
                )
                for v in VARIANTS
            }
            for engine in engines.values():
                engine.wait_ready()
            samples: dict[tuple[str, str, str], list[float]] = {
                (v, t, k): [] for v in VARIANTS for t in tiers for k in ("hit", "ceiling")
            }
            turn = 0
            for tier in tiers:  # Redis first: an object hit empties Redis (and disk and CPU) first
                for i in [i for _ in range(rounds) for i in range(len(prompts))]:
                    order = VARIANTS if turn % 2 == 0 else VARIANTS[::-1]
                    turn += 1
                    for v in order:
                        samples[(v, tier, "hit")].append(engines[v].hit(i, tier))
                        samples[(v, tier, "ceiling")].append(engines[v].ceiling(i))
    result: dict[str, Any] = {"rounds": rounds, "prompts": len(prompts), "object_tier": store is not None}
    result.update(_figures(samples, tiers))
    result["ttft_ratio"] = {tier: result[tier]["ttft_ratio"] for tier in tiers}
    return result
