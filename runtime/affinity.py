"""Which CPUs kvtier's own threads and processes run on, and at what priority.

vLLM's CPU worker binds the thread that runs the model (and every thread and process it starts
afterwards) to the cores it computes on. A kvtier thread or service started from there would inherit
that binding and wait behind the model's OpenMP threads for every reply, so kvtier's own threads and
its embedded service run on the CPUs the engine was started with: the calling thread's set widened by
its parent process's, which still honours a ``taskset`` or cpuset applied to the whole server.

Work that can wait runs at a lower priority. A save's copy into the arena runs at nice +10
(``deprioritize``): at normal priority it takes cores from the prompt whose first token is waiting,
and at idle priority (SCHED_IDLE) it would starve while the model's threads stay busy, holding
finished requests' blocks. The service's disk writes hold nothing of vLLM's and run at idle priority
(``run_when_idle``); writes that never find an idle core fill the write-behind queue, which then drops
(and counts) what does not fit. The figures behind each choice are in docs/performance.md.
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


NICE_STEPS = 10  # how far deprioritize() lowers a thread: 110 vs 1024 in the kernel's CPU weights


def deprioritize() -> bool:
    """Lower the calling thread's CPU priority by NICE_STEPS nice levels (at most to 19); False where
    the platform refuses, and the thread then keeps its priority."""
    try:
        # Linux keeps a nice value per thread: 0 names the calling thread, not the whole process.
        nice = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PROCESS, 0, min(19, nice + NICE_STEPS))
    except (AttributeError, OSError):
        return False
    return True


def run_when_idle() -> bool:
    """Let the calling thread run only on CPU time that nothing else wants (SCHED_IDLE); False where
    the platform refuses, and the thread then keeps its priority."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: the calling thread
    except (AttributeError, OSError):
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
