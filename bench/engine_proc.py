"""A vLLM engine in a process of its own that times one prompt at a time on request.

Two of these, one with kvtier and one without, stay up side by side and take turns, so a comparison
between them sees the same drift of the machine's speed; only one computes at a time, the other waits
in ``Connection.recv``. Each sample also splits its time into the model's forward and kvtier's hooks
(bench/phases.py), so kvtier's own work on the prompt's path is told apart from the same forward
running slower in the other process. ``engine_clock`` and ``time_prompt`` time an engine running in
the calling process (the child's, or kvtier.bench.connector's in-process engines); ``phase_ms`` and
``hook_ms`` take medians.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import statistics
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any, Self

from kvtier.bench.environ import environment
from kvtier.bench.harness import generate, make_prompt, running_engine
from kvtier.bench.introspect import model_runner, scheduler_connector, worker_connector
from kvtier.bench.phases import SCHEDULER_HOOKS, WORKER_HOOKS, PhaseClock

# A start loads vLLM and builds the engine; several minutes means it is stuck.
START_TIMEOUT_S = 600.0
SAMPLE_TIMEOUT_S = 300.0

# glibc's malloc gives the top of its heap back to the kernel after large frees, and whether a
# forward's activations land there differs from one engine to the next: some engines re-fault them on
# every prompt. Both engines of every comparison keep their heap (docs/performance.md has the figures).
STEADY_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def steady_malloc() -> contextlib.AbstractContextManager[None]:
    """Processes started inside (and theirs) keep their freed heap (see STEADY_MALLOC_ENV)."""
    return environment(STEADY_MALLOC_ENV)


@dataclass(frozen=True)
class Sample:
    """One prompt timed in the engine: seconds to its first token, and two phases of that time."""

    ttft: float
    forward: float  # the model's forward (kvtier's per-layer hooks left out)
    by_hook: dict[str, float] = field(default_factory=dict)  # kvtier's time by connector hook

    @property
    def kvtier(self) -> float:
        """kvtier's connector hooks, scheduler and worker side (0 without kvtier)."""
        return sum(self.by_hook.values())


def phase_ms(samples: Sequence[Sample]) -> dict[str, float]:
    """Where the samples' time went, medians in ms: the model's forward, kvtier's hooks, and
    vLLM's work besides both."""
    return {
        "forward": round(1000 * statistics.median(s.forward for s in samples), 2),
        "kvtier": round(1000 * statistics.median(s.kvtier for s in samples), 3),
        "other": round(1000 * statistics.median(s.ttft - s.forward - s.kvtier for s in samples), 2),
    }


def hook_ms(samples: Sequence[Sample]) -> dict[str, float]:
    """Where kvtier's time in the samples went: each connector hook's median, in ms (0 for a
    sample that did not call it)."""
    names = sorted({name for s in samples for name in s.by_hook})
    return {
        name: round(1000 * statistics.median(s.by_hook.get(name, 0.0) for s in samples), 3) for name in names
    }


@contextlib.contextmanager
def kvtier_bypassed(llm: Any) -> Iterator[None]:
    """kvtier's scheduler side answers "nothing to load, nothing to save" while inside: the engine
    keeps its connector configured, so only kvtier's own work is left out. No lookup is sent either:
    its answer would go unread (and a hit's lease held until it expired)."""
    from kvtier.connector.metadata import KVTierMetadata

    conn = scheduler_connector(llm)
    stand_ins = {
        "on_new_request": lambda request: None,
        "get_num_new_matched_tokens": lambda request, num_computed_tokens: (0, False),
        "update_state_after_alloc": lambda request, blocks, num_external_tokens: None,
        # The generation goes on (see reset_cache), so the workers keep their namespaces.
        "build_connector_meta": lambda scheduler_output: KVTierMetadata(
            generation=conn.snapshot().generation
        ),
        "request_finished": lambda request, block_ids: (False, None),
    }
    # What an instance attribute held before (a timer of bench/phases.py) comes back afterwards.
    before = {name: vars(conn)[name] for name in stand_ins if name in vars(conn)}
    for name, fn in stand_ins.items():
        setattr(conn, name, fn)  # instance attributes shadow the methods
    try:
        yield
    finally:
        for name in stand_ins:
            if name in before:
                setattr(conn, name, before[name])
            else:
                delattr(conn, name)


def engine_clock(llm: Any, kvtier: bool) -> PhaseClock:
    """A PhaseClock on an engine running in this process: its model's forward, and kvtier's
    connector hooks (scheduler and worker side) where it runs kvtier; restore() takes it off."""
    clock = PhaseClock()
    clock.time_span(model_runner(llm), "_model_forward")
    if kvtier:
        clock.time_hooks(scheduler_connector(llm), SCHEDULER_HOOKS)
        clock.time_hooks(worker_connector(), WORKER_HOOKS)
    return clock


def time_prompt(llm: Any, clock: PhaseClock, prompt: list[int], bypass: bool = False) -> Sample:
    """Time prompt alone to its first token in an engine running in this process, with the phases
    clock (engine_clock) saw meanwhile; bypass: kvtier answers "nothing"."""
    clock.take()  # from here on
    start = time.perf_counter()
    if bypass:
        with kvtier_bypassed(llm):
            generate(llm, [prompt], 1)
    else:
        generate(llm, [prompt], 1)
    took = time.perf_counter() - start
    phases = clock.take()
    return Sample(took, phases.span, phases.by_hook)


def _serve(conn: Connection, model: str, kv_config: dict[str, Any] | None, engine: dict[str, Any],
           cpus: frozenset[int]) -> None:  # fmt: skip
    """The child: start the engine, then answer ("ttft", prompt, bypass) with a Sample until None."""
    try:
        os.dup2(2, 1)  # vLLM logs to stdout: keep the parent's stdout (its --json output) clean
        from kvtier.runtime.affinity import run_on

        run_on(cpus)  # the parent may already be bound to one core by an in-process engine
        with running_engine(model, kv_config, **engine) as llm:
            generate(llm, [make_prompt(2, 64)], 1)  # warm up
            clock = engine_clock(llm, kvtier=kv_config is not None)
            conn.send(("ready", None))
            while (request := conn.recv()) is not None:
                _, prompt, bypass = request
                conn.send(("ttft", time_prompt(llm, clock, prompt, bypass)))
    except BaseException:  # reported to the parent, which raises it
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


class ChildEngine:
    """An engine served by target(conn, *args) in a spawned child and asked over a pipe: the child
    answers once when its engine is ready, then each request, with (kind, value) or ("error",
    traceback). Use it as a context manager: the child is shut down and reaped on every path."""

    start_timeout_s = START_TIMEOUT_S  # for the first answer (engine started; a subclass may wait longer)
    sample_timeout_s = SAMPLE_TIMEOUT_S  # for each answer after it

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        with steady_malloc():  # read by glibc when the child starts
            self._proc.start()
        child.close()
        self._ready = False

    def wait_ready(self) -> None:
        """Block until the child's first answer (its engine started; several can start at once)."""
        if not self._ready:
            self.answer(self.start_timeout_s)
            self._ready = True

    def ask(self, request: tuple[Any, ...]) -> Any:
        """Send request once the child is ready; its answer's value."""
        self.wait_ready()
        self._conn.send(request)
        return self.answer(self.sample_timeout_s)

    def answer(self, timeout: float) -> Any:
        """The value of the child's next answer; raises what the child raised, or if it died."""
        if not self._conn.poll(timeout):
            raise TimeoutError(f"engine process {self._proc.pid} did not answer within {timeout:.0f} s")
        try:
            kind, value = self._conn.recv()
        except EOFError:
            self._proc.join(10)
            code = self._proc.exitcode
            raise RuntimeError(f"engine process {self._proc.pid} died (exit code {code})") from None
        if kind == "error":
            raise RuntimeError(f"engine process failed:\n{value}")
        return value

    def close(self) -> None:
        """Shut the engine down and reap the child (killed if it does not exit in time)."""
        if self._proc.is_alive():
            with contextlib.suppress(BrokenPipeError, OSError):
                self._conn.send(None)
            self._proc.join(60)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10)
        self._conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:  # fmt: skip
        self.close()


class EngineProcess(ChildEngine):
    """An engine started in a spawned child; ``ttft(prompt)`` times one prompt there (prefill + one
    token)."""

    def __init__(self, model: str, kv_config: dict[str, Any] | None, engine: dict[str, Any],
                 cpus: frozenset[int]) -> None:  # fmt: skip
        super().__init__(_serve, model, kv_config, engine, cpus)

    def ttft(self, prompt: list[int], bypass: bool = False) -> float:
        """Seconds to prefill prompt and return its first token; bypass: kvtier answers "nothing"."""
        return self.sample(prompt, bypass).ttft

    def sample(self, prompt: list[int], bypass: bool = False) -> Sample:
        """ttft() with the forward's and kvtier's shares of it."""
        sample = self.ask(("ttft", prompt, bypass))
        if not isinstance(sample, Sample):
            raise RuntimeError(f"engine process {self._proc.pid} answered {sample!r}, not a Sample")
        return sample
