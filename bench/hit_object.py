"""The object tier's hit against its floor: vLLM's own prefix-cache hit plus obstore's plain GET of the
same objects from the same S3 server.

``ObjectFloor`` runs the GETs in a process of its own (``python -m kvtier.bench.hit_object``, started
off the model's core as the service is, since obstore's runtime threads inherit the core binding
of the thread that first uses them): asked for a prompt's object paths, it GETs them all at once
with the client the tier uses (``obstore.get_async`` + ``bytes_async``, an ``S3Store`` built as the
tier builds its own) and answers the seconds until the last byte is in. The object paths are those
of the prompt's chunk files on disk (same key, ``object_index.object_path``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import select
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import PurePath
from types import TracebackType
from typing import Any

from kvtier.storage.base import Tier
from kvtier.storage.keys import DISK_SUFFIX

UPLOAD_TIMEOUT_S = 120.0


def object_paths(files: Sequence[str]) -> list[str]:
    """The object paths (below the tier's prefix) of these disk chunk files: ``<namespace>/<hash hex>``."""
    out = []
    for name in files:
        path = PurePath(name)
        out.append(f"{path.parents[2].name}/{path.name.removesuffix(DISK_SUFFIX)}")
    return out


def wait_uploaded(client: Any, chunks: int) -> None:
    """Wait until the object tier's index holds chunks objects (uploads run after the write queue
    has drained) and no upload is left in flight."""
    deadline = time.monotonic() + UPLOAD_TIMEOUT_S
    while True:
        tier = client.stats().result(10)["tiers"].get(Tier.OBJECT.label, {})
        if tier.get("chunks", 0) >= chunks:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the object tier holds {tier.get('chunks')} of {chunks} chunks after uploads")
        time.sleep(0.05)


class ObjectFloor:
    """A GET process; ``move(paths)`` times the GET of those objects, all at once. Use it as a context
    manager: the process is ended and reaped on every path."""

    def __init__(
        self, url: str, endpoint: str, preexec_fn: Callable[[], None] | None = None, timeout: float = 60.0
    ) -> None:
        self._timeout = timeout
        self.nbytes = 0  # bytes the last move fetched
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.bench.hit_object", "--url", url, "--endpoint", endpoint],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            preexec_fn=preexec_fn,
        )
        try:
            self._answer()  # ready: the store is built and one LIST went through
        except BaseException:
            self.close()
            raise

    def _answer(self) -> dict[str, Any]:
        assert self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], self._timeout)
        line = self._proc.stdout.readline() if ready else b""
        if not line:
            raise RuntimeError(f"the object floor process did not answer within {self._timeout:.0f} s")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"the object floor process failed: {answer['error']}")
        return answer

    def move(self, paths: Sequence[str]) -> float:
        """Seconds to GET every one of paths (at once) until its last byte is in."""
        assert self._proc.stdin is not None
        self._proc.stdin.write((json.dumps(list(paths)) + "\n").encode())
        self._proc.stdin.flush()
        answer = self._answer()
        self.nbytes = int(answer["bytes"])
        return float(answer["seconds"])

    def close(self) -> None:
        """End the process (its stdin closed) and reap it."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            try:
                self._proc.stdin.close()
            except OSError:
                pass
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def __enter__(self) -> ObjectFloor:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:  # fmt: skip
        self.close()


async def _get_all(store: Any, paths: list[str]) -> tuple[float, int]:
    import obstore

    async def one(path: str) -> int:
        return len(await (await obstore.get_async(store, path)).bytes_async())

    start = time.perf_counter()
    sizes = await asyncio.gather(*(one(p) for p in paths))
    return time.perf_counter() - start, sum(sizes)


def _say(answer: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()


async def _serve(url: str, endpoint: str) -> None:
    import obstore

    from kvtier.storage.config import ObjectConfig
    from kvtier.storage.tiers.object_client import build_store

    store = build_store(ObjectConfig(url=url, endpoint=endpoint, timeout=60.0))
    await obstore.list_with_delimiter_async(store, None)  # the connections and runtime are up
    _say({"ready": True})
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        seconds, nbytes = await _get_all(store, json.loads(line))
        _say({"seconds": seconds, "bytes": nbytes})


def main(argv: list[str] | None = None) -> int:
    """The GET process: one JSON list of paths a line in, one JSON answer a line out."""
    parser = argparse.ArgumentParser(prog="python -m kvtier.bench.hit_object", description=__doc__)
    parser.add_argument("--url", required=True, help="s3://bucket/prefix of the object tier")
    parser.add_argument("--endpoint", default="", help="the S3 endpoint (empty: AWS)")
    args = parser.parse_args(argv)
    try:
        asyncio.run(_serve(args.url, args.endpoint))
    except Exception as exc:  # the parent raises it with this text
        _say({"error": f"{type(exc).__name__}: {exc}"})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
