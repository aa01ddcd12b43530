"""The kvtier service killed with SIGKILL under a running vLLM engine: vLLM keeps serving, outputs stay
identical, the connector reconnects (standalone) or respawns the service (embedded), hits resume.

Run as a module (``python -m tests.reliability.test_service_kill --driver JOB``) this file is the
engine process of the embedded test: one in-process vLLM engine with kvtier on its embedded default,
taking batches of prompts as JSON lines on stdin and answering each on stdout.

vLLM's prefix cache is on. A batch whose prefixes must come from kvtier (or be recomputed and saved
again) runs after ``forget_local`` emptied vLLM's cache; a chunk vLLM's own cache serves is never
saved by kvtier, so a prefix computed while the service was away is saved only once it is recomputed.
The first batch after a service (re)appears may miss saves (the worker maps the new arena on its
first steps), so hits are counted exactly on the third batch of a group, after two rounds of saves.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from kvtier.app.client import DEFAULT_TIMEOUT_S
from kvtier.bench.harness import Outputs, generate, generate_each, kv_transfer_config, running_engine
from kvtier.bench.introspect import scheduler_connector, worker_connector
from tests.e2e.oracle import assert_same_outputs
from tests.reliability.conftest import (
    CHUNK,
    MAX_TOKENS,
    PREFIX_TOKENS,
    SHORT_MAX_TOKENS,
    Oracle,
    batch,
    before_lookup,
    clear_cpu,
    delta,
    forget_local,
    local_hits,
    sched_counts,
    short_prompts,
    wait_for,
    wait_settled,
    worker_counts,
)
from tests.reliability.openai_load import (
    REPO,
    admin_stats,
    alive,
    free_port,
    http_get,
    kvtier_files,
    service_pids,
)
from tests.support.warm import starter

pytestmark = pytest.mark.e2e
MARK = "@@kvtier-driver "
CALL_TIMEOUT_S = DEFAULT_TIMEOUT_S  # how long the connector's client waits for any answer
FROZEN_WAIT_S = 25  # a correct engine needs the call timeout plus a few seconds


def test_standalone_service_sigkill_then_restart(
    tiny_model: str, oracle: Oracle, shm_dir: Path, services, tmp_path: Path
) -> None:
    """kill -9 of a standalone service in the middle of a workload, then a new one on its socket."""
    first, second = [24, 25, 26, 27], [28, 29, 30, 31]
    sp = services(tmp_path / "svc", shm_dir=shm_dir)
    svc = sp.start()
    cfg = kv_transfer_config(service_url=sp.url, chunk_size=CHUNK)
    with running_engine(tiny_model, cfg) as llm:
        assert_same_outputs(oracle(batch(first, 0)), generate_each(llm, batch(first, 0), MAX_TOKENS))
        forget_local(llm)
        # Killed in the middle of the batch: after its first two prompts' lookups were served (one
        # prompt at a time), before the third's starts.
        with before_lookup(llm, 3, sp.kill) as killed:
            got = generate_each(llm, batch(first, 1), MAX_TOKENS)
        assert killed.is_set(), "the workload ended before the service could be killed"
        assert_same_outputs(oracle(batch(first, 1)), got)

        # The service is dead: vLLM serves on, every lookup a miss at once.
        forget_local(llm)
        s0, w0, local0 = sched_counts(llm), worker_counts(), local_hits(llm)
        assert_same_outputs(oracle(batch(first, 2)), generate_each(llm, batch(first, 2), MAX_TOKENS))
        down_s, down_w = delta(sched_counts(llm), s0), delta(worker_counts(), w0)

        # A new service on the same socket: both sides of the connector reconnect by themselves.
        svc = sp.start()
        sched_client, worker_client = scheduler_connector(llm)._client, worker_connector()._client
        wait_for(lambda: sched_client.connected and worker_client.connected, 30, "the connector to reconnect")
        outs, resumed = _three_rounds(llm, second)
        local = local_hits(llm) - local0
        files = {p.name for p in kvtier_files(sp.tmp, shm_dir)}
        live_arena = Path(svc.client.arena.path).name  # type: ignore[union-attr]
    for j, out in enumerate(outs):
        assert_same_outputs(oracle(batch(second, j)), out)
    assert down_s["lookup_errors"] >= len(first), "lookups failed fast while the service was down"
    assert down_s["external_tokens"] == 0, down_s
    assert down_w["loaded_chunks"] == 0 and down_w["saved_chunks"] == 0, down_w
    _assert_resumed(resumed, len(second))
    assert local == 0, "vLLM's own cache served part of a batch that had to come from kvtier"
    # What a SIGKILL leaves (the dead instance's arena: cpu_size bytes of tmpfs memory) is gone once
    # a new service has started in the same shm_dir.
    assert files == {"kvtier.sock", live_arena}, f"the killed instance's arena is left behind: {files}"


def test_service_unreachable_at_engine_start_then_up(
    tiny_model: str, oracle: Oracle, services, tmp_path: Path
) -> None:
    """vLLM starts and serves while its configured service is not there; once it is, kvtier is used."""
    groups = [40, 41, 42, 43]
    sp = services(tmp_path / "svc")  # not started yet: nothing listens on its socket
    cfg = kv_transfer_config(service_url=sp.url, chunk_size=CHUNK)
    with running_engine(tiny_model, cfg) as llm:
        s0 = sched_counts(llm)
        assert_same_outputs(oracle(batch(groups, 0)), generate_each(llm, batch(groups, 0), MAX_TOKENS))
        down = delta(sched_counts(llm), s0)
        sp.start()
        sched_client, worker_client = scheduler_connector(llm)._client, worker_connector()._client
        wait_for(lambda: sched_client.connected and worker_client.connected, 30, "the connector to connect")
        # vLLM's own cache holds the prefixes from batch 0, which kvtier never saw: emptied, they are
        # recomputed and saved.
        local0 = local_hits(llm)
        outs, resumed = _three_rounds(llm, groups, first=1)
        local = local_hits(llm) - local0
    for j, out in zip((1, 2, 3), outs, strict=True):
        assert_same_outputs(oracle(batch(groups, j)), out)
    assert down["lookup_errors"] >= len(groups) and down["external_tokens"] == 0, down
    _assert_resumed(resumed, len(groups))
    assert local == 0, "vLLM's own cache served part of a batch that had to come from kvtier"
    # Invariant 8: every admission is counted, also those whose lookup failed.
    assert down["admissions"] == len(groups), f"admissions not counted while the service was down: {down}"


def _three_rounds(llm: Any, groups: list[int], first: int = 0) -> tuple[list[Outputs], dict[str, Any]]:
    """Batches first..first+2 of the groups, each after vLLM's own cache was emptied; the outputs
    and the connector's counters over the last batch."""
    outs = []
    for j in range(first, first + 3):
        forget_local(llm)
        s0, w0 = sched_counts(llm), worker_counts()
        outs.append(generate_each(llm, batch(groups, j), MAX_TOKENS))
    return outs, {"sched": delta(sched_counts(llm), s0), "worker": delta(worker_counts(), w0)}


def _assert_resumed(last: dict[str, Any], groups: int) -> None:
    """Two rounds of saves since the service came back: the last batch loads every prefix."""
    assert last["sched"]["external_tokens"] == groups * PREFIX_TOKENS, f"hits resumed: {last}"
    assert last["worker"]["loaded_tokens"] == groups * PREFIX_TOKENS, last
    assert last["worker"]["failed_load_chunks"] == 0, last


def test_frozen_service_neither_stalls_vllm_nor_leaks(
    tiny_model: str, oracle: Oracle, services, tmp_path: Path
) -> None:
    """The service stops answering (SIGSTOP) for longer than the client's call timeout, then resumes.

    A: prompts shorter than a chunk (no lookup) whose decode fills a chunk: their saves' reserve calls
    time out in the client; once the service resumes and executes them, no slot may stay reserved.
    B: prompts with a stored prefix: their lookups time out in the client and must be answered as
    misses, so vLLM finishes them while the service is still frozen.
    The engine runs in its own process (the driver below), so a stall fails the test instead of
    hanging it. Every finding is collected; the test reports them all.
    """
    groups = [44, 45, 46, 47]
    sp = services(tmp_path / "svc")
    svc = sp.start()
    cfg = kv_transfer_config(service_url=sp.url, chunk_size=CHUNK)
    driver = Driver({"model": tiny_model, "kv_config": cfg}, tmp_path / "engine.log")
    problems: list[str] = []
    outputs: dict[int, dict[str, Any]] = {}
    stuck = False
    try:
        driver.answer()
        outputs[0] = driver.ask(batch(groups, 0), concurrent=True)
        clear_cpu(svc)
        # A: reserve calls abandoned by the client.
        os.kill(sp.pid, signal.SIGSTOP)
        try:
            shorts = driver.ask(short_prompts(), concurrent=True, max_tokens=SHORT_MAX_TOKENS)
            # Every call the engine sent meanwhile ends in its client (waited on, not slept for):
            # the saves' reserve calls, given up on by the client at their deadline.
            driver.send({"settle": True})
            ended = driver.answer()["ended"]
        finally:
            os.kill(sp.pid, signal.SIGCONT)
        assert ended and set(ended) == {"CallTimeout"}, f"calls in flight while frozen ended with {ended}"
        quiet = wait_settled(svc)
        leaked = quiet["slots_in_use"] - quiet["tiers"]["cpu"]["chunks"]
        if quiet["leases_active"] or leaked:
            problems.append(
                f"A: after the service resumed, {leaked} arena slots stay reserved by reserve calls the "
                f"client had given up on (leases held: {quiet['leases_active']})"
            )
        # B: lookup calls abandoned by the client.
        clear_cpu(svc)
        driver.ask([], forget=True)
        os.kill(sp.pid, signal.SIGSTOP)
        try:
            driver.send({"prompts": batch(groups, 1), "concurrent": True})
            frozen = driver.poll(FROZEN_WAIT_S)
        finally:
            os.kill(sp.pid, signal.SIGCONT)
        if frozen is None:
            frozen = driver.poll(60)
            problems.append(
                f"B: vLLM did not finish a batch within {FROZEN_WAIT_S}s while the service was frozen (the "
                f"client gives up on a call after {CALL_TIMEOUT_S}s); "
                + ("it finished only after the service resumed" if frozen else "it is still stuck")
            )
        stuck = frozen is None
        if frozen is not None:
            outputs[1] = frozen
            # Saves are best effort: those of the first step after the resume may still be skipped
            # (the worker only probes for answers then), so the last of three more batches loads every
            # prefix. Each runs after vLLM's own cache was emptied: batch 1 left the prefixes there.
            outputs.update({j: driver.ask(batch(groups, j), forget=True) for j in (2, 3, 4)})
            after = wait_settled(svc)
    finally:
        driver.close(5 if stuck else 60)
    assert_same_outputs(oracle(short_prompts(), SHORT_MAX_TOKENS), Outputs(shorts["tokens"]))
    for j, reply in outputs.items():
        assert_same_outputs(oracle(batch(groups, j)), Outputs(reply["tokens"]))
    assert not problems, "\n".join(problems)
    during = delta(outputs[1]["sched"], shorts["sched"])
    assert during["lookup_errors"] >= len(groups) and during["external_tokens"] == 0, during
    assert after["leases_active"] == 0, after
    assert after["slots_in_use"] == after["tiers"]["cpu"]["chunks"], after
    last = {side: delta(outputs[4][side], outputs[3][side]) for side in ("sched", "worker")}
    _assert_resumed(last, len(groups))
    assert outputs[4]["local_hits"] == outputs[0]["local_hits"], "vLLM's own cache served a batch"


# ------------------------------------------------------------------------------------- embedded
class Driver:
    """The engine process of the embedded test, talked to over stdin/stdout."""

    def __init__(self, job: dict[str, Any], log: Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        env["PYTHONPATH"] = str(REPO)
        self._log = open(log, "wb")  # noqa: SIM115 - closed in close()
        to_engine, from_engine = os.pipe(), os.pipe()  # (read end, write end) each
        try:
            self.proc = starter().start(
                "tests.reliability.test_service_kill", ["--driver", json.dumps(job)], env=env, cwd=REPO,
                stdin=to_engine[0], stdout=from_engine[1], stderr=self._log.fileno(),
            )  # fmt: skip
        finally:
            os.close(to_engine[0])
            os.close(from_engine[1])
        self._stdin = open(to_engine[1], "wb")  # noqa: SIM115 - closed in close()
        self._stdout = open(from_engine[0], "rb")  # noqa: SIM115 - closed by the reader at its end
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        # An embedded service the engine started holds its stdout too, and may write after close().
        self._log_lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with self._stdout:
            for raw in self._stdout:
                line = raw.decode(errors="replace")
                if line.startswith(MARK):
                    self._answers.put(json.loads(line[len(MARK) :]))
                    continue
                with self._log_lock:  # vLLM logs to stdout: keep it beside stderr, until close()
                    if not self._log.closed:
                        self._log.write(raw)
                        self._log.flush()
        self._answers.put(None)

    def poll(self, timeout: float) -> dict[str, Any] | None:
        """The next answer, or None when none came within timeout seconds."""
        try:
            reply = self._answers.get(timeout=timeout)
        except queue.Empty:
            return None
        if reply is None:
            raise AssertionError(f"the engine process exited with {self.proc.wait(10)}")
        return reply

    def answer(self, timeout: float = 180) -> dict[str, Any]:
        reply = self.poll(timeout)
        if reply is None:
            raise AssertionError(f"the engine process gave no answer within {timeout:.0f}s")
        return reply

    def ask(
        self,
        prompts: list[list[int]],
        concurrent: bool = False,
        max_tokens: int = MAX_TOKENS,
        forget: bool = False,
    ) -> dict[str, Any]:
        """Run a batch (after emptying vLLM's own prefix cache, with forget); the answer holds its
        tokens, the connector's counters and vLLM's local prefix-cache hits after it."""
        self.send({"prompts": prompts, "concurrent": concurrent, "max_tokens": max_tokens, "forget": forget})
        return self.answer()

    def send(self, message: dict[str, Any]) -> None:
        self._stdin.write((json.dumps(message) + "\n").encode())
        self._stdin.flush()

    def run(self, prompts: list[list[int]]) -> Outputs:
        return Outputs(self.ask(prompts)["tokens"])

    def close(self, timeout: float = 60) -> int:
        """Ask the engine process to exit (SIGKILL after timeout); its exit status."""
        if self.proc.poll() is None:
            try:
                self.send({"exit": True})
            except OSError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        with contextlib.suppress(OSError):  # the engine may be gone, with what was left unsent
            self._stdin.close()
        with self._log_lock:
            self._log.close()
        return self.proc.wait()


def _one_service(engine_pid: int) -> int:
    pids = service_pids(engine_pid)
    return pids.pop() if len(pids) == 1 else 0


def _admin_up(port: int) -> bool:
    try:
        return http_get(port, "/health", timeout=2)[0] == 200
    except OSError:
        return False  # not listening yet


def test_embedded_service_sigkill_is_respawned(
    tiny_model: str, oracle: Oracle, tmp_path: Path, shm_dir: Path
) -> None:
    first, second = [32, 33, 34, 35], [36, 37, 38, 39]
    shm = shm_dir
    admin = free_port()
    # No service_url: the embedded default, one private service per engine, spawned by the connector.
    cfg = kv_transfer_config(chunk_size=CHUNK, cpu_size="64MiB", shm_dir=str(shm), admin_port=admin)
    driver = Driver({"model": tiny_model, "kv_config": cfg}, tmp_path / "engine.log")
    runtime = Path(os.environ["XDG_RUNTIME_DIR"]) / "kvtier"
    try:
        engine_pid = driver.answer()["ready"]
        first_pid = wait_for(lambda: _one_service(engine_pid), 30, "the embedded service")
        assert_same_outputs(oracle(batch(first, 0)), driver.run(batch(first, 0)))
        lookups0 = admin_stats(admin)["lookups"]

        # kill -9 the service while the next batch runs (after its first lookup was served).
        driver.send({"prompts": batch(first, 1), "forget": True})
        wait_for(lambda: admin_stats(admin)["lookups"] > lookups0, 60, "a lookup of the batch")
        os.kill(first_pid, 9)
        assert_same_outputs(oracle(batch(first, 1)), Outputs(driver.answer()["tokens"]))

        # The connector spawned a new service; it serves the same admin port and, soon, hits.
        second_pid = wait_for(
            lambda: (pid := _one_service(engine_pid)) != first_pid and pid, 60, "a respawned service"
        )
        wait_for(lambda: _admin_up(admin), 30, "the respawned service's admin port")
        replies = [driver.ask(batch(second, j), forget=True) for j in range(3)]
        outs = [Outputs(reply["tokens"]) for reply in replies]
        arenas = [p for p in kvtier_files(shm) if p.suffix == ".arena"]
        sockets = [p for p in kvtier_files(runtime) if p.suffix == ".sock"]
    finally:
        status = driver.close()
    for j, out in enumerate(outs):
        assert_same_outputs(oracle(batch(second, j)), out)
    assert not alive(first_pid)
    _assert_resumed(
        {side: delta(replies[2][side], replies[1][side]) for side in ("sched", "worker")}, len(second)
    )
    assert replies[2]["local_hits"] == replies[0]["local_hits"], "vLLM's own cache served a batch"
    assert len(arenas) == 1, f"the killed service's arena was not cleaned up: {arenas}"
    assert len(sockets) == 1, sockets
    assert status == 0, f"the engine process failed:\n{(tmp_path / 'engine.log').read_text()[-3000:]}"
    # The engine is gone: its service stops by itself and removes its socket and arena.
    wait_for(lambda: not alive(second_pid), 30, "the embedded service to exit with its engine")
    wait_for(lambda: not kvtier_files(shm, runtime), 10, f"files to go: {kvtier_files(shm, runtime)}")


# ----------------------------------------------------------------------------------------- driver
def _driver(job: dict[str, Any]) -> int:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    with running_engine(job["model"], job["kv_config"]) as llm:
        print(MARK + json.dumps({"ready": os.getpid()}), flush=True)
        for line in sys.stdin:
            message = json.loads(line)
            if message.get("exit"):
                break
            if message.get("settle"):
                print(MARK + json.dumps({"ended": _settle(llm)}), flush=True)
                continue
            if message.get("forget"):
                forget_local(llm)
            run = generate if message.get("concurrent") else generate_each
            prompts = message["prompts"]
            tokens = run(llm, prompts, message.get("max_tokens", MAX_TOKENS)).tokens if prompts else []
            counts = {"sched": sched_counts(llm), "worker": worker_counts(), "local_hits": local_hits(llm)}
            print(MARK + json.dumps({"tokens": tokens, **counts}), flush=True)
    return 0


def _settle(llm: Any) -> list[str]:
    """Wait until every call the engine's clients have in flight has ended; how each ended (the
    name of its error, or "answered")."""
    ended = []
    for client in (scheduler_connector(llm)._client, worker_connector()._client):
        assert client is not None, "the connector has no client: it did not start serving"
        with client._lock:
            calls = [*client._pending.values(), *client._queue]
        for call in calls:
            error = call.exception()  # no timeout: the client's sweep fails it at its deadline
            ended.append("answered" if error is None else type(error).__name__)
    return ended


if __name__ == "__main__" and sys.argv[1:2] == ["--driver"]:
    sys.exit(_driver(json.loads(sys.argv[2])))
