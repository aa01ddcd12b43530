"""The disk tier's start at scale, for `kvtier bench storage` (``--index-files``).

For each count of chunk files (1 KiB payloads, in a temp dir on the disk under test) it measures:

- ``first_answer_s``: from creating the tier to the answer of its first lookup (``start()`` awaited,
  then ``contains_many``), as a service serving a restart would see it;
- ``full_index_s``: from creating the tier to its index holding every file (``wait_loaded``);
- ``lookup_max_ms``: the slowest of the lookups made every 10 ms while the index loads;

each with the page cache warm (the files were just written and read) and cold: ``drop_caches``
(``sync`` then ``echo 3 > /proc/sys/vm/drop_caches``: data pages, dentries and inodes, as after a
reboot) where that file is writable, else ``fadvise`` (``POSIX_FADV_DONTNEED`` on every file: their
data pages only, directories and inodes stay cached), as ``cold_method`` says. Then, loading once
more with tracemalloc on, ``index_bytes_per_chunk`` (the service memory the complete index keeps,
per chunk) and ``load_peak_bytes_per_chunk`` (the most it held during the load).

The files are written fast rather than through the tier: one payload, its checksum taken once, and
per file its own header (codec.encode_header) and one write, from a few threads.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import shutil
import statistics
import tempfile
import time
import tracemalloc
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from itertools import repeat
from typing import Any

from kvtier.storage import codec
from kvtier.storage.base import ChunkKey
from kvtier.storage.config import DiskConfig
from kvtier.storage.tiers.disk import DiskTier

NS = "be0c4be0c4be0c4b"
PAYLOAD_BYTES = 1024
HASH_BYTES = 32  # vLLM's sha256 block hashes
DROP_CACHES = "/proc/sys/vm/drop_caches"
_WRITERS = 4


def _keys(n: int, seed: int) -> list[ChunkKey]:
    rng = random.Random(seed)
    return [ChunkKey(NS, rng.randbytes(HASH_BYTES)) for _ in range(n)]


def _write_files(root: str, keys: list[ChunkKey], seed: int) -> None:
    """Write the files of keys (one fan-out directory's) under root: a header each, one payload."""
    payload = random.Random(seed).randbytes(PAYLOAD_BYTES)
    digest = codec.checksum(payload)
    tier = DiskTier(DiskConfig(root, 1 << 40))  # for path_of only: never started
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    made: set[str] = set()
    for key in keys:
        path = tier.path_of(key)
        directory = path.rpartition("/")[0]
        if directory not in made:
            os.makedirs(directory, exist_ok=True)
            made.add(directory)
        fd = os.open(path, flags, 0o600)
        try:
            os.write(fd, codec.encode_header(key, payload, digest) + payload)
        finally:
            os.close(fd)


def generate(root: str, n: int, seed: int = 1) -> list[ChunkKey]:
    """n chunk files under root as the disk tier lays them out; returns their keys. Processes, not
    threads: on a busy machine, threads that trade the GIL wait for each other's time slices."""
    keys = _keys(n, seed)
    by_fan: dict[int, list[ChunkKey]] = {}
    for key in keys:  # a process per fan-out directory at a time: no two create the same directory
        by_fan.setdefault(key.prefix_hash[0], []).append(key)
    spawn = multiprocessing.get_context("spawn")  # the caller runs an event loop and threads
    with ProcessPoolExecutor(_WRITERS, mp_context=spawn) as pool:
        list(pool.map(_write_files, repeat(root), by_fan.values(), repeat(seed)))
    return keys


def remove_tree(root: str) -> None:
    """Remove root and everything under it, a fan-out directory per thread (unlinks wait on the disk)."""
    subdirs = [e.path for top in os.scandir(root) if top.is_dir() for e in os.scandir(top.path)]
    with ThreadPoolExecutor(_WRITERS * 2) as pool:
        list(pool.map(lambda path: shutil.rmtree(path, ignore_errors=True), subdirs))
    shutil.rmtree(root, ignore_errors=True)


def make_cold(root: str) -> str:
    """Drop what the page cache holds of root's files; returns how (see the module docstring)."""
    os.sync()
    if os.access(DROP_CACHES, os.W_OK):
        try:
            with open(DROP_CACHES, "w") as f:
                f.write("3\n")
            return "drop_caches"
        except OSError:
            pass  # e.g. a container's read-only /proc/sys
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "fadvise"


async def timed_start(root: str, probe: ChunkKey, n: int) -> dict[str, float]:
    """Start a tier over root: time to its first answer, to a full index, and lookups meanwhile."""
    start = time.perf_counter()
    tier = DiskTier(DiskConfig(root, 1 << 40))
    try:
        await tier.start()
        await tier.contains_many([probe])
        first = time.perf_counter() - start
        lookups: list[float] = []
        while not tier.index_complete:
            t = time.perf_counter()
            await tier.contains_many([probe])
            lookups.append(time.perf_counter() - t)
            await asyncio.sleep(0.01)
        full = time.perf_counter() - start
        chunks = tier.stats().chunks
        if chunks != n:
            raise RuntimeError(f"the index holds {chunks} chunks of the {n} files under {root}")
    finally:
        await tier.close()
    return {
        "first_answer_s": round(first, 4),
        "full_index_s": round(full, 3),
        "lookup_max_ms": round(max(lookups, default=0.0) * 1e3, 3),
        "lookup_p50_ms": round(statistics.median(lookups) * 1e3, 3) if lookups else 0.0,
    }


async def traced_load(root: str, n: int) -> dict[str, float]:
    """Load root's index with tracemalloc on: bytes per chunk kept when complete, and at the peak."""
    tier = DiskTier(DiskConfig(root, 1 << 40))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        await tier.start()
        await tier.wait_loaded()
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        await tier.close()
    return {
        "index_bytes_per_chunk": round((kept - before) / n, 1),
        "load_peak_bytes_per_chunk": round((peak - before) / n, 1),
    }


async def measure(counts: list[int], base: str | None, cold: bool = True) -> dict[str, Any]:
    """The figures above for each count of files (see the module docstring)."""
    bad = [n for n in counts if n < 1]
    if bad:
        raise ValueError(f"file counts must be 1 or more (--index-files), got {bad}")
    rows: list[dict[str, Any]] = []
    method = "skipped"
    for n in counts:
        root = tempfile.mkdtemp(prefix="kvtier-bench-index-", dir=base)
        try:
            t = time.perf_counter()
            keys = await asyncio.to_thread(generate, root, n)
            row: dict[str, Any] = {"files": n, "generate_s": round(time.perf_counter() - t, 1)}
            probe = keys[n // 2]
            row["warm"] = await timed_start(root, probe, n)
            if cold:
                method = await asyncio.to_thread(make_cold, root)
                row["cold"] = await timed_start(root, probe, n)
            row.update(await traced_load(root, n))
            rows.append(row)
        finally:
            await asyncio.to_thread(remove_tree, root)
    cases = [row[c] for row in rows for c in ("warm", "cold") if c in row]
    return {
        "cold_method": method,
        "payload_bytes": PAYLOAD_BYTES,
        "first_answer_s": max((c["first_answer_s"] for c in cases), default=0.0),
        "index_bytes_per_chunk": max((r["index_bytes_per_chunk"] for r in rows), default=0.0),
        "counts": rows,
    }


def table(fig: dict[str, Any]) -> list[str]:
    """Lines of the text table for `kvtier bench storage`."""
    lines = [f"\ndisk index (cold: {fig['cold_method']}; {fig['payload_bytes']} B payloads)"]
    lines.append(
        f"{'files':>9}{'case':>6}{'first answer s':>16}{'full index s':>14}{'lookup max ms':>15}"
        f"{'index B/chunk':>15}{'peak B/chunk':>14}"
    )
    for row in fig["counts"]:
        for case in ("warm", "cold"):
            if case in row:
                c = row[case]
                lines.append(
                    f"{row['files']:>9}{case:>6}{c['first_answer_s']:>16}{c['full_index_s']:>14}"
                    f"{c['lookup_max_ms']:>15}{row['index_bytes_per_chunk']:>15}"
                    f"{row['load_peak_bytes_per_chunk']:>14}"
                )
    lines.append(
        f"worst: first_answer_s={fig['first_answer_s']} (target 1), "
        f"index_bytes_per_chunk={fig['index_bytes_per_chunk']} (target 200)"
    )
    return lines
