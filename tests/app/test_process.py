"""The service as a process: SIGTERM shutdown, a client killed mid-call, `kvtier stats --json`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvtier.app import protocol as p
from kvtier.app.client import ServiceClient, ServiceUnavailable
from tests.app import ROOT, SPEC, RawConn, hashes, kvtier_cmd, python_env, thread_service, wait_until
from tests.support.leak_check import kvtier_leak_session, leak_check, no_kvtier_leaks  # noqa: F401

VICTIM = """
import sys, time
from kvtier.app.client import ServiceClient
from tests.app import SPEC, hashes
client = ServiceClient(sys.argv[1])
ns = client.hello(SPEC).result(5).namespace
kept = hashes(4, "kept")
got = client.reserve(ns, kept).result(5)
client.commit(ns, kept, got.slots).result(5)
assert client.lookup(ns, kept, "victim-lease").result(5).result.num_hit == 4
assert all(client.reserve(ns, hashes(3, "dangling")).result(5).slots)
client.stage("victim-lease")  # slowed down by the test: in flight when this process dies
print("ready", flush=True)
time.sleep(60)
"""


def test_client_killed_mid_call_leaks_no_slot_and_leaves_its_lease_to_a_release(tmp_path: Path) -> None:
    with thread_service(tmp_path) as svc:
        store = svc.service.store
        real_stage = store.stage
        gate = asyncio.Event()

        async def held_stage(lease_id: str) -> Any:
            await gate.wait()
            return await real_stage(lease_id)

        store.stage = held_stage  # type: ignore[method-assign]
        victim = subprocess.Popen(
            [sys.executable, "-c", VICTIM, svc.url],
            env=python_env(),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert victim.stdout is not None and victim.stdout.readline().strip() == "ready"
            assert svc.wait_for(lambda: any(c.inflight for c in svc.service.connections))
            stats = svc.call(svc.service.stats)
            assert (stats["leases_active"], stats["slots_in_use"]) == (1, 7)
        finally:
            victim.kill()
            victim.wait(10)
        assert svc.wait_for(lambda: svc.service.connection_count == 0)
        assert svc.call(svc.service.owned) == (1, 3)  # its call in flight ends first
        svc.call(gate.set)
        stats = svc.wait_for(lambda: (s := svc.service.stats())["slots_in_use"] == 4 and s)
        assert stats, svc.call(svc.service.stats)
        assert stats["tiers"]["cpu"]["chunks"] == 4
        # Its lease outlives it (a worker may still copy from its slots) until released or expired.
        assert svc.call(svc.service.owned) == (1, 0)
        with RawConn(svc.url) as worker:
            worker.hello()
            assert worker.call(p.Release(id=2, lease_id="victim-lease")) == p.OkReply(id=2)
        assert svc.call(svc.service.owned) == (0, 0)


def test_sigterm_shuts_down_and_removes_socket_and_arena(tmp_path: Path) -> None:
    sock = tmp_path / "svc.sock"
    token = "sigterm-test-secret-token"
    env = python_env(KVTIER_SHM_DIR=str(tmp_path), KVTIER_CPU_SIZE="4MiB", KVTIER_AUTH_TOKEN=token,
                     KVTIER_LOG_LEVEL="DEBUG")  # fmt: skip
    proc = subprocess.Popen(
        kvtier_cmd("serve", "--url", f"unix://{sock}"), env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True
    )
    try:
        assert wait_until(sock.exists, 20), "service did not start"
        assert len(list(tmp_path.glob("kvtier-*.arena"))) == 1
        with RawConn(f"unix://{sock}") as intruder:  # a wrong token is refused and logged
            assert intruder.hello(token="guess").code == "auth"
        with ServiceClient(f"unix://{sock}", token) as client:
            ns = client.hello(SPEC).result(5).namespace
            keys = hashes(4)
            got = client.reserve(ns, keys).result(5)
            client.commit(ns, keys[:2], got.slots[:2]).result(5)
            client.lookup(ns, keys[:2], "lease").result(5)
            proc.send_signal(signal.SIGTERM)
            _out, err = proc.communicate(timeout=20)
            assert proc.returncode == 0, err
            assert wait_until(lambda: not client.connected, 5)
            assert isinstance(client.health().exception(5), ServiceUnavailable)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not sock.exists()
    assert not list(tmp_path.glob("kvtier-*.arena"))
    logs = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert {"serving", "stopped"} <= {entry["msg"] for entry in logs}
    assert any(entry.get("kind") == "auth" for entry in logs)
    assert token not in err


def test_kvtier_stats_json_shape(tmp_path: Path) -> None:
    with thread_service(tmp_path) as svc:
        with ServiceClient(svc.url) as client:
            ns = client.hello(SPEC).result(5).namespace
            got = client.reserve(ns, hashes(3)).result(5)
            client.commit(ns, hashes(3), got.slots).result(5)
        out = subprocess.run(
            kvtier_cmd("stats", "--url", svc.url, "--json"),
            env=python_env(),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr
        stats = json.loads(out.stdout)
        assert {"tiers", "leases_active", "slots_in_use"} <= set(stats)
        for tier in stats["tiers"].values():
            assert {"chunks", "bytes", "hits", "stores", "evictions", "errors"} <= set(tier)
        assert stats["tiers"]["cpu"]["chunks"] == 3 and stats["slots_in_use"] == 3
        table = subprocess.run(
            kvtier_cmd("stats", "--url", svc.url),
            env=python_env(),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert table.returncode == 0 and "cpu" in table.stdout and "leases_active" in table.stdout


def test_kvtier_stats_without_a_service_fails_cleanly(tmp_path: Path) -> None:
    out = subprocess.run(
        kvtier_cmd("stats", "--url", f"unix://{tmp_path}/none.sock", "--json"),
        env=python_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 1 and "none.sock" in out.stderr and not out.stdout


def test_the_parents_exit_is_reported_once_though_its_pidfd_stays_readable() -> None:
    from kvtier.app.server import watch_exit

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    pidfd = os.pidfd_open(child.pid)
    calls: list[int] = []

    async def turns() -> None:
        watch_exit(asyncio.get_running_loop(), pidfd, lambda: calls.append(1))
        for _ in range(20):  # turns of the loop: a reader still registered would run on each
            await asyncio.sleep(0)

    try:
        child.wait(30)
        asyncio.run(turns())
    finally:
        os.close(pidfd)
    assert calls == [1]
