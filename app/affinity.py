"""Which CPUs kvtier's own threads and processes run on.

vLLM's CPU worker binds the thread that runs the model (and every thread and process it starts
afterwards) to the cores it computes on. A kvtier thread or service started from there would inherit
that binding and wait behind the model's OpenMP threads for every reply: measured on 2 cores, lookups
answered by the service in under 1 ms reached the scheduler seconds late and 340 requests took 109 s
instead of 7 s. kvtier's own threads and its embedded service therefore run on the CPUs the engine
was started with: the calling thread's set widened by its parent process's, which still honours a
``taskset`` or cpuset applied to the whole server.
"""

from __future__ import annotations

import contextlib
import os


def engine_cpus() -> frozenset[int]:
    """The CPUs the calling thread may use, widened by those of its parent process."""
    if not hasattr(os, "sched_getaffinity"):
        return frozenset()
    cpus = set(os.sched_getaffinity(0))
    with contextlib.suppress(OSError):
        cpus |= os.sched_getaffinity(os.getppid())
    return frozenset(cpus)


def run_on(cpus: frozenset[int] | set[int]) -> bool:
    """Let the calling thread run on these CPUs; False when the platform or the cpuset refuses."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return False
    try:
        os.sched_setaffinity(0, cpus)
    except OSError:
        return False
    return True


def format_cpus(cpus: frozenset[int] | set[int]) -> str:
    """A CPU set as a comma-separated list ('' for none)."""
    return ",".join(str(c) for c in sorted(cpus))


def parse_cpus(text: str) -> frozenset[int]:
    """The inverse of format_cpus; ValueError names what is wrong."""
    if not text.strip():
        return frozenset()
    try:
        cpus = frozenset(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--cpus must be a comma-separated list of CPU numbers, got {text!r}") from None
    if any(c < 0 for c in cpus):
        raise ValueError(f"--cpus must list CPU numbers >= 0, got {text!r}")
    return cpus
