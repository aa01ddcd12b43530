"""Which CPUs kvtier's own threads and processes run on, and at what priority.

kvtier's threads and processes run on the CPUs the engine was started with, never the model's cores;
work that can wait runs at nice +10 (a save's copies) or at idle priority (the service's disk writes).
Design: docs/internals.md#cpus-and-priorities-affinitypy
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")
# What binds a process's threads to cores at start: OpenMP's placement settings, honoured by an OpenMP
# runtime that vLLM's CPU build preloads (LD_PRELOAD) into every process started with its environment.
OPENMP_PLACEMENT_VARS = ("OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")
OPENMP_RUNTIMES = ("libgomp", "libiomp", "libomp")


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


def unbound_environ(env: Mapping[str, str]) -> dict[str, str]:
    """env without what would bind a child process to the model's cores before its first line runs:
    OpenMP's placement variables, and OpenMP runtimes in LD_PRELOAD (other preloads are kept)."""
    out = {k: v for k, v in env.items() if k not in OPENMP_PLACEMENT_VARS}
    preload = [
        lib
        for lib in out.get("LD_PRELOAD", "").replace(" ", ":").split(":")
        if lib and not os.path.basename(lib).startswith(OPENMP_RUNTIMES)
    ]
    if preload:
        out["LD_PRELOAD"] = ":".join(preload)
    else:
        out.pop("LD_PRELOAD", None)
    return out


def normal_priority() -> bool:
    """Move the calling thread from SCHED_IDLE or SCHED_BATCH back to the normal policy; False where
    the platform refuses. Its nice value stays: raising priority needs a privilege."""
    try:
        if os.sched_getscheduler(0) != os.SCHED_OTHER:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except (AttributeError, OSError):
        return False
    return True


def call_on(cpus: frozenset[int] | set[int], fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs) on a new thread that runs on cpus at the normal policy, waited for.

    A process started there inherits that thread's CPU set and policy, not those of the caller's
    thread (which vLLM may have bound to the core its model runs on). Its result or exception is the
    caller's."""
    outcome: list[Any] = []

    def run() -> None:
        run_on(cpus)
        normal_priority()
        try:
            outcome.append((True, fn(*args, **kwargs)))
        except BaseException as exc:
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name="kvtier-spawn", daemon=True)
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


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
