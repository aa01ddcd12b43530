"""Which CPUs kvtier's own threads and processes run on, and at what priority.

vLLM's CPU worker binds the thread that runs the model (and every thread and process it starts
afterwards) to the cores it computes on. A kvtier thread or service started from there would inherit
that binding and wait behind the model's OpenMP threads for every reply: measured on 2 cores, lookups
answered by the service in under 1 ms reached the scheduler seconds late and 340 requests took 109 s
instead of 7 s. kvtier's own threads and its embedded service therefore run on the CPUs the engine
was started with: the calling thread's set widened by its parent process's, which still honours a
``taskset`` or cpuset applied to the whole server.

Work that can wait (a save's copy into the arena) runs at a lower priority (``deprioritize``): on a
CPU-only engine the model's threads use every core during a forward and spin between them, and a save
copied at normal priority there took cores from the very prompt whose first token was waiting
(measured on 2 cores, 1537-token misses: the copy ended early enough for its commit and the service's
disk writes to land inside the prompt's time to first token too, 3-8 ms of the service's CPU in it;
at nice +10 the copy yields, ends later, and the service's share fell to 0.3 ms). Ten levels, not
idle priority (SCHED_IDLE): that would starve saves for as long as the model's threads stay busy,
holding finished requests' blocks; nice +10 still gets about a tenth of a busy core.

The service's disk writes hold nothing of vLLM's, and do run at idle priority (``run_when_idle``):
with the default tiers on 2 cores, a 1537-token prompt that came while the previous miss's 24 MiB
went to disk took 1.21-1.34x as long as one that came to a quiet service (medians of 10 pairs in one
engine); with the writers at nice +19 1.06-1.18x, at idle priority 1.03-1.09x, and 16 misses in a row
took 146-168 ms each instead of 198-207. Writes that never find an idle core fill the write-behind
queue, which then drops (and counts) what does not fit. The price: a miss that comes once the last
one's writes have ended computed 1.01-1.03x as long as the same engine with kvtier bypassed (9 runs),
against 0.99-1.01x with the writers at normal priority (4 runs); neither a 0.1 s pause nor
``os.sync()`` before each miss took that away, and its cause is not known.
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
