"""The physical floors of a hit's load: what the hardware needs to move a prompt's chunk bytes.

A tier's floor is vLLM's own prefix-cache hit of the prompt (the ceiling: KV already in the engine)
plus one plain move of the bytes the tier's hit moves: a cache-cold memcpy (CPU tier), one thread
reading the chunk files with ``os.preadv``, page cache warm or dropped (disk tier), the bytes once
over a loopback socket (Redis tier, ``bench/loopback.py``). ``hit_floor`` turns samples taken in
turn (``bench/turns.py``) into the figures `kvtier bench connector` reports.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

# Targets for each tier's hit / floor; reported and charted, never asserted.
HIT_FLOOR_TARGETS = {"cpu": 1.2, "disk": 1.5, "disk_cold": 1.3, "redis": 2.0, "object": 1.5}


def hit_floor(
    hits: Sequence[float], ceilings: Sequence[float], moves: Sequence[float], target: float | None
) -> dict[str, float | None]:
    """A tier's hit against its floor from samples in seconds, taken in turn: the floor of turn j
    is ceilings[j] + moves[j]; ratio = median hit / median floor (figures in ms)."""
    if not hits or not len(hits) == len(ceilings) == len(moves):
        raise ValueError(
            f"hit_floor needs as many hits, ceilings and moves, at least one: got {len(hits)}, "
            f"{len(ceilings)} and {len(moves)}"
        )
    floors = [c + m for c, m in zip(ceilings, moves, strict=True)]
    hit, floor = statistics.median(hits), statistics.median(floors)
    return {
        "hit_ms": round(1000 * hit, 2),
        "ceiling_ms": round(1000 * statistics.median(ceilings), 2),
        "move_ms": round(1000 * statistics.median(moves), 2),
        "floor_ms": round(1000 * floor, 2),
        "ratio": round(hit / floor, 3),
        "target": target,
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


class FileRead:
    """One thread reading files whole, in order, with plain ``os.preadv`` into one preallocated,
    pre-touched buffer (as the disk tier reads a chunk file into an arena slot)."""

    def __init__(self, paths: Sequence[str | os.PathLike[str]]) -> None:
        if not paths:
            raise ValueError("FileRead needs at least one file")
        self.paths = [str(p) for p in paths]
        self.sizes = [os.stat(p).st_size for p in self.paths]
        self._buffer = np.full(max(1, sum(self.sizes)), 1, dtype=np.uint8)  # touched, as the arena is
        self.data = self._buffer.data[: sum(self.sizes)]

    @property
    def nbytes(self) -> int:
        """Bytes one read moves: the files' sizes when this was made."""
        return sum(self.sizes)

    def once(self) -> float:
        """Seconds to open, read whole and close every file; a file shorter than it was raises."""
        start = time.perf_counter()
        offset = 0
        for path, size in zip(self.paths, self.sizes, strict=True):
            fd = os.open(path, os.O_RDONLY)
            try:
                got = 0
                while got < size:
                    n = os.preadv(fd, [self.data[offset + got : offset + size]], got)
                    if n <= 0:
                        raise RuntimeError(f"{path} holds {got} bytes, {size} expected")
                    got += n
            finally:
                os.close(fd)
            offset += size
        return time.perf_counter() - start


def drop_cached(paths: Sequence[str | os.PathLike[str]]) -> None:
    """Drop the page cache of these files (fsync first: the kernel keeps dirty pages)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def resident_bytes(paths: Sequence[str | os.PathLike[str]]) -> int:
    """Bytes of these files in the page cache now (``mincore`` over a mapping of each), whole pages."""
    libc = _libc()
    page = mmap.PAGESIZE
    total = 0
    for path in paths:
        size = Path(path).stat().st_size
        if size == 0:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr is None or addr == ctypes.c_void_p(-1).value:
                raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
            try:
                pages = (size + page - 1) // page
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
                total += sum(b & 1 for b in vec) * page
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    return total
