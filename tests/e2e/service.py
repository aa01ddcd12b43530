"""A standalone kvtier service in a subprocess, for end-to-end tests (`kvtier serve` on a unix socket)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.app.client import ServiceClient
from kvtier.storage.base import Tier
from tests.app import wait_until

REPO = Path(__file__).resolve().parents[2]


@dataclass
class RunningService:
    """A service process, its URL, a client for stats and admin calls, and its directories."""

    url: str
    proc: subprocess.Popen
    shm_dir: Path
    env: dict[str, str]
    client: ServiceClient = field(init=False)

    def __post_init__(self) -> None:
        self.client = ServiceClient(self.url, name="kvtier-test-client")
        if not self.client.wait_connected(20):
            raise RuntimeError(f"service at {self.url} did not come up: {self.log_tail()}")

    def stats(self) -> dict[str, Any]:
        """`kvtier stats --json` of the service."""
        return self.client.stats().result(10)

    def hit_tokens(self) -> dict[str, int]:
        """Hit tokens served so far, by tier."""
        return dict(self.stats()["hit_tokens"])

    def wait_leases_ended(self, timeout: float = 10) -> None:
        """Wait (bounded) until no lease is active: the connector ends a finished request's lease
        with release(), which reaches the service with its next call or sweep, not at once."""
        if not wait_until(lambda: self.stats()["leases_active"] == 0, timeout):
            raise AssertionError(f"leases still active after {timeout} s: {self.stats()}")

    def clear(self, *tiers: Tier) -> int:
        """Drop every chunk of these tiers, once the engine's finished requests ended their leases."""
        self.wait_leases_ended()
        return self.client.clear(list(tiers)).result(10)

    def arena_files(self) -> list[Path]:
        """Arena files in the service's shm dir."""
        return sorted(self.shm_dir.glob("kvtier-*.arena"))

    def log_tail(self) -> str:
        """The last lines the service logged."""
        log = self.shm_dir / "service.log"
        return log.read_text()[-3000:] if log.exists() else ""


def stop_process(proc: subprocess.Popen, grace: float = 20) -> None:
    """SIGTERM a service process (graceful), SIGKILL it if it hangs; a no-op once it exited."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


@contextlib.contextmanager
def running_service(tmp: Path, **settings: Any) -> Iterator[RunningService]:
    """Start `python -m kvtier.app.server` with KVTIER_* settings; stop it with SIGTERM on every path."""
    tmp.mkdir(parents=True, exist_ok=True)
    url = f"unix://{tmp}/kvtier.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env.update({"KVTIER_SHM_DIR": str(tmp), "KVTIER_CPU_SIZE": "64MiB", "PYTHONPATH": str(REPO)})
    env.update({f"KVTIER_{k.upper()}": str(v) for k, v in settings.items()})
    log = open(tmp / "service.log", "w")  # noqa: SIM115 - closed below, on every path
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier.app.server", "--url", url],
        env=env,
        stdout=log,
        stderr=log,
        cwd=REPO,
    )
    service = None
    try:
        deadline = time.monotonic() + 30
        while not (tmp / "kvtier.sock").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"service failed to start: {(tmp / 'service.log').read_text()}")
            time.sleep(0.05)
        service = RunningService(url, proc, tmp, env)
        yield service
    finally:
        if service is not None:
            service.client.close()
        stop_process(proc)
        log.close()
