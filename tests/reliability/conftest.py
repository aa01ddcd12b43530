"""Fixtures of the reliability tests: the tiny model, the no-connector oracle, restartable services.

Every test here fails if it leaves a kvtier process, socket or arena file behind (``leak_check``,
autouse for this package). Prompts come from ``prompt(group, j)``: a 200-token prefix shared by every
prompt of a group (three full 64-token chunks) and a tail of its own, so a later prompt of a group can
load the prefix from kvtier. Each test uses its own groups, so the oracle (the same engine, vLLM's
defaults, without a connector) is computed once per session for all of them.

vLLM's own prefix cache is on, as by default. A later prompt of a group would find the prefix there
and never ask kvtier, so a test empties vLLM's cache (``forget_local``) before each batch whose
prefixes must come from kvtier or be recomputed; prompts of different groups share no block, so
within a batch vLLM's cache serves nothing, which each test checks with ``local_hits``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from kvtier.app.embedded import probe
from kvtier.bench.harness import Outputs, generate, make_prompt, metric, running_engine
from kvtier.bench.introspect import scheduler_connector, worker_connector
from kvtier.bench.models import TINY, build_model
from kvtier.connector.stats import merge_counts
from kvtier.storage.base import NamespaceSpec, Tier
from tests.e2e.service import REPO, RunningService, stop_process
from tests.support.leak_check import kvtier_leak_session, leak_check, no_kvtier_leaks  # noqa: F401

CHUNK = 64
MAX_TOKENS = 12
PREFIX_LEN = 200  # three full chunks of 64; the prompt's tail keeps at least one token to compute
PREFIX_TOKENS = (PREFIX_LEN // CHUNK) * CHUNK
GROUPS = 48
TAILS = 5
SHORTS = 4
SHORT_MAX_TOKENS = 40  # a 40-token prompt plus 40 generated tokens fills one chunk while decoding
KICK = make_prompt(8900, 8)  # shorter than a block: vLLM caches none of it, kvtier never looks it up


def prompt(group: int, j: int) -> list[int]:
    """Prompt j of a prefix group: the group's shared 200-token prefix, then a tail of its own."""
    return make_prompt(7000 + group, PREFIX_LEN) + make_prompt(9000 + 97 * group + j, 20 + 3 * j + group % 4)


def batch(groups: Sequence[int], j: int) -> list[list[int]]:
    """Prompt j of each group."""
    return [prompt(g, j) for g in groups]


def short_prompts() -> list[list[int]]:
    """Prompts shorter than one chunk: no lookup is made for them; their decode fills a chunk."""
    return [make_prompt(8000 + i, 40) for i in range(SHORTS)]


class Oracle:
    """Greedy outputs of every test prompt on the same engine without any connector."""

    def __init__(self, outputs: dict[tuple[tuple[int, ...], int], list[int]]) -> None:
        self._outputs = outputs

    def __call__(self, prompts: Sequence[list[int]], max_tokens: int = MAX_TOKENS) -> Outputs:
        return Outputs([self._outputs[tuple(p), max_tokens] for p in prompts])


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Path of the tiny random-weight Llama, built once per session."""
    path: Path = tmp_path_factory.mktemp("models") / "tiny-llama"
    return str(build_model(path, TINY))


@pytest.fixture(scope="session")
def oracle(tiny_model: str) -> Oracle:
    """Outputs of every prompt(group, j) without kvtier, from one engine started once."""
    outputs: dict[tuple[tuple[int, ...], int], list[int]] = {}
    jobs = [([prompt(g, j) for g in range(GROUPS) for j in range(TAILS)], MAX_TOKENS)]
    jobs.append((short_prompts(), SHORT_MAX_TOKENS))
    with running_engine(tiny_model) as llm:
        for prompts, max_tokens in jobs:
            out = generate(llm, prompts, max_tokens)
            outputs.update({(tuple(p), max_tokens): t for p, t in zip(prompts, out.tokens, strict=True)})
    return Oracle(outputs)


# ----------------------------------------------------------------------------- vLLM's own cache
def forget_local(llm: Any, timeout: float = 30) -> None:
    """Empty vLLM's own prefix cache, so the next batch reuses a prefix only through kvtier.

    vLLM refuses while any block is in use, and kvtier holds a finished request's blocks until its
    saves end, which vLLM hears of on a later engine step: a one-token request steps the engine until
    vLLM agrees (which also proves that every block came back).
    """
    deadline = time.monotonic() + timeout
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise AssertionError(
                f"vLLM kept blocks in use for {timeout:.0f}s: its prefix cache cannot be reset"
            )
        generate(llm, [KICK], 1)


def local_hits(llm: Any) -> int:
    """Prompt tokens vLLM's own prefix cache has served in this engine (first admissions)."""
    return int(metric(llm, "vllm:prefix_cache_hits"))


def record_lookups(llm: Any) -> list[list[bytes]]:
    """From now on, the chunk hashes of every lookup the engine's connector starts, in order."""
    side = scheduler_connector(llm)._sched
    start = side._start_lookup
    seen: list[list[bytes]] = []

    def recording(st: Any, hashes: list[bytes], *args: Any, **kwargs: Any) -> Any:
        seen.append(list(hashes))
        return start(st, hashes, *args, **kwargs)

    side._start_lookup = recording
    return seen


@contextlib.contextmanager
def before_lookup(llm: Any, n: int, action: Callable[[], object]) -> Iterator[threading.Event]:
    """While the block runs, call action() on vLLM's scheduler thread right before the engine's
    connector starts its n-th lookup (counted from 1): a fault injected at a known point of a
    workload, not by a thread that races it. Yields an event set once action() has returned."""
    side = scheduler_connector(llm)._sched
    start = side._start_lookup
    started = itertools.count(1)
    done = threading.Event()

    def counted(*args: Any, **kwargs: Any) -> Any:
        if next(started) == n:
            action()
            done.set()
        return start(*args, **kwargs)

    side._start_lookup = counted
    try:
        yield done
    finally:
        side._start_lookup = start


# ----------------------------------------------------------------------------------- counters
def sched_counts(llm: Any) -> dict[str, Any]:
    """Scheduler-side connector counters since the engine started (reported and not yet reported)."""
    side = scheduler_connector(llm)._sched
    return merge_counts(side.totals, asdict(side.counters))


def worker_counts() -> dict[str, Any]:
    """Worker-side connector counters since the engine started (reported and not yet reported)."""
    side = worker_connector()._worker
    return merge_counts(side.totals, asdict(side.counters))


def delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """Counter increments between two readings."""
    return {k: after.get(k, 0) - before.get(k, 0) for k in after}


def wait_for(check: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll check() until it returns a truthy value; fail naming `what` after timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)


# ----------------------------------------------------------------------------------- services
class ServiceProc:
    """A standalone `python -m kvtier.app.server` on a fixed unix socket that can be killed and restarted.

    ``wrap`` prefixes the command (e.g. ``unshare`` to give the service a private mount namespace).
    Each incarnation appends to ``service.log`` in its directory.
    """

    def __init__(self, tmp: Path, wrap: Sequence[str] = (), **settings: Any) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.tmp = tmp
        self.sock = tmp / "kvtier.sock"
        self.url = f"unix://{self.sock}"
        self.wrap = list(wrap)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        env.update({"KVTIER_SHM_DIR": str(tmp), "KVTIER_CPU_SIZE": "64MiB", "PYTHONPATH": str(REPO)})
        env.update({f"KVTIER_{k.upper()}": str(v) for k, v in settings.items()})
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.svc: RunningService | None = None
        self.incarnations = 0

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> RunningService:
        """Start an incarnation and wait until it answers on the socket."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        with open(self.tmp / "service.log", "ab") as log:
            self.proc = subprocess.Popen(
                [*self.wrap, sys.executable, "-m", "kvtier.app.server", "--url", self.url],
                env=self.env,
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                cwd=REPO,
            )
        self.incarnations += 1
        proc = self.proc
        wait_for(lambda: probe(self.sock) or proc.poll() is not None, 30, f"service at {self.url}")
        if proc.poll() is not None:
            raise RuntimeError(f"service exited with {proc.returncode}: {self.log_tail()}")
        self.svc = RunningService(self.url, proc, self.tmp, self.env)
        return self.svc

    def kill(self) -> None:
        """SIGKILL the running incarnation (a crash: it cleans nothing up) and reap it."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self._close_client()

    def stop(self) -> None:
        """SIGTERM the running incarnation (graceful), SIGKILL if it hangs; idempotent."""
        self._close_client()
        if self.proc is not None:
            stop_process(self.proc)

    def _close_client(self) -> None:
        if self.svc is not None:
            self.svc.client.close()
            self.svc = None

    def log_tail(self) -> str:
        log = self.tmp / "service.log"
        return log.read_text(errors="replace")[-3000:] if log.exists() else ""


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A private directory on /dev/shm (tmpfs, as in production) for arenas; removed afterwards.

    Not the test's own folder: an arena on a disk filesystem is written back to the disk, and a
    busy disk then stalls the service that touches its pages (the service warns of it)."""
    path = Path(tempfile.mkdtemp(prefix="kvt-rel-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def services() -> Iterator[Callable[..., ServiceProc]]:
    """A factory of ServiceProc; every one is stopped when the test ends, however it ends."""
    made: list[ServiceProc] = []

    def make(tmp: Path, wrap: Sequence[str] = (), **settings: Any) -> ServiceProc:
        sp = ServiceProc(tmp, wrap, **settings)
        made.append(sp)
        return sp

    try:
        yield make
    finally:
        for sp in made:
            with contextlib.suppress(Exception):
                sp.stop()


def wait_quiet(svc: RunningService, timeout: float = 30) -> dict[str, Any]:
    """Wait until no lower-tier write is queued and no lease is held; returns the stats then."""

    def quiet() -> dict[str, Any] | None:
        stats = svc.stats()
        return stats if stats["write_queue_depth"] == 0 and stats["leases_active"] == 0 else None

    return wait_for(quiet, timeout, "the service to go quiet (no queued writes, no leases)")


def wait_settled(svc: RunningService, timeout: float = 10) -> dict[str, Any]:
    """Stats once no lease, no queued write and no slot beyond the stored chunks remain, or the last
    stats seen after timeout seconds (a leak then shows in them). Settling takes a moment: a reply
    the client gave up on is answered with an abort only after it arrives."""
    deadline = time.monotonic() + timeout
    while True:
        stats = svc.stats()
        leaked = stats["slots_in_use"] - stats["tiers"]["cpu"]["chunks"]
        if (not stats["leases_active"] and not stats["write_queue_depth"] and not leaked) or (
            time.monotonic() > deadline
        ):
            return stats
        time.sleep(0.05)


def wait_stored(svc: RunningService, tier: str, stores: int, timeout: float = 30) -> dict[str, Any]:
    """Wait until `tier` has counted at least `stores` stores and the write queue is empty."""

    def done() -> dict[str, Any] | None:
        stats = svc.stats()
        ok = stats["write_queue_depth"] == 0 and stats["tiers"][tier]["stores"] >= stores
        return stats if ok else None

    try:
        return wait_for(done, timeout, f"{stores} stores in the {tier} tier")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {svc.stats()}") from None


PROBE_SPEC = NamespaceSpec(
    model="kvtier-reliability-probe", kv_dtype="none", kv_layout="none", block_size=1, chunk_size=1,
    num_layers=1, page_bytes=4096,
)  # fmt: skip


def redis_ready(svc: RunningService, timeout: float = 15) -> None:
    """Wait until the service's Redis tier answers again.

    A first connection that fails (a slow connect on a busy machine, or Redis just restarted) opens
    the tier's breaker, and writes refused meanwhile are dropped for good (a cache is best effort),
    so a test that counts stores waits for this first. Each try is a real lookup of an absent chunk
    in a namespace of its own, which asks Redis once the breaker lets a probe through.
    """
    namespace = svc.client.hello(PROBE_SPEC).result(10).namespace

    def answered() -> bool:
        svc.client.lookup(namespace, [os.urandom(32)], "reliability-probe").result(10)
        return bool(svc.stats()["tiers"]["redis"]["healthy"])

    try:
        wait_for(answered, timeout, "the Redis tier to answer lookups")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; its stats: {svc.stats()['tiers']['redis']}") from None


def clear_cpu(svc: RunningService) -> None:
    """Empty the CPU tier (after queued writes are done), so the next lookups go to lower tiers."""
    wait_quiet(svc)
    svc.clear(Tier.CPU)
    cpu = svc.stats()["tiers"]["cpu"]
    assert cpu["chunks"] == 0, f"the CPU tier kept chunks after clear: {cpu}"
