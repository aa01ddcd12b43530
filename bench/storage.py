"""Storage tier benchmark: `kvtier bench storage [--json]` or `python -m kvtier.bench.storage [--json]`.

For chunk sizes of 2, 8 and 32 MiB it measures, in one run and interleaved repetition by repetition
(best of ``--repeats``, default 5, since machines are shared and noisy):

- disk: DiskTier.put / get_into (checksums on, temp file + rename) against plain ``os.write`` /
  ``os.readv`` of the same bytes, one file per chunk, page cache warm for both. The reference reads
  into a preallocated, pre-touched buffer, as the tier reads into its caller's: ``os.read`` would
  allocate a fresh bytes object per file, and from 32 MiB up glibc maps fresh pages for each one, so
  the reference measured page faults (about 1 GB/s) rather than file reading.
  ``thread_put_ratio`` / ``thread_get_ratio`` run that same plain write / read, one job per file, in
  the I/O threads the tier uses (``IOThreads``): no checksum, no temp file, only the hand-off to a
  thread and back that keeps file I/O off the event loop. They are the ceiling of any tier that does
  its I/O off the loop on this machine, so the tier's own ratios read against them.
- redis: RedisTier.put / get_into on one connection (``redis_pool_size=1``) against the raw redis-py
  client (hiredis) doing pipelined SET / GET of the same values on one connection; plus the tier's
  parallel get and put (``asyncio.gather`` over a pool of ``redis_pool_size`` connections).
- arena: DiskTier / RedisTier.get_into a pre-touched slot of the shared-memory arena against a plain
  numpy copy of the same bytes into that slot. ``stage_ratio`` is the disk figure (a warm page-cache
  read, whose ceiling is a memory copy); ``stage_ratio_redis`` is bounded by the socket, not memory.
  ``slot_vs_private_*`` compares staging into a slot with reading into a private buffer: about 1.0
  means staging adds no copy beyond what the driver forces.

- object: ObjectTier.put (until its upload ends) / get_into against obstore's own put / get of the
  same blobs on the same S3 server, one at a time and all at once (``bench/storage_object.py``); the
  server is ``object_url`` / ``object_endpoint`` when set, else a private SeaweedFS when ``weed`` is
  installed (``--no-object`` skips it).

Every ratio is tier / reference throughput; each top-level ratio is the worst over the chunk sizes.
A redis-server is started on a free loopback port when ``redis_url`` is empty and one is installed.

- disk_index: the disk tier's start over 100,000 chunk files (``--index-files``, e.g. ``--index-files
  100000 1000000``; the million takes minutes, so it is opt-in): time to its first answer and to a
  full index, page cache warm and cold, and the index's bytes per chunk (``bench/storage_index.py``).
  ``--index-only`` measures only this; ``--index-files`` with no count skips it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from functools import partial
from typing import Any

import numpy as np

from kvtier.app.settings import KVTierSettings, load_settings, storage_config
from kvtier.bench import storage_index, storage_object
from kvtier.runtime.event_loop import new_event_loop
from kvtier.runtime.handoff import IOThreads
from kvtier.storage.base import ChunkKey
from kvtier.storage.config import DiskConfig, RedisConfig
from kvtier.storage.tiers.disk import DiskTier
from kvtier.storage.tiers.redis import RedisTier

MIB = 1 << 20
SIZES_MIB = (2, 8, 32)
ROUND_BYTES = 128 * MIB
NS = "be0c4be0c4be0c4b"


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0


def _ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b > 0 else 0.0


def _keys(tag: int, n: int) -> list[ChunkKey]:
    return [ChunkKey(NS, tag.to_bytes(4, "big") + i.to_bytes(4, "big")) for i in range(n)]


def _touched(size: int) -> bytearray:
    buf = bytearray(size)
    buf[::4096] = b"\1" * len(buf[::4096])  # fault every page in before timing
    return buf


async def _timed(fn: Callable[[], Awaitable[Any]]) -> float:
    start = time.perf_counter()
    await fn()
    return time.perf_counter() - start


def _timed_sync(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------- disk
def _ref_write(directory: str, payload: memoryview, n: int) -> None:
    for i in range(n):
        _plain_write_one(directory, payload, i)


def _ref_read(directory: str, dest: memoryview, n: int) -> None:
    for i in range(n):
        _plain_read_one(directory, dest, i)


def _plain_write_one(directory: str, payload: memoryview, i: int) -> None:
    fd = os.open(f"{directory}/ref{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    view = payload
    while view.nbytes:
        view = view[os.write(fd, view) :]
    os.close(fd)


def _plain_read_one(directory: str, dest: memoryview, i: int) -> None:
    fd = os.open(f"{directory}/ref{i}", os.O_RDONLY)
    got = os.readv(fd, [dest])
    os.close(fd)
    assert got == dest.nbytes


async def _in_threads(threads: IOThreads, fn: Callable[..., None], *args: Any, n: int) -> None:
    """fn(*args, i) for each file i, one at a time, each in a thread, as the tier runs its I/O."""
    for i in range(n):
        await threads.run(fn, *args, i)


def _ref_clear(directory: str, n: int) -> None:
    for i in range(n):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{directory}/ref{i}")


async def bench_disk(
    tier: DiskTier, threads: IOThreads, ref_dir: str, payload: memoryview, reps: int
) -> dict[str, Any]:
    """Disk tier put/get (one at a time, and all at once) against plain os.write/os.read, and
    that plain I/O run in threads (the ceiling of I/O kept off the event loop)."""
    size = payload.nbytes
    n = max(4, ROUND_BYTES // size)
    dest = memoryview(_touched(size))
    dests = [memoryview(_touched(size)) for _ in range(n)]
    names = ("ref_put", "ref_get", "thread_put", "thread_get", "put", "get", "put_par", "get_par")
    best = dict.fromkeys(names, 1e9)
    for rep in range(reps):
        # Each phase starts from the same state (its own files only), so the kernel's dirty-page
        # throttling weighs on the reference and on the tier alike.
        keys, keys_par = _keys(rep, n), _keys(1000 + rep, n)
        _ref_clear(ref_dir, n)
        best["ref_put"] = min(best["ref_put"], _timed_sync(lambda: _ref_write(ref_dir, payload, n)))
        best["ref_get"] = min(best["ref_get"], _timed_sync(lambda: _ref_read(ref_dir, dest, n)))
        _ref_clear(ref_dir, n)
        thread_put = partial(_in_threads, threads, _plain_write_one, ref_dir, payload, n=n)
        best["thread_put"] = min(best["thread_put"], await _timed(thread_put))
        thread_get = partial(_in_threads, threads, _plain_read_one, ref_dir, dest, n=n)
        best["thread_get"] = min(best["thread_get"], await _timed(thread_get))
        _ref_clear(ref_dir, n)

        async def put_all(keys: list[ChunkKey] = keys) -> None:
            for k in keys:
                assert await tier.put(k, payload)

        async def get_all(keys: list[ChunkKey] = keys) -> None:
            for k in keys:
                assert await tier.get_into(k, dest)

        async def put_par(keys: list[ChunkKey] = keys_par) -> None:
            assert all(await asyncio.gather(*(tier.put(k, payload) for k in keys)))

        async def get_par(keys: list[ChunkKey] = keys_par) -> None:
            got = await asyncio.gather(*(tier.get_into(k, d) for k, d in zip(keys, dests, strict=True)))
            assert all(got)

        best["put"] = min(best["put"], await _timed(put_all))
        best["get"] = min(best["get"], await _timed(get_all))
        if rep < reps - 1:  # the last round's chunks stay for the arena benchmark
            for k in keys:
                await tier.delete(k)
        best["put_par"] = min(best["put_par"], await _timed(put_par))
        best["get_par"] = min(best["get_par"], await _timed(get_par))
        for k in keys_par:
            await tier.delete(k)
    _ref_clear(ref_dir, n)
    return _put_get_figures(best, n, size)


def _put_get_figures(best: dict[str, float], n: int, size: int) -> dict[str, Any]:
    """GB/s of each phase's best round of n chunks of size bytes, and the tier's ratios to the
    reference's: ref_put, put, put_par (and thread_put where measured), then the same for get."""
    fig = {name: _gbps(n * size, secs) for name, secs in best.items()}
    out: dict[str, Any] = {"size_mib": size // MIB}
    for op in ("put", "get"):
        ref = fig[f"ref_{op}"]
        out[f"ref_{op}_gbps"] = ref
        out[f"{op}_gbps"] = fig[op]
        out[f"{op}_ratio"] = _ratio(fig[op], ref)
        out[f"{op}_parallel_gbps"] = fig[f"{op}_par"]
        out[f"{op}_ratio_parallel"] = _ratio(fig[f"{op}_par"], ref)
        if f"thread_{op}" in fig:
            out[f"thread_{op}_gbps"] = fig[f"thread_{op}"]
            out[f"thread_{op}_ratio"] = _ratio(fig[f"thread_{op}"], ref)
    return out


# ---------------------------------------------------------------------------------------------- redis
@contextlib.contextmanager
def own_redis_server() -> Iterator[str | None]:
    """A private redis-server on a free loopback port (None when none is installed)."""
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="kvtier-bench-redis-")
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", workdir, "--logfile", os.path.join(workdir, "redis.log")]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import redis

        client = redis.Redis(port=port, socket_timeout=1.0)
        deadline = time.monotonic() + 10.0
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the benchmark's redis-server did not start") from None
                time.sleep(0.05)
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


async def bench_redis(
    one: RedisTier, many: RedisTier, url: str, payload: memoryview, reps: int
) -> dict[str, Any]:
    """Redis tier put/get (one connection, and parallel) against pipelined redis-py SET/GET."""
    import redis

    from kvtier.storage import codec

    size = payload.nbytes
    n = max(4, ROUND_BYTES // size)
    ref = redis.Redis.from_url(url, socket_timeout=30)
    value = codec.encode(ChunkKey(NS, b"ref"), payload)  # same bytes the tier stores per chunk
    names = [f"bench:ref:{i}" for i in range(n)]
    dest = memoryview(_touched(size))
    dests = [memoryview(_touched(size)) for _ in range(n)]
    best = {k: 1e9 for k in ("ref_put", "ref_get", "put", "get", "put_par", "get_par")}

    def ref_set() -> None:
        pipe = ref.pipeline(transaction=False)
        for name in names:
            pipe.set(name, value)
        pipe.execute()

    def ref_get() -> None:
        pipe = ref.pipeline(transaction=False)
        for name in names:
            pipe.get(name)
        assert all(v is not None and len(v) == len(value) for v in pipe.execute())

    keys = _keys(100, n)

    async def put_all() -> None:
        for k in keys:
            assert await one.put(k, payload)

    async def get_all() -> None:
        for k in keys:
            assert await one.get_into(k, dest)

    async def put_par() -> None:
        assert all(await asyncio.gather(*(many.put(k, payload) for k in keys)))

    async def get_par() -> None:
        assert all(await asyncio.gather(*(many.get_into(k, d) for k, d in zip(keys, dests, strict=True))))

    try:
        for _ in range(reps):
            best["ref_put"] = min(best["ref_put"], _timed_sync(ref_set))
            best["put"] = min(best["put"], await _timed(put_all))
            best["put_par"] = min(best["put_par"], await _timed(put_par))
            best["ref_get"] = min(best["ref_get"], _timed_sync(ref_get))
            best["get"] = min(best["get"], await _timed(get_all))
            best["get_par"] = min(best["get_par"], await _timed(get_par))
        ref.delete(*names)
    finally:
        ref.close()
    return _put_get_figures(best, n, size)


# ---------------------------------------------------------------------------------------------- arena
async def bench_arena(
    arena: Any,
    disk: DiskTier,
    disk_keys: list[ChunkKey],
    redis_tier: RedisTier | None,
    redis_keys: list[ChunkKey],
    payload: memoryview,
    reps: int,
) -> dict[str, Any]:
    """Staging into pre-touched arena slots against a numpy copy of the same bytes into them."""
    from kvtier.storage.arena import align_up
    from kvtier.storage.base import SlotRef

    size = payload.nbytes
    n = len(disk_keys)
    step = align_up(size)
    count = min(n, arena.size // step)
    slots = [arena.view(SlotRef(i * step, size)) for i in range(count)]
    arrays = [np.frombuffer(s, dtype=np.uint8) for s in slots]
    private = memoryview(_touched(size))
    src = np.frombuffer(payload, dtype=np.uint8)
    best = {k: 1e9 for k in ("copy", "disk", "disk_private", "redis", "redis_private")}

    def copy_all() -> None:
        for i in range(n):
            np.copyto(arrays[i % count], src)

    async def stage(tier: Any, keys: list[ChunkKey], into_slots: bool) -> None:
        for i, k in enumerate(keys):
            assert await tier.get_into(k, slots[i % count] if into_slots else private)

    for _ in range(reps):
        best["copy"] = min(best["copy"], _timed_sync(copy_all))
        runs: list[tuple[str, Any, list[ChunkKey], bool]] = [("disk", disk, disk_keys, True)]
        runs += [("disk_private", disk, disk_keys, False)]
        if redis_tier is not None:
            runs += [("redis", redis_tier, redis_keys, True)]
            runs += [("redis_private", redis_tier, redis_keys, False)]
        for name, tier, keys, into_slots in runs:
            best[name] = min(best[name], await _timed(partial(stage, tier, keys, into_slots)))
    fig = {name: _gbps(n * size, secs) for name, secs in best.items()}
    out = {
        "size_mib": size // MIB,
        "copy_gbps": fig["copy"],
        "stage_disk_gbps": fig["disk"],
        "stage_ratio": _ratio(fig["disk"], fig["copy"]),
        "slot_vs_private_disk": _ratio(fig["disk"], fig["disk_private"]),
    }
    if redis_tier is not None:
        out.update(
            stage_redis_gbps=fig["redis"],
            stage_ratio_redis=_ratio(fig["redis"], fig["copy"]),
            slot_vs_private_redis=_ratio(fig["redis"], fig["redis_private"]),
        )
    return out


# ---------------------------------------------------------------------------------------------- driver
def _worst(rows: list[dict[str, Any]], *names: str) -> dict[str, float]:
    return {n: min(r[n] for r in rows) for n in names if rows and all(n in r for r in rows)}


def _redis_config(settings: KVTierSettings, update: dict[str, Any], **more: Any) -> RedisConfig:
    """The Redis tier's config from the settings with some of them replaced."""
    config = storage_config(settings.model_copy(update={**update, **more})).redis
    assert config is not None
    return config


@contextlib.contextmanager
def _redis_url(settings: KVTierSettings, want: bool) -> Iterator[tuple[str | None, str]]:
    if not want:
        yield None, "disabled by --no-redis"
    elif settings.redis_url:
        yield settings.redis_url, "redis_url"
    else:
        with own_redis_server() as url:
            yield url, "private redis-server" if url else "no redis_url and no redis-server"


async def _measure(args: argparse.Namespace, settings: KVTierSettings) -> dict[str, Any]:
    base = args.disk_path or settings.disk_path or None
    result: dict[str, Any] = {} if args.index_only else await _measure_throughput(args, settings)
    if not args.index_only:
        result["object"] = (
            await storage_object.measure(settings, [int(s) * MIB for s in args.sizes], args.repeats)
            if args.object
            else {"skipped": "disabled by --no-object"}
        )
    if args.index_files:
        result["disk_index"] = await storage_index.measure(args.index_files, base, args.index_cold)
    return result


async def _measure_throughput(args: argparse.Namespace, settings: KVTierSettings) -> dict[str, Any]:
    from kvtier.storage.arena import Arena

    sizes = [int(s) * MIB for s in args.sizes]
    base = args.disk_path or settings.disk_path or None
    root = tempfile.mkdtemp(prefix="kvtier-bench-", dir=base)
    ref_dir = tempfile.mkdtemp(prefix="kvtier-bench-ref-", dir=base)
    disk = DiskTier(DiskConfig(root, 64 << 30))
    await disk.start()
    arena = Arena.create(settings.shm_dir, min(8, ROUND_BYTES // max(sizes)) * max(sizes))
    arena.wait_prefaulted(60)
    plain = IOThreads(1, "kvtier-bench-plain")  # one job at a time: one thread is all it uses
    result: dict[str, Any] = {"sizes_mib": list(args.sizes), "repeats": args.repeats}
    rows: dict[str, list[dict[str, Any]]] = {"disk": [], "redis": [], "arena": []}
    try:
        with _redis_url(settings, args.redis) as (url, source):
            one = many = None
            if url:
                # The reference client's timeout (30 s): a throughput run must not fail on a host
                # stall of over a second (seen on this VM), which the tier's 1 s default turns into
                # a counted miss.
                timed = {"redis_url": url, "redis_timeout": 30.0}
                one = RedisTier(_redis_config(settings, timed, redis_pool_size=1))
                many = RedisTier(_redis_config(settings, timed))
                await one.start()
                await many.start()
            try:
                for size in sizes:
                    payload = memoryview(np.random.default_rng(size).bytes(size))
                    rows["disk"].append(await bench_disk(disk, plain, ref_dir, payload, args.repeats))
                    n = max(4, ROUND_BYTES // size)
                    if one is not None and many is not None and url:
                        rows["redis"].append(await bench_redis(one, many, url, payload, args.repeats))
                    rows["arena"].append(
                        await bench_arena(arena, disk, _keys(args.repeats - 1, n), one,
                                          _keys(100, n), payload, args.repeats)
                    )  # fmt: skip
                    for k in _keys(args.repeats - 1, n):
                        await disk.delete(k)
                    if one is not None:
                        for k in _keys(100, n):
                            await one.delete(k)
            finally:
                for tier in (one, many):
                    if tier is not None:
                        await tier.close()
            result["redis_source"] = source
    finally:
        await disk.close()
        plain.close()
        arena.close()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(ref_dir, ignore_errors=True)
    return _summarize(result, rows)


def _summarize(result: dict[str, Any], rows: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Each section's worst ratio over the sizes, with every size's figures."""
    disk_names = ("put_ratio", "get_ratio", "put_ratio_parallel", "get_ratio_parallel",
                  "thread_put_ratio", "thread_get_ratio")  # fmt: skip
    result["disk"] = {**_worst(rows["disk"], *disk_names), "sizes": rows["disk"]}
    redis_names = ("put_ratio", "get_ratio", "get_ratio_parallel", "put_ratio_parallel")
    result["redis"] = (
        {**_worst(rows["redis"], *redis_names), "sizes": rows["redis"]}
        if rows["redis"]
        else {"skipped": result.get("redis_source", "not measured")}
    )
    arena_names = ("stage_ratio", "stage_ratio_redis", "slot_vs_private_disk", "slot_vs_private_redis")
    result["arena"] = {**_worst(rows["arena"], *arena_names), "sizes": rows["arena"]}
    return result


def _table(fig: dict[str, Any]) -> str:
    index = storage_index.table(fig["disk_index"]) if "disk_index" in fig else []
    if "repeats" not in fig:  # --index-only
        return "\n".join(["kvtier storage benchmark", *index])
    lines = [f"kvtier storage benchmark, best of {fig['repeats']}, GB/s (1e9 bytes/s)"]
    columns = {
        "disk": ("put_gbps", "put_parallel_gbps", "ref_put_gbps", "put_ratio", "thread_put_ratio",
                 "get_gbps", "get_parallel_gbps", "ref_get_gbps", "get_ratio", "get_ratio_parallel",
                 "thread_get_ratio"),
        "redis": ("put_gbps", "put_parallel_gbps", "ref_put_gbps", "put_ratio", "get_gbps",
                  "get_parallel_gbps", "ref_get_gbps", "get_ratio", "get_ratio_parallel"),
        "object": ("put_gbps", "ref_put_gbps", "put_ratio", "put_par_gbps", "ref_put_par_gbps",
                   "put_ratio_parallel", "get_gbps", "ref_get_gbps", "get_ratio", "get_par_gbps",
                   "ref_get_par_gbps", "get_ratio_parallel"),
        "arena": ("copy_gbps", "stage_disk_gbps", "stage_ratio", "slot_vs_private_disk",
                  "stage_redis_gbps", "stage_ratio_redis", "slot_vs_private_redis"),
    }  # fmt: skip
    for tier, cols in columns.items():
        section = fig[tier]
        if "skipped" in section:
            lines.append(f"\n{tier}: skipped ({section['skipped']})")
            continue
        source = {"redis": fig.get("redis_source"), "object": section.get("source")}.get(tier)
        lines.append(f"\n{tier}" + (f" ({source})" if source else ""))
        present = [c for c in cols if section["sizes"] and c in section["sizes"][0]]
        lines.append(f"{'MiB':>5}" + "".join(f"{c.removesuffix('_gbps'):>22}" for c in present))
        for row in section["sizes"]:
            lines.append(f"{row['size_mib']:>5}" + "".join(f"{row[c]:>22}" for c in present))
        worst = {k: v for k, v in section.items() if k not in ("sizes", "source")}
        lines.append("worst: " + ", ".join(f"{k}={v}" for k, v in worst.items()))
    return "\n".join(lines + index)


def build_parser(prog: str = "kvtier bench storage") -> argparse.ArgumentParser:
    """Arguments of the storage benchmark."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    add_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's options to parser (shared by main() and register())."""
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--sizes", nargs="+", type=int, default=list(SIZES_MIB),
                        help="chunk sizes in MiB (default 2 8 32)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5, help="repetitions, best kept (default 5)")
    parser.add_argument("--disk-path", default="", help="where to write (default: a temp dir)")
    parser.add_argument("--no-redis", dest="redis", action="store_false", help="skip Redis")
    parser.add_argument("--no-object", dest="object", action="store_false", help="skip the object tier")
    parser.add_argument(
        "--index-files",
        nargs="*",
        type=int,
        default=[100_000],
        help="chunk files for the disk index's start (default 100000; none: skip it)",
    )
    parser.add_argument(
        "--no-index-cold",
        dest="index_cold",
        action="store_false",
        help="measure the index's start with the page cache warm only",
    )
    parser.add_argument("--index-only", action="store_true", help="measure only the disk index's start")


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark with these arguments and return the figures (what --json prints)."""
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    return _run_args(args)


def _run_args(args: argparse.Namespace) -> dict[str, Any]:
    settings = load_settings()
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(_measure(args, settings))


def _cmd(args: argparse.Namespace) -> int:
    fig = _run_args(args)
    print(json.dumps(fig, indent=2) if args.json else _table(fig))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `storage` to a `bench` subparsers group (set_defaults(func=...) returning an exit code)."""
    parser = subparsers.add_parser("storage", help=__doc__.split("\n")[0])
    add_arguments(parser)
    parser.set_defaults(func=_cmd)


def main(argv: Sequence[str] | None = None) -> int:
    """`kvtier bench storage [--json]`."""
    return _cmd(build_parser().parse_args(list(argv) if argv is not None else None))


if __name__ == "__main__":
    sys.exit(main())
