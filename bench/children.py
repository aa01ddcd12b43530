"""Server processes the benchmarks and tests start (SeaweedFS, redis-server), killed at exit when
their owner did not stop them: a crashed benchmark or test leaves none running."""

from __future__ import annotations

import atexit
import contextlib
import subprocess

_LIVE: set[subprocess.Popen[bytes]] = set()


def track(proc: subprocess.Popen[bytes]) -> None:
    """Kill proc at exit unless untrack() is called first."""
    _LIVE.add(proc)


def untrack(proc: subprocess.Popen[bytes]) -> None:
    """proc was stopped by its owner."""
    _LIVE.discard(proc)


def _kill_all() -> None:
    for proc in list(_LIVE):
        with contextlib.suppress(OSError):
            proc.kill()
        with contextlib.suppress(Exception):
            proc.wait(timeout=5)
        _LIVE.discard(proc)


atexit.register(_kill_all)
