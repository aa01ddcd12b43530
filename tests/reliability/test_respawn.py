"""The embedded service SIGKILLed again and again under load through vLLM's OpenAI server, with vLLM's
own process layout: the scheduler in the engine core process, each rank's worker in a process of its
own, bound by vLLM to the core it computes on.

Whichever process of the engine notices the death first restarts the service. Each test makes one
side win that race by stopping (SIGSTOP) every other process of the engine until the new service
serves: the worker, the engine core, or either worker of a TP=2 engine. Each kill must be followed by
a service that the winner started and that serves within RESPAWN_BOUND_S; no request may fail; and
after the last kill a prompt stored through the new service loads exactly its whole chunks from it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench.harness import kv_transfer_config, make_prompt
from tests.reliability.conftest import wait_for
from tests.reliability.openai_load import (
    SERVED_NAME,
    OpenAIServer,
    admin_stats,
    alive,
    cmdline,
    free_port,
    http_get,
    launch,
    make_requests,
    metric_total,
    service_pids,
    stop,
    wait_ready,
)
from tests.support.leak_check import descendants
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.e2e

CHUNK = 64
KILLS = 3
RESPAWNS = "vllm:kvtier_service_respawns_total"  # respawns that brought a serving service up
RESPAWN_BOUND_S = 20.0  # a liveness bound: a service that never serves again fails here, not later
CONCURRENCY = 4
MAX_TOKENS = 8
PROBE = make_prompt(4242, 4 * CHUNK + 10)  # shares no block with the load: four whole chunks
PROBE_ROUNDS = 3
EXTERNAL = "vllm:kvtier_external_tokens_total"
SERVER_ARGS = ["--max-model-len", "512", "--kv-cache-memory-bytes", str(64 << 20)]
# vLLM's reset endpoint (POST /reset_prefix_cache) exists only in its development mode.
DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


@dataclass
class Load:
    """Completions sent from CONCURRENCY threads until stopped; answers and failures counted."""

    server: OpenAIServer
    done: int = 0
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _client(self, index: int) -> None:
        requests = make_requests(400, seed=31 + index)
        for n in range(len(requests) * 10):
            if self._stop.is_set():
                return
            body = {
                "model": SERVED_NAME,
                "prompt": requests[n % len(requests)][1],
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            }
            try:
                self.server.post("/v1/completions", body)
            except Exception as exc:
                with self._lock:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
            else:
                with self._lock:
                    self.done += 1

    @contextlib.contextmanager
    def running(self) -> Iterator[Load]:
        """The load runs inside the block; leaving it stops the clients and waits for them."""
        threads = [threading.Thread(target=self._client, args=(i,)) for i in range(CONCURRENCY)]
        for thread in threads:
            thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            for thread in threads:
                thread.join()

    def progressed(self, since: int, by: int) -> bool:
        """True once `by` more requests were answered than `since`."""
        with self._lock:
            return self.done >= since + by


def _engine_processes(server: OpenAIServer) -> tuple[int, list[int]]:
    """(the engine core's pid, the workers' pids in start order) below the API server."""
    core, workers = 0, []
    for pid in sorted(descendants(server.proc.pid)):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if comm.startswith("VLLM::EngineCor"):
            core = pid
        elif comm.startswith("VLLM::Worker"):
            workers.append(pid)
    assert core and workers, f"vLLM's engine core and workers below {server.proc.pid}"
    return core, workers


def _spawner(service: int) -> int:
    """The pid of the engine process that started this service (its --parent-pid)."""
    args = cmdline(service).split()
    return int(args[args.index("--parent-pid") + 1])


def _serving(admin: int) -> bool:
    try:
        return http_get(admin, "/health", timeout=2)[0] == 200
    except OSError:
        return False


def _kill_and_respawn(server: OpenAIServer, admin: int, winner: int, others: Sequence[int]) -> float:
    """SIGKILL the engine's service while every process but `winner` is stopped; the seconds until a
    service that `winner` started serves."""
    (old,) = service_pids(server.proc.pid)
    respawns = metric_total(server.metrics(), RESPAWNS)
    for pid in others:
        os.kill(pid, signal.SIGSTOP)
    try:
        os.kill(old, signal.SIGKILL)
        killed = time.monotonic()

        def respawned() -> int:
            new = service_pids(server.proc.pid) - {old}
            return next(iter(new)) if len(new) == 1 and _serving(admin) else 0

        new = wait_for(respawned, RESPAWN_BOUND_S, f"a service restarted by process {winner}")
        elapsed = time.monotonic() - killed
    finally:
        for pid in others:
            os.kill(pid, signal.SIGCONT)
    assert not alive(old)
    assert _spawner(new) == winner, f"service {new} was started by {_spawner(new)}, not {winner}"
    # The winner counts its respawn once its own probe sees the service: until then the next kill
    # would land in the middle of this respawn's start, a different case.
    counted = lambda: metric_total(server.metrics(), RESPAWNS) > respawns  # noqa: E731
    wait_for(counted, 60, "the winner to count its respawn")
    return elapsed


def _reset_prefix_cache(server: OpenAIServer) -> None:
    """Empty vLLM's own prefix cache (refused while blocks are in use: asked again until it agrees)."""
    wait_for(lambda: server.post("/reset_prefix_cache", {})["success"], 60, "vLLM's prefix cache to reset")


def _probe_hits(server: OpenAIServer, admin: int) -> tuple[list[float], list[list[int]]]:
    """Store PROBE through the service, empty vLLM's own cache, ask again; once more while nothing
    was loaded, at most PROBE_ROUNDS times: (external tokens of each round's second answer, every
    answer). A rank whose worker is still mapping the new service's arena skips that step's saves,
    and every rank must hold a chunk for it to be a hit, so the first round may find nothing yet
    (seen on a TP=2 engine whose two workers keep both cores busy)."""
    body = {"model": SERVED_NAME, "prompt": PROBE, "max_tokens": MAX_TOKENS, "temperature": 0}
    body["return_token_ids"] = True

    def quiet() -> bool:
        stats = admin_stats(admin)
        return bool(stats["leases_active"] == 0 and stats["write_queue_depth"] == 0)

    hits: list[float] = []
    answers: list[list[int]] = []
    while len(hits) < PROBE_ROUNDS and not any(hits):
        answers.append(server.post("/v1/completions", body)["choices"][0]["token_ids"])
        wait_for(quiet, 60, "the service to finish the probe's saves")
        _reset_prefix_cache(server)
        before = metric_total(server.metrics(), EXTERNAL)
        answers.append(server.post("/v1/completions", body)["choices"][0]["token_ids"])
        hits.append(metric_total(server.metrics(), EXTERNAL) - before)
    return hits, answers


def _run_kills(
    tmp_path: Path,
    shm: Path,
    model: str,
    tiers: dict[str, Any],
    choose: Any,
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> None:
    """Start the server, kill its service KILLS times under load, each time letting choose(core,
    workers, k) -> (winner, others) win; then check the requests and the probe's hit."""
    admin = free_port()
    kv = kv_transfer_config(chunk_size=CHUNK, cpu_size="16MiB", shm_dir=str(shm), admin_port=admin, **tiers)
    server = launch(model, tmp_path, "respawn", [*SERVER_ARGS, *extra], kv, {**DEV_MODE, **(env or {})})
    try:
        wait_ready(server)
        core, workers = _engine_processes(server)
        times = []
        with Load(server).running() as load:
            for k in range(KILLS):
                done = load.done  # each kill lands on a load that ran on since the last restart
                wait_for(lambda done=done: load.progressed(done, 4), 120, "the load to make progress")
                winner, others = choose(core, workers, k)
                times.append(_kill_and_respawn(server, admin, winner, others))
            # Saves reach the last service before the probe relies on them.
            wait_for(
                lambda: admin_stats(admin)["tiers"]["cpu"]["chunks"] > 0, 120, "a save in the new service"
            )
            done = load.done
            wait_for(lambda: load.progressed(done, 4), 120, "the load to go on after the last restart")
        hits, answers = _probe_hits(server, admin)
        respawns = metric_total(server.metrics(), RESPAWNS)
        failures = metric_total(server.metrics(), "vllm:kvtier_service_respawn_failures_total")
    finally:
        stop(server)
    assert not load.errors, f"{len(load.errors)} requests failed: {load.errors[:3]}"
    assert len(times) == KILLS, times
    assert hits[-1] == 4 * CHUNK and not any(hits[:-1]), f"the probe's rounds loaded {hits} tokens"
    assert all(a == answers[0] for a in answers), "the probe's answer changed when its KV came from kvtier"
    assert (respawns, failures) == (KILLS, 0), f"vLLM's metrics count {respawns} respawns, {failures} failed"


def test_the_worker_wins_the_respawn_race_with_a_disk_tier(
    tiny_model: str, tmp_path: Path, shm_dir: Path
) -> None:
    def worker_wins(core: int, workers: list[int], k: int) -> tuple[int, list[int]]:
        return workers[0], [core]

    _run_kills(tmp_path, shm_dir, tiny_model, {"disk_path": str(tmp_path / "disk")}, worker_wins)


def test_the_engine_core_wins_the_respawn_race_with_a_redis_tier(
    tiny_model: str, tmp_path: Path, shm_dir: Path, redis_server: RedisServer
) -> None:
    def core_wins(core: int, workers: list[int], k: int) -> tuple[int, list[int]]:
        return core, workers

    _run_kills(tmp_path, shm_dir, tiny_model, {"redis_url": redis_server.url}, core_wins)


def test_either_worker_of_a_tp2_engine_wins_with_disk_and_redis_tiers(
    tiny_model: str, tmp_path: Path, shm_dir: Path, redis_server: RedisServer
) -> None:
    def next_worker_wins(core: int, workers: list[int], k: int) -> tuple[int, list[int]]:
        assert len(workers) == 2, workers
        winner = workers[k % 2]
        return winner, [core, *(w for w in workers if w != winner)]

    tiers = {"disk_path": str(tmp_path / "disk"), "redis_url": redis_server.url}
    tp2 = ["--tensor-parallel-size", "2"]
    _run_kills(tmp_path, shm_dir, tiny_model, tiers, next_worker_wins, tp2, TP2_ENV)
