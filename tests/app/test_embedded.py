"""Embedded mode: spawn, discovery by another process, restart after kill -9, exit with the parent."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from kvtier.app.client import ConstantBackoff, ServiceClient, ServiceUnavailable
from kvtier.app.embedded import (
    Respawner,
    _locked,
    clean_stale,
    died_detached,
    ensure_service,
    paths_for,
    service_env,
    sweep_dead,
    sweep_locks,
)
from tests.app import ROOT, SPEC, hashes, python_env, settings_for, wait_until
from tests.support.leak_check import (  # noqa: F401
    descendants,
    kvtier_leak_session,
    leak_check,
    no_kvtier_leaks,
)

# Prints the URL and the service's pid, then keeps the engine process alive until stdin closes.
ENGINE = """
import json, sys
from kvtier.app.embedded import ensure_service, paths_for
from kvtier.app.settings import load_settings
url = ensure_service(load_settings(), sys.argv[1])
state = json.loads(paths_for(sys.argv[1])[2].read_text())
print(json.dumps({"url": url, "pid": state["pid"], "arena": state["arena"]}), flush=True)
sys.stdin.read()
"""


def _engine(tmp: Path, engine_id: str) -> subprocess.Popen[str]:
    env = python_env(KVTIER_SHM_DIR=str(tmp), KVTIER_CPU_SIZE="4MiB", KVTIER_LOG_LEVEL="WARNING")
    return subprocess.Popen(
        [sys.executable, "-c", ENGINE, engine_id],
        env=env,
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def _stop_service(state: Path) -> None:
    try:
        pid = json.loads(state.read_text())["pid"]
    except (OSError, ValueError):
        return
    if _alive(pid):
        os.kill(pid, signal.SIGTERM)
        wait_until(lambda: not _alive(pid), 15)


def test_settings_reach_the_child_through_the_environment(tmp_path: Path) -> None:
    settings = settings_for(tmp_path, auth_token="tok", disk_fsync="true")
    env = service_env(settings, {"KVTIER_NOPE": "x", "PATH": "/bin"})
    assert "KVTIER_NOPE" not in env and env["PATH"] == "/bin"
    assert env["KVTIER_CPU_SIZE"] == str(4 << 20) and env["KVTIER_DISK_FSYNC"] == "true"
    assert env["KVTIER_AUTH_TOKEN"] == "tok" and "KVTIER_SERVICE_URL" not in env
    sock, _, _ = paths_for("x" * 4000)
    assert len(str(sock)) < 108


def test_spawn_discovery_and_restart_after_kill9(tmp_path: Path) -> None:
    settings = settings_for(tmp_path)
    engine_id = f"engine-{uuid.uuid4()}"
    sock, _lock, state = paths_for(engine_id)
    try:
        url = ensure_service(settings, engine_id)
        first = json.loads(state.read_text())
        # Another process of the same engine finds the running service instead of starting one.
        other = _engine(tmp_path, engine_id)
        found = json.loads(other.stdout.readline())  # type: ignore[union-attr]
        other.communicate("", timeout=10)
        assert (found["url"], found["pid"]) == (url, first["pid"])
        client = ServiceClient(
            url, on_unavailable=(respawn := Respawner(settings, engine_id)), backoff=ConstantBackoff(0.05)
        )
        with client:
            hello = client.hello(SPEC).result(5)
            os.kill(first["pid"], signal.SIGKILL)
            assert wait_until(lambda: not _alive(first["pid"]), 5)
            future = client.health()
            assert isinstance(future.exception(5), ServiceUnavailable)
            assert wait_until(lambda: client.connected and client.instance_id != hello.instance_id, 20)
            second = json.loads(state.read_text())
            assert second["pid"] != first["pid"] and _alive(second["pid"])
            assert not Path(first["arena"]).exists()  # the dead service's arena was removed
            keys = hashes(2)
            assert client.lookup(hello.namespace, keys, "l").result(5).result.num_hit == 0
            assert (respawn.counts.started, respawn.counts.failed) == (1, 0)
    finally:
        _stop_service(state)
    assert not sock.exists() and not state.exists()


def _services_of(sock: Path) -> list[int]:
    """Live processes started to serve the socket at sock (the spawned one and the one it forks)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"kvtier.app.server" in cmdline and str(sock).encode() in cmdline and _alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def test_a_respawn_that_does_not_serve_in_time_is_killed_counted_and_tried_again(tmp_path: Path) -> None:
    """No service can serve within 1 ms: each such respawn is killed whole (the process spawned and the
    service it forked), counted, and the next one waits twice as long; with a real timeout it serves."""
    settings = settings_for(tmp_path)
    engine_id = f"engine-{uuid.uuid4()}"
    sock, lock, state = paths_for(engine_id)
    now = [100.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    respawn = Respawner(
        settings, engine_id, timeout=0.001, backoff=(1.0, 3.0), clock=lambda: now[0], sleep=sleep
    )
    try:
        for _ in range(3):
            respawn()
            # Killed (SIGKILL lands asynchronously), not left starting in the background.
            assert wait_until(lambda: not _services_of(sock), 10), _services_of(sock)
        assert (respawn.counts.started, respawn.counts.failed) == (0, 3)
        assert slept == [2.0, 3.0]  # 1 s doubled per failure in a row, capped at 3 s
        respawn.timeout = 30.0
        respawn()
        assert slept == [2.0, 3.0, 3.0]
        assert (respawn.counts.started, respawn.counts.failed) == (1, 3)
        with ServiceClient(f"unix://{sock}") as client:
            assert client.health().result(5).serving
        respawn()  # the service answers: nothing to do, nothing counted
        assert (respawn.counts.started, respawn.counts.failed) == (1, 3)
        assert slept == [2.0, 3.0, 3.0, 1.0]  # a success resets the wait to its first value
        assert not lock.exists()
    finally:
        _stop_service(state)
    assert not sock.exists() and not state.exists()


def test_a_start_whose_detached_service_died_is_known_at_once(tmp_path: Path) -> None:
    """A service killed after it detached (its state file written) but before it answered: the
    spawner need not wait out its start-up timeout."""
    state = tmp_path / "e.json"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(30)
    spawned = 12345  # the process that forked the service away and exited
    assert not died_detached(spawned, state), "no state file yet: still starting"
    state.write_text(json.dumps({"pid": dead.pid, "arena": ""}))
    assert died_detached(spawned, state)
    state.write_text(json.dumps({"pid": os.getpid(), "arena": ""}))
    assert not died_detached(spawned, state), "alive"
    state.write_text(json.dumps({"pid": spawned, "arena": ""}))
    assert not died_detached(spawned, state), "not detached: the process spawned is the service"


def test_concurrent_engine_processes_start_exactly_one_service(tmp_path: Path) -> None:
    engine_id = f"engine-{uuid.uuid4()}"
    engines = [_engine(tmp_path, engine_id) for _ in range(3)]
    try:
        infos = [json.loads(e.stdout.readline()) for e in engines]  # type: ignore[union-attr]
        assert len({(i["url"], i["pid"]) for i in infos}) == 1
        pid = infos[0]["pid"]
    finally:
        for e in engines:
            e.communicate("", timeout=10)
    # Every engine process is gone and none was connected: the service exits and cleans up.
    assert wait_until(lambda: not _alive(pid), 15)
    assert not Path(infos[0]["arena"]).exists()
    assert not paths_for(engine_id)[1].exists()  # the lock file went with its last holder


def test_service_exits_when_the_parent_dies_and_the_last_client_leaves(tmp_path: Path) -> None:
    engine_id = f"engine-{uuid.uuid4()}"
    parent = _engine(tmp_path, engine_id)
    info = json.loads(parent.stdout.readline())  # type: ignore[union-attr]
    sock, _, state = paths_for(engine_id)
    try:
        with ServiceClient(info["url"]) as client:
            assert client.health().result(5).serving
            parent.kill()
            parent.wait(10)
            # Another process of the engine is still connected: the service stays.
            assert not wait_until(lambda: not _alive(info["pid"]), 1.0)
            assert client.health().result(5).serving
        assert wait_until(lambda: not _alive(info["pid"]), 10)
        assert wait_until(lambda: not sock.exists() and not state.exists(), 5)
        assert not Path(info["arena"]).exists()
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        _stop_service(state)


def test_killing_the_engines_process_tree_spares_the_service_which_then_cleans_up(tmp_path: Path) -> None:
    """vLLM stops an engine by SIGKILLing it and every descendant: the service is not one of them,
    so it can remove its socket and arena once the engine is gone."""
    engine_id = f"engine-{uuid.uuid4()}"
    parent = _engine(tmp_path, engine_id)
    info = json.loads(parent.stdout.readline())  # type: ignore[union-attr]
    sock, _, state = paths_for(engine_id)
    try:
        tree = descendants(parent.pid)
        assert info["pid"] not in tree
        for pid in tree:
            os.kill(pid, signal.SIGKILL)
        parent.kill()
        parent.wait(10)
        assert wait_until(lambda: not _alive(info["pid"]), 10)
        assert wait_until(lambda: not sock.exists() and not state.exists(), 5)
        assert not Path(info["arena"]).exists()
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        _stop_service(state)


def test_dead_services_files_are_swept_and_live_ones_kept(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "-m", "kvtier.app.server"])
    try:
        for name, pid in (("e-dead", dead.pid), ("e-live", live.pid)):
            arena = tmp_path / f"kvtier-{name[2:]}.arena"
            arena.write_bytes(b"x")
            (tmp_path / f"{name}.sock").write_bytes(b"")
            (tmp_path / f"{name}.json").write_text(json.dumps({"pid": pid, "arena": str(arena)}))
        assert sweep_dead(tmp_path) == 1
        left = sorted(p.name for p in tmp_path.iterdir())
        assert left == ["e-live.json", "e-live.sock", "kvtier-live.arena"]
    finally:
        live.kill()
        live.wait()
        for path in tmp_path.iterdir():
            path.unlink()


def test_starting_a_service_leaves_no_lock_file_and_sweeps_stale_ones(tmp_path: Path) -> None:
    settings = settings_for(tmp_path)
    engine_id = f"engine-{uuid.uuid4()}"
    sock, lock, state = paths_for(engine_id)
    stale, held = sock.parent / "e-stale0000000000.lock", sock.parent / "e-held00000000000.lock"
    stale.write_bytes(b"")  # left by a process killed while it held it: nobody holds it now
    holder = os.open(held, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another engine's process, starting its service right now
    try:
        ensure_service(settings, engine_id)
        assert not lock.exists() and not stale.exists() and held.exists()
    finally:
        _stop_service(state)
        held.unlink()
        os.close(holder)
    assert not sock.exists() and not state.exists()


def test_sweep_removes_only_lock_files_nobody_holds(tmp_path: Path) -> None:
    free, held = tmp_path / "e-free.lock", tmp_path / "e-held.lock"
    other = tmp_path / "not-a-lock.lock"
    for path in (free, held, other):
        path.write_bytes(b"")
    holder = os.open(held, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        assert sweep_locks(tmp_path) == 1
        assert sorted(p.name for p in tmp_path.iterdir()) == ["e-held.lock", "not-a-lock.lock"]
    finally:
        os.close(holder)
    assert sweep_locks(tmp_path) == 1 and not held.exists()
    other.unlink()


def test_the_lock_stays_exclusive_while_holders_remove_it_and_sweeps_run(tmp_path: Path) -> None:
    """Each release removes the file and sweeps remove files nobody holds, so a waiter may lock a file
    that is gone: it must notice and lock the one its path names now, never share the lock."""
    lock = tmp_path / "e-race.lock"
    inside, most, rounds = [0], [0], 100
    errors: list[BaseException] = []
    guard = threading.Lock()
    stop = threading.Event()

    def contender() -> None:
        try:
            for _ in range(rounds):
                with _locked(lock, 30.0):
                    with guard:
                        inside[0] += 1
                        most[0] = max(most[0], inside[0])
                    time.sleep(0.001)  # widens the window in which another holder would overlap
                    with guard:
                        inside[0] -= 1
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    def sweeper() -> None:
        while not stop.is_set():
            sweep_locks(tmp_path)

    threads = [threading.Thread(target=contender) for _ in range(4)]
    sweep = threading.Thread(target=sweeper)
    sweep.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    stop.set()
    sweep.join(10)
    assert not any(t.is_alive() for t in [*threads, sweep])
    assert errors == []
    assert most[0] == 1
    assert list(tmp_path.iterdir()) == []


# A process that looks like a service (its command line names kvtier.app.server): it starts listening
# on argv[1] after argv[3] seconds, then answers nothing for argv[2] seconds (as a live service whose
# loop a busy machine holds up), then answers every hello; with argv[2] negative, never.
FAKE_SERVICE = """
import socket, sys, time
from kvtier.app import protocol as p
path, delay, start = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
time.sleep(start)
srv = socket.socket(socket.AF_UNIX)
srv.bind(path)
srv.listen(64)
print("listening", flush=True)
if delay < 0:
    time.sleep(3600)
time.sleep(delay)
while True:
    conn, _ = srv.accept()
    try:
        conn.sendall(p.FrameEncoder().encode(p.OkReply(id=1)))  # any reply frame is an answer
    except OSError:
        pass  # a probe that gave up meanwhile
    conn.close()
"""


def _fake_service(tmp: Path, delay: float, start: float = 0.0) -> tuple[subprocess.Popen[str], Path, Path]:
    sock, state = tmp / "svc.sock", tmp / "svc.json"
    proc = subprocess.Popen(
        [sys.executable, "-c", FAKE_SERVICE, str(sock), str(delay), str(start), "kvtier.app.server"],
        env=python_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    state.write_text(json.dumps({"pid": proc.pid, "arena": ""}))
    return proc, sock, state


def test_a_live_service_that_answers_slowly_or_starts_late_is_kept(tmp_path: Path) -> None:
    """A busy machine can keep a live service from answering for seconds, and a starting one writes its
    state before it listens: neither may be taken for dead and replaced."""
    for delay, start in ((1.5, 0.0), (0.0, 1.5)):
        proc, sock, state = _fake_service(tmp_path, delay, start)
        try:
            assert clean_stale(sock, state, patience=10.0)
            assert proc.poll() is None and sock.exists() and state.exists()
        finally:
            proc.kill()
            proc.wait(10)
            sock.unlink(missing_ok=True)


def test_a_service_silent_for_its_whole_patience_is_stopped_and_its_files_removed(tmp_path: Path) -> None:
    proc, sock, state = _fake_service(tmp_path, delay=-1)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "listening\n"
        assert not clean_stale(sock, state, patience=1.0)
        assert proc.wait(10) == -signal.SIGTERM
        assert not sock.exists() and not state.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
