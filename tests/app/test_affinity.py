"""kvtier's threads and embedded service leave the core vLLM binds its model thread to."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from kvtier.app.embedded import paths_for
from kvtier.runtime.affinity import (
    NICE_STEPS,
    call_on,
    deprioritize,
    format_cpus,
    parse_cpus,
    unbound_environ,
)
from tests.app import ROOT, python_env, wait_until
from tests.support.leak_check import kvtier_leak_session, leak_check, no_kvtier_leaks  # noqa: F401
from tests.support.skips import missing

# Binds its main thread to one CPU, as vLLM's CPU worker does before it builds the connector, then
# starts the embedded service and a client from that thread; prints both threads' CPU sets.
ENGINE = """
import json, os, sys, threading
from kvtier.app.embedded import connect, paths_for
from kvtier.app.settings import load_settings
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
client = connect(load_settings(), sys.argv[1])
client.wait_connected(10)
pid = json.loads(paths_for(sys.argv[1])[2].read_text())["pid"]
def cpus(tid):
    return sorted(os.sched_getaffinity(tid))
def service_cpus():
    seen = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            seen[int(t)] = cpus(int(t))
        except ProcessLookupError:  # a short-lived thread (e.g. a pool worker) ended after listdir
            pass
    return seen
print(json.dumps({
    "main": cpus(0), "client": cpus(client._thread.native_id), "service": service_cpus(),
}), flush=True)
sys.stdin.read()
client.close()
os.kill(pid, 15)
"""


def test_cpu_list_round_trip_and_errors() -> None:
    assert parse_cpus(format_cpus({3, 0, 1})) == {0, 1, 3}
    assert parse_cpus("") == frozenset()
    with pytest.raises(ValueError, match="comma-separated"):
        parse_cpus("0-3")
    with pytest.raises(ValueError, match=">= 0"):
        parse_cpus("-1")


def test_client_thread_and_embedded_service_run_on_the_engines_cpus(tmp_path: Path) -> None:
    wide = sorted(os.sched_getaffinity(0))
    if len(wide) < 2:
        missing("two CPUs (to tell a bound thread from a free one)")
    engine_id = f"affinity-{uuid.uuid4()}"
    env = python_env(KVTIER_SHM_DIR=str(tmp_path), KVTIER_CPU_SIZE="4MiB", KVTIER_LOG_LEVEL="WARNING")
    proc = subprocess.Popen(
        [sys.executable, "-c", ENGINE, engine_id],
        env=env, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        seen = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
    finally:
        proc.communicate("", timeout=30)
    sock = paths_for(engine_id)[0]
    assert wait_until(lambda: not sock.exists(), 15)
    assert seen["main"] == wide[:1]  # the engine thread stayed where it was bound
    assert seen["client"] == wide
    assert seen["service"] and all(cpus == wide for cpus in seen["service"].values()), seen["service"]


def test_deprioritize_lowers_the_calling_thread_only() -> None:
    import threading

    mine = os.getpriority(os.PRIO_PROCESS, 0)
    seen: list[tuple[bool, int]] = []

    def lowered() -> None:
        seen.append((deprioritize(), os.getpriority(os.PRIO_PROCESS, 0)))

    thread = threading.Thread(target=lowered)
    thread.start()
    thread.join(30)
    assert seen == [(True, min(19, mine + NICE_STEPS))]
    assert os.getpriority(os.PRIO_PROCESS, 0) == mine  # the caller's thread kept its priority


def test_unbound_environ_drops_openmp_placement_and_preloaded_openmp_runtimes() -> None:
    env = {
        "OMP_PLACES": "{0}",
        "OMP_PROC_BIND": "true",
        "GOMP_CPU_AFFINITY": "0",
        "KMP_AFFINITY": "granularity=fine,explicit,proclist=[0]",
        "OMP_NUM_THREADS": "1",
        "LD_PRELOAD": "/v/libs/libtcmalloc_minimal.so.4:/t/lib/libgomp.so.1 /x/libiomp5.so",
        "PATH": "/bin",
    }
    assert unbound_environ(env) == {
        "OMP_NUM_THREADS": "1",
        "LD_PRELOAD": "/v/libs/libtcmalloc_minimal.so.4",
        "PATH": "/bin",
    }
    assert "LD_PRELOAD" not in unbound_environ({"LD_PRELOAD": "/t/lib/libgomp.so.1"})
    assert env["OMP_PLACES"] == "{0}"  # the caller's mapping is left as it was


def test_call_on_returns_and_raises_what_the_call_does() -> None:
    cpus = frozenset(os.sched_getaffinity(0))
    assert call_on(cpus, lambda: sorted(os.sched_getaffinity(0))) == sorted(cpus)
    with pytest.raises(KeyError, match="boom"):
        call_on(cpus, {}.__getitem__, "boom")


# vLLM's CPU build runs its worker with OpenMP's placement in the environment and PyTorch's libgomp in
# LD_PRELOAD: a process started with that environment is bound to the worker's core at exec.
FIRST_LINE = "import os, sys; print(sorted(os.sched_getaffinity(0)), flush=True)"


def _libgomp() -> str:
    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.origin, "the test extra installs torch (the cpu extra)"
    found = sorted(Path(spec.origin).parent.glob("lib/libgomp*.so*")) + sorted(
        Path(spec.origin).parents[1].glob("torch.libs/libgomp*.so*")
    )
    assert found, "PyTorch ships its libgomp in torch/lib or torch.libs"
    return str(found[0])


def test_a_process_started_through_call_on_leaves_the_spawning_threads_core() -> None:
    wide = frozenset(os.sched_getaffinity(0))
    if len(wide) < 2:
        missing("two CPUs (to tell a bound thread from a free one)")
    core = min(wide)
    bound_env = dict(python_env(), OMP_PLACES=f"{{{core}}}", OMP_PROC_BIND="true", LD_PRELOAD=_libgomp())
    seen: dict[str, list[int]] = {}

    def engine_thread() -> None:  # bound to one core, as vLLM's worker thread is
        os.sched_setaffinity(0, {core})

        def start(env: dict[str, str]) -> list[int]:
            out = subprocess.run([sys.executable, "-c", FIRST_LINE], env=env, capture_output=True, text=True)
            return json.loads(out.stdout)

        seen["plain"] = start(bound_env)  # the negative control: what the service got before
        seen["widened_thread_only"] = call_on(wide, start, bound_env)
        seen["kvtier"] = call_on(wide, start, unbound_environ(bound_env))

    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join()
    assert seen["plain"] == [core]
    assert seen["widened_thread_only"] == [core]  # the preloaded OpenMP runtime binds it at exec
    assert seen["kvtier"] == sorted(wide)
