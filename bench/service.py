"""Benchmark of the kvtier service: `kvtier bench service [--json]` or `python -m kvtier.bench.service`.

Round trips of a 64-chunk ``lookup`` (all hits) and of a 64-chunk ``reserve`` + ``commit``, made by 8
client processes in parallel through ``ServiceClient`` (what the connector uses), each as a ratio to a
bare asyncio unix-socket echo of the same frame sizes measured in the same run with the same number
of clients (the echo server runs on the same event loop implementation as the service). Echo and
service clients take turns, echo first and last (``ALTERNATIONS`` turns of service clients), and each
side's percentiles pool all of its turns.

Lookups are made as the connector makes them, in two phases: ``lookup``, the lookup a waiting
request repeats every step, which takes a new lease and ends the request's previous one in the same
call (``replaces``); and ``lookup_fresh``, the first lookup of a new request, which takes a lease of
its own, with the release of an earlier request's lease (``release``, no reply) riding along.
The fresh lookups alternate between two stored prompts, so the lease a lookup ends never holds the
chunks it finds (its pins cannot just move over, as they do for a repeated lookup).

It also reports the service's RSS without the arena (VmRSS - RssShmem) during its rounds of 15,000
lookups and commits (two per turn) and after each: growth from the first round to the last would be
a leak.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

CHUNKS = 64
HASH_BYTES = 32
SPEC = {
    "model": "bench",
    "kv_dtype": "bfloat16",
    "kv_layout": "NHD",
    "block_size": 16,
    "chunk_size": 256,
    "num_layers": 4,
    "page_bytes": 2048,
}


@dataclass(frozen=True)
class Plan:
    """What each client does."""

    url: str
    rounds: int
    ops: int  # lookups and reserve+commits per client per round
    warmup: int
    timeout: float = 30.0


# ------------------------------------------------------------------------------ echo reference
class _EchoServer(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Keep the transport."""
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        """Send it back."""
        self.transport.write(data)  # type: ignore[attr-defined]


def _echo_server(path: str) -> None:
    from kvtier.runtime.event_loop import new_event_loop

    loop = new_event_loop()
    server = loop.run_until_complete(loop.create_unix_server(_EchoServer, path))
    try:
        loop.run_forever()
    finally:
        server.close()
        loop.close()


class _EchoClient(asyncio.Protocol):
    def __init__(self) -> None:
        self.waiter: asyncio.Future[None] | None = None
        self.want = 0
        self.got = 0

    def data_received(self, data: bytes) -> None:
        """Count; wake the waiter once the whole echo is back."""
        self.got += len(data)
        if self.got >= self.want and self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


def _frame_sizes() -> dict[str, int]:
    """Bytes on the wire of the requests the service clients send."""
    from kvtier.app import protocol as p
    from kvtier.storage.base import SlotRef

    enc = p.FrameEncoder()
    hashes = [os.urandom(HASH_BYTES) for _ in range(CHUNKS)]
    slots = [SlotRef(i * 131072, 131072) for i in range(CHUNKS)]
    ns, iid = "0" * 16, "0" * 16
    return {
        "lookup": len(enc.encode(p.Lookup(id=1 << 20, namespace=ns, hashes=hashes, lease_id="b-7"))),
        "reserve": len(enc.encode(p.Reserve(id=1 << 20, namespace=ns, hashes=hashes))),
        "commit": len(
            enc.encode(p.Commit(id=1 << 20, namespace=ns, hashes=hashes, slots=slots, instance_id=iid))
        ),
        "health": len(enc.encode(p.Health(id=1 << 20))),
    }


PHASES = ("lookup", "lookup_fresh", "commit", "health")


def _echo_run(path: str, plan: Plan, barrier: Any, out: Any) -> None:
    from kvtier.runtime.event_loop import new_event_loop

    sizes = _frame_sizes()
    loop = new_event_loop()

    async def run() -> list[dict[str, list[float]]]:
        proto = _EchoClient()
        transport, _ = await loop.create_unix_connection(lambda: proto, path)

        async def rtt(*frame_sizes: int) -> float:
            t0 = time.perf_counter()
            for size in frame_sizes:
                proto.want, proto.got = size, 0
                proto.waiter = loop.create_future()
                transport.write(b"x" * size)
                await proto.waiter
            return time.perf_counter() - t0

        calls = {
            "lookup": (sizes["lookup"],),
            "lookup_fresh": (sizes["lookup"],),
            "commit": (sizes["reserve"], sizes["commit"]),
            "health": (sizes["health"],),
        }
        for _ in range(plan.warmup):
            await rtt(sizes["lookup"])
        rounds = []
        for _ in range(plan.rounds):
            samples: dict[str, list[float]] = {}
            for phase in PHASES:
                await loop.run_in_executor(None, barrier.wait)
                samples[phase] = [await rtt(*calls[phase]) for _ in range(plan.ops)]
            await loop.run_in_executor(None, barrier.wait)
            rounds.append(samples)
        transport.close()
        return rounds

    try:
        out.put(loop.run_until_complete(run()))
    finally:
        loop.close()


# ------------------------------------------------------------------------------ service clients
class _Calls:
    """One client process's measured calls, each returning the seconds it took. The lease on the
    repeated lookups' prompt is held between phases."""

    def __init__(self, client: Any, ns: str, timeout: float) -> None:
        self.client, self.ns, self.timeout = client, ns, timeout
        self._seq = itertools.count()
        self.lease = self._new_lease()  # the lease on the prompt now
        self.prompts = [[os.urandom(HASH_BYTES) for _ in range(CHUNKS)] for _ in range(2)]
        self.prompt = self.prompts[0]  # the repeated lookups' prompt
        self._fresh_seq = itertools.count(1)

    def _new_lease(self) -> str:
        return f"bench-{os.getpid()}-{next(self._seq)}"

    def lookup(self) -> float:
        """As the connector does for a request that waits: every lookup takes a new lease id and ends
        the previous lease in the same call."""
        new = self._new_lease()
        t0 = time.perf_counter()
        reply = self.client.lookup(self.ns, self.prompt, new, replaces=self.lease).result(self.timeout)
        took = time.perf_counter() - t0
        self.lease = new
        if reply.result.num_hit != CHUNKS:  # the lease keeps the prompt from eviction
            raise RuntimeError(f"lookup found {reply.result.num_hit} of {CHUNKS} chunks")
        return took

    def lookup_fresh(self) -> float:
        """As the connector does for a new request: a lease of its own, and a finished request's lease
        released with no answer asked for (sent along with the next call)."""
        new = self._new_lease()
        other = self.prompts[next(self._fresh_seq) % 2]  # not the prompt that the lease it ends holds
        t0 = time.perf_counter()
        reply = self.client.lookup(self.ns, other, new).result(self.timeout)
        took = time.perf_counter() - t0
        self.client.release(self.lease)
        self.lease = new
        if reply.result.num_hit != CHUNKS:
            raise RuntimeError(f"lookup found {reply.result.num_hit} of {CHUNKS} chunks")
        return took

    def commit(self) -> float:
        """Reserve, write and commit a prompt of new chunks."""
        fresh = [os.urandom(HASH_BYTES) for _ in range(CHUNKS)]
        t0 = time.perf_counter()
        _save(self.client, self.ns, fresh, self.timeout)
        return time.perf_counter() - t0

    def health(self) -> float:
        """One health call."""
        t0 = time.perf_counter()
        self.client.health().result(self.timeout)
        return time.perf_counter() - t0

    def restore(self) -> None:
        """Store the prompts again (unmeasured) so every measured lookup is a 64-chunk hit: the commit
        phase evicts unleased chunks, and one longer than lease_ttl lets the lease expire."""
        for stored in self.prompts:
            _save(self.client, self.ns, stored, self.timeout)  # only the chunks not stored are written
        if self.client.lookup(self.ns, self.prompt, self.lease).result(self.timeout).result.num_hit != CHUNKS:
            raise RuntimeError("the prompt stored just now was evicted: give the arena more room")


def _service_run(plan: Plan, barrier: Any, out: Any) -> None:
    from kvtier.app.client import ServiceClient
    from kvtier.storage.base import NamespaceSpec

    spec = NamespaceSpec(**SPEC)  # type: ignore[arg-type]
    with ServiceClient(plan.url, timeout=plan.timeout) as client:
        ns = client.hello(spec).result(plan.timeout).namespace
        calls = _Calls(client, ns, plan.timeout)
        by_phase = {"lookup": calls.lookup, "lookup_fresh": calls.lookup_fresh, "commit": calls.commit,
                    "health": calls.health}  # fmt: skip
        rounds = []
        for _ in range(plan.rounds):
            calls.restore()
            for _ in range(plan.warmup):
                calls.lookup()
            samples: dict[str, list[float]] = {}
            for phase in PHASES:
                barrier.wait()
                samples[phase] = [by_phase[phase]() for _ in range(plan.ops)]
            barrier.wait()
            rounds.append(samples)
        client.release(calls.lease)
    out.put(rounds)


def _save(client: Any, ns: str, hashes: list[bytes], timeout: float) -> None:
    reply = client.reserve(ns, hashes).result(timeout)
    pairs = [(h, s) for h, s in zip(hashes, reply.slots, strict=True) if s is not None]
    if pairs:
        client.commit(ns, [h for h, _ in pairs], [s for _, s in pairs], reply.instance_id).result(timeout)


def _echo_worker(path: str, plan: Plan, barrier: Any, out: Any) -> None:
    """One echo client process."""
    _guarded(_echo_run, (path, plan, barrier, out), barrier)


def _service_worker(plan: Plan, barrier: Any, out: Any) -> None:
    """One service client process."""
    _guarded(_service_run, (plan, barrier, out), barrier)


def _guarded(fn: Any, args: tuple[Any, ...], barrier: Any) -> None:
    try:
        fn(*args)
    except BaseException:
        barrier.abort()  # the others (and the parent) stop waiting at once
        raise


# ------------------------------------------------------------------------------ measurement
def _rss_no_shmem(pid: int) -> float:
    """MiB resident, not counting shared memory (the arena)."""
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssShmem"):
                fields[key] = int(rest.split()[0])
    return (fields.get("VmRSS", 0) - fields.get("RssShmem", 0)) / 1024


class _Sampler(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop = pid, 0.0, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.02):
            try:
                self.peak = max(self.peak, _rss_no_shmem(self.pid))
            except OSError:
                return


def _run_clients(target: Any, args: tuple[Any, ...], plan: Plan, n: int, pid: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(n + 1)
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, plan, barrier, out)) for _ in range(n)]
    for proc in procs:
        proc.start()
    sampler = _Sampler(pid) if pid else None
    rss_after: list[float] = []
    try:
        for _ in range(plan.rounds):
            barrier.wait(timeout=120)
            if sampler is not None and not sampler.is_alive():
                sampler.start()
            for _phase in PHASES:
                barrier.wait(timeout=600)
            if pid:
                time.sleep(0.2)
                rss_after.append(_rss_no_shmem(pid))
        results = [out.get(timeout=60) for _ in procs]
    finally:
        if sampler is not None:
            sampler.stop.set()
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return {"results": results, "rss_after": rss_after, "peak": sampler.peak if sampler else 0.0}


def _pcts(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    q = statistics.quantiles(ordered, n=100, method="inclusive")
    return q[49] * 1e6, q[98] * 1e6


def _merge(results: list[Any], phase: str) -> list[float]:
    return [x for rounds in results for rnd in rounds for x in rnd[phase]]


def _service_seconds(url: str) -> dict[str, Any]:
    from kvtier.app.client import ServiceClient

    with ServiceClient(url) as client:
        stats: dict[str, Any] = client.stats().result(30)
    return dict(stats.get("service_seconds", {}))


def _start_service(url: str, cpu_size: str) -> subprocess.Popen[bytes]:
    # The arena goes where the settings say (default /dev/shm): on tmpfs it counts as RssShmem.
    env = dict(os.environ, KVTIER_CPU_SIZE=cpu_size, KVTIER_LOG_LEVEL="WARNING")
    env.pop("KVTIER_SERVICE_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.app.server", "--url", url], env=env)
    _wait_socket(url.removeprefix("unix://"), proc)
    return proc


def _wait_socket(path: str, proc: subprocess.Popen[bytes] | BaseProcess) -> None:
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        alive = proc.poll() is None if isinstance(proc, subprocess.Popen) else proc.is_alive()
        if not alive or time.monotonic() > deadline:
            raise RuntimeError(f"server for {path} did not start")
        time.sleep(0.02)


ALTERNATIONS = 3


def measure(
    clients: int = 8,
    ops: int = 625,
    rounds: int = 2,
    cpu_size: str = "256MiB",
    alternations: int = ALTERNATIONS,
) -> dict:
    """Run the benchmark and return its figures (see the module docstring)."""
    if alternations < 1:
        raise ValueError(f"alternations must be at least 1, not {alternations}")
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as workdir:
        echo_path = str(Path(workdir) / "echo.sock")
        echo = mp.get_context("spawn").Process(target=_echo_server, args=(echo_path,), daemon=True)
        echo.start()
        url = f"unix://{workdir}/svc.sock"
        service = None
        try:
            _wait_socket(echo_path, echo)
            plan = Plan(url=url, rounds=rounds, ops=ops, warmup=50)
            # Echo and service clients take turns, echo first and last, each turn with client
            # processes of its own: one set of 8 processes on 2 cores settles into its own
            # schedule, and a p50 from one set moved by up to 1.7x from the next (echo 48-85 us in
            # one run), so each side pools several sets.
            echo_results = _run_clients(_echo_worker, (echo_path,), plan, clients, 0)["results"]
            service = _start_service(url, cpu_size)
            got: dict[str, Any] = {"results": [], "rss_after": [], "peak": 0.0}
            for _ in range(alternations):
                turn = _run_clients(_service_worker, (), plan, clients, service.pid)
                got["results"] += turn["results"]
                got["rss_after"] += turn["rss_after"]
                got["peak"] = max(got["peak"], turn["peak"])
                echo_results += _run_clients(_echo_worker, (echo_path,), plan, clients, 0)["results"]
            got["inside"] = _service_seconds(url)
        finally:
            if service is not None:
                service.terminate()
                service.wait(timeout=30)
            echo.terminate()
            echo.join(timeout=10)
    fig = _report(got, echo_results, clients, ops, rounds)
    fig["alternations"] = alternations
    return fig


def _report(got: dict, echo_results: list, clients: int, ops: int, rounds: int) -> dict:
    fig: dict[str, Any] = {
        "clients": clients,
        "lookups_and_commits_per_round": clients * ops * 3,
        "rounds": rounds,
        "chunks_per_call": CHUNKS,
        "frame_bytes": _frame_sizes(),
        "event_loop": _loop_name(),
    }
    for phase in PHASES:
        p50, p99 = _pcts(_merge(got["results"], phase))
        e50, e99 = _pcts(_merge(echo_results, phase))
        fig.update(
            {
                f"{phase}_p50_us": round(p50, 1),
                f"{phase}_p99_us": round(p99, 1),
                f"echo_{phase}_p50_us": round(e50, 1),
                f"echo_{phase}_p99_us": round(e99, 1),
                f"{phase}_p50_ratio": round(p50 / e50, 2),
                f"{phase}_p99_ratio": round(p99 / e99, 2),
            }
        )
    # Mean time inside the service's handlers (mostly the store), to tell it apart from queueing.
    inside = got.get("inside", {})
    for call in ("lookup", "reserve", "commit"):
        entry = inside.get(call, {})
        if entry.get("count"):
            fig[f"service_{call}_mean_us"] = round(entry["sum"] / entry["count"] * 1e6, 1)
    rss_after = got["rss_after"]
    fig["rss_mb"] = round(got["peak"], 1)
    fig["rss_after_rounds_mb"] = [round(x, 1) for x in rss_after]
    fig["rss_growth_mb"] = round(rss_after[-1] - rss_after[0], 1) if len(rss_after) > 1 else 0.0
    return fig


def _loop_name() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def _table(fig: dict[str, Any]) -> str:
    lines = [
        f"kvtier service, {fig['clients']} clients in parallel, {fig['chunks_per_call']} chunks per call,"
        f" {fig['event_loop']}",
        f"{'call':<16}{'p50 us':>10}{'echo p50':>10}{'ratio':>8}{'p99 us':>10}{'echo p99':>10}{'ratio':>8}",
    ]
    for name, key in (
        ("lookup", "lookup"),
        ("lookup, fresh", "lookup_fresh"),
        ("reserve+commit", "commit"),
        ("health", "health"),
    ):
        lines.append(
            f"{name:<16}{fig[f'{key}_p50_us']:>10.0f}{fig[f'echo_{key}_p50_us']:>10.0f}"
            f"{fig[f'{key}_p50_ratio']:>8.2f}{fig[f'{key}_p99_us']:>10.0f}"
            f"{fig[f'echo_{key}_p99_us']:>10.0f}{fig[f'{key}_p99_ratio']:>8.2f}"
        )
    lines.append(
        f"service RSS without arena: peak {fig['rss_mb']} MiB, after each round "
        f"{fig['rss_after_rounds_mb']} MiB (growth {fig['rss_growth_mb']} MiB)"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """`kvtier bench service [--json]`."""
    parser = argparse.ArgumentParser(prog="kvtier bench service", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--clients", type=int, default=8, help="client processes (default 8)")
    parser.add_argument(
        "--ops",
        type=int,
        default=625,
        help="calls of each kind per client per round (default 625: 15,000 lookups and "
        "reserve+commits per round with 8 clients)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="rounds (default 2)")
    parser.add_argument("--cpu-size", default="256MiB", help="arena size (default 256MiB)")
    parser.add_argument(
        "--alternations",
        type=int,
        default=ALTERNATIONS,
        help=f"turns of service clients, each between two of echo clients (default {ALTERNATIONS})",
    )
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.alternations < 1:
        parser.error(f"--alternations must be at least 1, not {args.alternations}")
    # SIGTERM unwinds like Ctrl-C, so the service and the echo server are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    fig = measure(args.clients, args.ops, args.rounds, args.cpu_size, args.alternations)
    print(json.dumps(fig, indent=2) if args.json else _table(fig))
    return 0


if __name__ == "__main__":
    sys.exit(main())
