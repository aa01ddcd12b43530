"""The services the connector benchmark runs its engines against: a standalone kvtier service and a
redis-server, each started off the model's core, and waits on the service's state."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvtier.bench.arena_dir import arena_dir

ARENA_BYTES = 1 << 30  # the CPU tier of every service the benchmark starts


def off_the_model_core() -> Callable[[], None]:
    """A preexec_fn that runs the child on the CPUs this process started with.

    Once an in-process engine has run, vLLM has bound this thread to the model's core; a service or
    Redis started from here would inherit that, which no deployment does (see runtime/affinity.py).
    """
    from kvtier.runtime.affinity import engine_cpus, run_on

    cpus = engine_cpus()

    def preexec() -> None:
        run_on(cpus)

    return preexec


@contextlib.contextmanager
def kvtier_service(tmp: Path, **settings: Any) -> Iterator[str]:
    """A standalone kvtier service (`python -m kvtier.app.server`) on a unix socket, its arena on tmpfs."""
    tmp.mkdir(parents=True, exist_ok=True)
    sock = tmp / "kvtier.sock"
    with arena_dir(tmp, ARENA_BYTES) as shm:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        # No PYTHONPATH: the service imports kvtier as this interpreter does (installed, or the checkout).
        env.update({"KVTIER_SHM_DIR": str(shm), "KVTIER_CPU_SIZE": str(ARENA_BYTES)})
        env.update({f"KVTIER_{k.upper()}": str(v) for k, v in settings.items()})
        with open(tmp / "service.log", "w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvtier.app.server", "--url", f"unix://{sock}"],
                env=env,
                stdout=log,
                stderr=log,
                preexec_fn=off_the_model_core(),
            )
        try:
            deadline = time.monotonic() + 30
            while not sock.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError((tmp / "service.log").read_text())
                time.sleep(0.05)
            yield f"unix://{sock}"
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


@contextlib.contextmanager
def redis_server(tmp: Path) -> Iterator[str | None]:
    """A redis-server on a free loopback port, once it answers PING; None where none is installed."""
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    from kvtier.bench.ports import free_port

    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(tmp)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=off_the_model_core(),
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    try:
        _wait_pong(proc, url)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def _wait_pong(proc: subprocess.Popen[bytes], url: str, timeout: float = 30) -> None:
    """Wait until the redis-server at url answers PING (it listens a moment after it starts)."""
    import redis

    deadline = time.monotonic() + timeout
    with redis.Redis.from_url(url, socket_connect_timeout=1) as client:
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"redis-server at {url} did not answer within {timeout:.0f} s"
                    ) from None
                time.sleep(0.05)


def wait_drained(client: Any) -> None:
    """Wait (at most 60 s) until the service's write queue is empty."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and client.stats().result(10)["write_queue_depth"]:
        time.sleep(0.05)


def wait_released(client: Any) -> None:
    """Wait until no lease is held: the engine ends a finished request's lease with its client's
    next call or sweep, and a clear() before that keeps the leased chunks in their tier."""
    deadline = time.monotonic() + 60
    while client.stats().result(10)["leases_active"]:
        if time.monotonic() > deadline:
            raise RuntimeError("the engine's leases did not end within 60 s")
        time.sleep(0.02)


def hit_tokens(client: Any) -> dict[str, int]:
    """The service's hit tokens by tier, so far."""
    return dict(client.stats().result(10)["hit_tokens"])


def check_hits(client: Any, before: dict[str, int], tier: str, tokens: int) -> None:
    """Fail unless the hits since before were exactly tokens, all from tier: a figure measured on
    hits from another tier would be reported under the wrong name."""
    after = hit_tokens(client)
    got = {t: n - before.get(t, 0) for t, n in after.items() if n != before.get(t, 0)}
    if got != {tier: tokens}:
        raise RuntimeError(f"expected {tokens} hit tokens from the {tier} tier, got {got}")


def wait_stored(client: Any, chunks: int) -> None:
    """Wait until the CPU tier holds `chunks` chunks, then for the write queue: an empty queue alone
    does not say the engine's saves were committed (they copy at a lower priority, after the prompt)."""
    deadline = time.monotonic() + 60
    while client.stats().result(10)["tiers"]["cpu"]["chunks"] < chunks:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the engine's saves did not reach {chunks} chunks within 60 s")
        time.sleep(0.02)
    wait_drained(client)
