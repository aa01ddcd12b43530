"""Many engines on one service, for `kvtier bench scale service`: what one kvtier service sustains
at 1, 4, 16 and 64 connections, and what a lookup's latency does as connections are added.

Each connection is a simulated engine: a real ``ServiceClient`` (what the connector uses) on a
thread of a client process, against a real service (``python -m kvtier.app.server``) and its
arena, no model. One simulated request makes the calls an engine's request makes: a 64-chunk
``lookup`` of a stored prompt (all CPU hits, leased), a ``stage`` of that lease, a ``reserve`` +
``commit`` of 16 new chunks (the request's own tail), and the lease's ``release`` (no reply; it
rides with the next call): five operations. Each connection has prompts of its own; the new chunks
fill the arena, which then evicts the least recently used (the prompts stay, being looked up).

Two loads per connection count, each ``repeats`` times:

- ``saturated``: every connection makes requests back to back (a closed loop): the operations per
  second the service sustains, and the service's CPU per operation and its use of one core (from
  /proc/<pid>/stat over the phase). A service at ~1.0 core is its event loop saturated; below
  that, the clients (on the same machine) are what limits.
- ``paced``: a fixed total rate of requests (``rate``), spread evenly over the connections, each
  connection sending at rate / connections: lookup p50 / p99 against connections at the same total
  load, so what grows is the cost of many connections, not the queue of a heavier load.

Each phase also reports ``service_<call>_us``: the mean time a lookup, stage, reserve and commit
spent inside the service's handler (its own ``service_seconds`` counters, read before and after the
phase), which leaves out the client, the socket and any wait for the event loop; and
``service_lookup_p99_us_at_most``, the bound of the service's own lookup histogram (admin /metrics)
under which 99% of the phase's lookups were handled (-1: beyond its last bound, 5 s). Connections
run one per client process up to 16 (engines are processes of their own), four per process at 64.

Pinning: with ``pin`` (the default where the machine has 2 CPUs or more) the service runs on the
first CPU (``--cpus``) and the client processes on the others, so the clients do not take the
service's core; the figures say which CPUs each had. Other processes on the machine are not
stopped: every phase's figures are medians of ``repeats`` with their runs, and each repeat sweeps
every connection count in turn, so that all of them meet the machine's load alike.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvtier.bench.ports import free_port

CONNECTIONS = (1, 4, 16, 64)
QUICK_CONNECTIONS = (1, 4)
PROMPT_CHUNKS = 64  # chunks a lookup finds
NEW_CHUNKS = 16  # chunks a request reserves and commits
PROMPTS = 4  # stored prompts per connection
OPS_PER_REQUEST = 5  # lookup, stage, reserve, commit, release
HASH_BYTES = 32
SPEC = {
    "model": "scale-bench",
    "kv_dtype": "bfloat16",
    "kv_layout": "NHD",
    "block_size": 16,
    "chunk_size": 256,
    "num_layers": 4,
    "page_bytes": 256,  # 16 KiB chunks: the arena holds many, and no byte is copied anyway
}
ARENA = "512MiB"
MAX_CLIENT_PROCS = 16  # one connection per process up to 16, as engines are


@dataclass(frozen=True)
class Phase:
    """What each connection does in one phase."""

    url: str
    seconds: float
    rate: float  # requests per second of this connection; 0 = back to back
    timeout: float = 30.0


# ------------------------------------------------------------------------------------------ clients
@dataclass
class Gate:
    """How a client process's connections start together: each waits at ready once set up, then
    for go, after which start holds the phase's start (time.monotonic, the same clock everywhere)."""

    ready: threading.Barrier
    go: threading.Event = field(default_factory=threading.Event)
    start: float = 0.0


def _connection(phase: Phase, gate: Gate, offset: float, out: list[dict[str, Any]]) -> None:
    """One simulated engine: requests until the phase ends (paced at phase.rate when set)."""
    from kvtier.app.client import ServiceClient
    from kvtier.storage.base import NamespaceSpec

    # A generous handshake: 16 client processes starting at once on a small machine are slow.
    client = ServiceClient(phase.url, timeout=phase.timeout, connect_timeout=phase.timeout)
    try:
        ns = client.hello(NamespaceSpec(**SPEC)).result(phase.timeout).namespace  # type: ignore[arg-type]
        prompts = [[os.urandom(HASH_BYTES) for _ in range(PROMPT_CHUNKS)] for _ in range(PROMPTS)]
        for prompt in prompts:
            _save(client, ns, prompt, phase.timeout)
    except BaseException:
        gate.ready.abort()
        client.close()
        raise
    with client:
        gate.ready.wait()
        gate.go.wait()
        out.append(_requests(client, ns, prompts, phase, gate.start + offset, gate.start + phase.seconds))


def _requests(
    client: Any, ns: str, prompts: list[list[bytes]], phase: Phase, due: float, stop: float
) -> dict[str, Any]:
    """Requests from due until stop; their count and each lookup's latency."""
    lookups: list[float] = []
    requests, tag = 0, f"{os.getpid()}-{threading.get_ident()}"
    while True:
        now = time.monotonic()
        if now >= stop:
            break
        if phase.rate and now < due:
            time.sleep(due - now)
            continue
        due += 1.0 / phase.rate if phase.rate else 0.0
        lease = f"s-{tag}-{requests}"
        t0 = time.perf_counter()
        reply = client.lookup(ns, prompts[requests % PROMPTS], lease).result(phase.timeout)
        lookups.append(time.perf_counter() - t0)
        if reply.result.num_hit != PROMPT_CHUNKS:
            raise RuntimeError(f"a stored prompt was found {reply.result.num_hit}/{PROMPT_CHUNKS}")
        client.stage(lease).result(phase.timeout)
        _save(client, ns, [os.urandom(HASH_BYTES) for _ in range(NEW_CHUNKS)], phase.timeout)
        client.release(lease)
        requests += 1
    client.health().result(phase.timeout)  # sends the last release
    return {"requests": requests, "lookups": lookups}


def _save(client: Any, ns: str, hashes: list[bytes], timeout: float) -> None:
    """reserve + commit of the chunks that got a slot."""
    reply = client.reserve(ns, hashes).result(timeout)
    pairs = [(h, s) for h, s in zip(hashes, reply.slots, strict=True) if s is not None]
    if pairs:
        client.commit(ns, [h for h, _ in pairs], [s for _, s in pairs], reply.instance_id).result(timeout)


def _client_process(
    phase: Phase, count: int, first: int, total: int, cpus: list[int], q: Any, barrier: Any, start: Any
) -> None:
    """count connections on threads of this process, started with every other process's (barrier,
    twice: all set up, then start set); puts their figures and this process's CPU time."""
    try:
        if cpus:
            os.sched_setaffinity(0, cpus)
        out: list[dict[str, Any]] = []
        gate = Gate(threading.Barrier(count + 1))
        spacing = 1.0 / phase.rate / total if phase.rate else 0.0  # spread the connections' sends
        threads = [
            threading.Thread(target=_connection, args=(phase, gate, (first + i) * spacing, out), daemon=True)
            for i in range(count)
        ]
        for thread in threads:
            thread.start()
        gate.ready.wait(timeout=120)
        barrier.wait(timeout=120)
        barrier.wait(timeout=120)
        gate.start = start.value
        cpu0 = time.process_time()
        gate.go.set()
        for thread in threads:
            thread.join()
        if len(out) != count:
            raise RuntimeError(f"{count - len(out)} of {count} connections failed")
        q.put({"connections": out, "cpu_s": time.process_time() - cpu0})
    except BaseException as exc:
        barrier.abort()
        q.put({"error": f"{type(exc).__name__}: {exc}"})
        raise


# ------------------------------------------------------------------------------------------ service
def _proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used, its threads included."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def lookup_buckets(admin: str) -> list[float]:
    """The service's cumulative lookup-handler histogram (counts per LATENCY_BUCKETS bound, then +Inf)
    from its admin /metrics."""
    import urllib.request

    with urllib.request.urlopen(f"{admin}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvtier_lookup_seconds_bucket")
    ]


def handler_p99_us(before: list[float], after: list[float]) -> float:
    """The histogram bound (us) below which 99% of the lookups between two scrapes were handled."""
    from kvtier.app.metrics import LATENCY_BUCKETS

    counts = [a - b for a, b in zip(after, before, strict=True)]
    if not counts or counts[-1] <= 0:
        return 0.0
    bound = next(i for i, c in enumerate(counts) if c >= 0.99 * counts[-1])
    return LATENCY_BUCKETS[bound] * 1e6 if bound < len(LATENCY_BUCKETS) else -1.0  # beyond the last bound


@contextlib.contextmanager
def service(workdir: str, cpus: list[int]) -> Iterator[tuple[str, int, str]]:
    """A kvtier service on a unix socket, its arena in a tmpfs directory of its own, its admin HTTP
    on a free loopback port; (url, pid, admin base URL)."""
    shm = tempfile.mkdtemp(prefix="kvtier-scale-", dir="/dev/shm" if os.path.isdir("/dev/shm") else workdir)
    sock = os.path.join(workdir, "svc.sock")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    port = free_port()
    env.update(
        KVTIER_CPU_SIZE=ARENA, KVTIER_SHM_DIR=shm, KVTIER_LOG_LEVEL="WARNING", KVTIER_ADMIN_PORT=str(port)
    )
    argv = [sys.executable, "-m", "kvtier.app.server", "--url", f"unix://{sock}"]
    if cpus:
        argv += ["--cpus", ",".join(map(str, cpus))]
    proc = subprocess.Popen(argv, env=env)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(sock):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the kvtier service did not start")
            time.sleep(0.02)
        yield f"unix://{sock}", proc.pid, f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(shm, ignore_errors=True)


# ------------------------------------------------------------------------------------------ phases
def run_phase(
    phase: Phase,
    connections: int,
    svc: tuple[str, int, str],
    client_cpus: list[int],
    stats: Callable[[], dict[str, Any]],
) -> dict[str, Any]:
    """Run connections simulated engines for one phase against svc (url, pid, admin); its figures."""
    _url, pid, admin = svc
    ctx = mp.get_context("spawn")
    procs_n = min(connections, MAX_CLIENT_PROCS)
    q, barrier, start = ctx.Queue(), ctx.Barrier(procs_n + 1), ctx.Value("d", 0.0)
    procs, first = [], 0
    for i in range(procs_n):
        count = connections // procs_n + (i < connections % procs_n)
        args = (phase, count, first, connections, client_cpus, q, barrier, start)
        procs.append(ctx.Process(target=_client_process, args=args))
        first += count
    for proc in procs:
        proc.start()
    try:
        try:
            barrier.wait(timeout=180)  # every connection set up
            start.value = time.monotonic() + 0.01
            barrier.wait(timeout=30)
        except threading.BrokenBarrierError:
            pass  # a process failed: its error is in the queue
        inside0, buckets0 = stats(), lookup_buckets(admin)
        cpu0, t0 = _proc_cpu_s(pid), time.monotonic()
        results = _collect(q, procs, time.monotonic() + phase.seconds + 120)
        wall = time.monotonic() - t0
        service_cpu = _proc_cpu_s(pid) - cpu0
        inside = _inside_us(inside0, stats())
        inside["service_lookup_p99_us_at_most"] = handler_p99_us(buckets0, lookup_buckets(admin))
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"client processes failed: {errors}")
    fig = _phase_figures(results, connections, min(wall, phase.seconds + 1.0), phase.seconds, service_cpu)
    fig.update(inside)
    return fig


def _inside_us(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """Mean microseconds each timed call spent inside the service between two stats snapshots."""
    out = {}
    for call in ("lookup", "stage", "reserve", "commit"):
        a, b = after.get(call, {}), before.get(call, {})
        count = a.get("count", 0) - b.get("count", 0)
        out[f"service_{call}_us"] = (a.get("sum", 0.0) - b.get("sum", 0.0)) / count * 1e6 if count else 0.0
    return out


def _collect(q: Any, procs: list[Any], deadline: float) -> list[dict[str, Any]]:
    """One result per client process; fails once a process died without one, or at deadline."""
    import queue

    results: list[dict[str, Any]] = []
    while len(results) < len(procs):
        try:
            results.append(q.get(timeout=0.5))
        except queue.Empty:
            dead = [p.exitcode for p in procs if not p.is_alive() and p.exitcode != 0]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"client processes ended without figures (exit codes {dead})") from None
    return results


def _phase_figures(
    results: list[dict[str, Any]], connections: int, wall: float, seconds: float, service_cpu: float
) -> dict[str, Any]:
    conns = [c for r in results for c in r["connections"]]
    requests = sum(c["requests"] for c in conns)
    lookups = sorted(x for c in conns for x in c["lookups"])
    ops = requests * OPS_PER_REQUEST
    q = statistics.quantiles(lookups, n=100, method="inclusive") if len(lookups) > 1 else [lookups[0]] * 99
    return {
        "connections": connections,
        "requests": requests,
        "ops": ops,
        "ops_per_s": ops / seconds,
        "lookup_p50_us": q[49] * 1e6,
        "lookup_p99_us": q[98] * 1e6,
        "service_cpu_us_per_op": service_cpu / ops * 1e6 if ops else 0.0,
        "service_cores": service_cpu / wall,
        "client_cpu_us_per_op": sum(r["cpu_s"] for r in results) / ops * 1e6 if ops else 0.0,
    }


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the runs, with the runs."""
    out: dict[str, Any] = {}
    for name, value in runs[0].items():
        values = [r[name] for r in runs]
        if name in ("connections",):
            out[name] = value
        elif isinstance(value, int) and not isinstance(value, bool):
            out[name] = {"median": statistics.median(values), "runs": values}
        else:
            out[name] = {"median": statistics.median(values), "runs": [round(v, 3) for v in values]}
    return out


def cpu_split(pin: bool | None) -> tuple[list[int], list[int]]:
    """The service's CPUs and the clients' CPUs: the first CPU and the rest when pinning, else none."""
    cpus = sorted(os.sched_getaffinity(0))
    if pin is None:
        pin = len(cpus) >= 2
    if pin and len(cpus) < 2:
        raise ValueError(f"pinning needs 2 CPUs or more; this process may use {cpus}")
    return (cpus[:1], cpus[1:]) if pin else ([], [])


def measure(
    connections: tuple[int, ...] = CONNECTIONS,
    seconds: float = 3.0,
    repeats: int = 3,
    rate: float = 200.0,
    pin: bool | None = None,
) -> dict[str, Any]:
    """Saturated and paced phases at each connection count (see the module docstring)."""
    if repeats < 1 or seconds <= 0 or rate <= 0 or not connections or min(connections) < 1:
        raise ValueError(
            f"repeats >= 1, seconds > 0, rate > 0 and connections >= 1 are needed, not {repeats},"
            f" {seconds}, {rate} and {connections}"
        )
    service_cpus, client_cpus = cpu_split(pin)
    result: dict[str, Any] = {
        "connections": list(connections),
        "seconds": seconds,
        "repeats": repeats,
        "paced_requests_per_s": rate,
        "ops_per_request": OPS_PER_REQUEST,
        "prompt_chunks": PROMPT_CHUNKS,
        "new_chunks": NEW_CHUNKS,
        "service_cpus": service_cpus,
        "client_cpus": client_cpus,
        "saturated": {},
        "paced": {},
    }
    from kvtier.app.client import ServiceClient

    with (
        tempfile.TemporaryDirectory(prefix="kvtier-scale-") as workdir,
        service(workdir, service_cpus) as svc,
        ServiceClient(svc[0]) as probe,
    ):

        def stats() -> dict[str, Any]:
            return dict(probe.stats().result(30).get("service_seconds", {}))

        # Each repeat sweeps every connection count, so that all counts see the machine's load alike.
        runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for _ in range(repeats):
            for count in connections:
                for load, per_conn in (("saturated", 0.0), ("paced", rate / count)):
                    phase = Phase(svc[0], seconds, per_conn)
                    runs.setdefault((load, count), []).append(
                        run_phase(phase, count, svc, client_cpus, stats)
                    )
        for (load, count), figures in runs.items():
            result[load][str(count)] = _summary(figures)
    result["paced_lookup_p99_over_one_connection"] = _p99_ratios(result["paced"])
    return result


def _p99_ratios(paced: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Each connection count's paced lookup p99 over that of one connection."""
    one = paced.get("1")
    if not one:
        return {}
    base = one["lookup_p99_us"]["median"]
    return {count: round(fig["lookup_p99_us"]["median"] / base, 3) for count, fig in paced.items()}
