"""Admin HTTP: /livez and /readyz in each state, /health (200 and 503), /metrics, /stats; no secrets."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.app.admin import AdminServer
from kvtier.app.client import ServiceClient
from kvtier.bench.ports import free_port
from tests.app import SPEC, hashes, thread_service
from tests.support.leak_check import kvtier_leak_session, leak_check, no_kvtier_leaks  # noqa: F401

TOKEN = "admin-test-secret-token"


def _get(port: int, path: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], err.read().decode()


def _exercise(url: str) -> dict[str, Any]:
    with ServiceClient(url, TOKEN) as client:
        ns = client.hello(SPEC).result(5).namespace
        keys = hashes(4)
        slots = [s for s in client.reserve(ns, keys).result(5).slots if s is not None]
        assert len(slots) == len(keys)
        client.commit(ns, keys, slots).result(5)
        client.lookup(ns, keys, "r").result(5)
        client.lookup(ns, hashes(2, "miss"), "r2").result(5)
        client.stage("r").result(5)
        client.release("r")
        stats: dict[str, Any] = client.stats().result(5)
        return stats


@pytest.fixture
def admin(tmp_path: Path) -> Any:
    port = free_port()
    with thread_service(tmp_path, admin_port=str(port), auth_token=TOKEN) as svc:
        yield svc, port


def test_health_is_200_with_tier_states_then_503_while_draining(admin: Any) -> None:
    svc, port = admin
    status, ctype, body = _get(port, "/health")
    assert status == 200 and ctype == "application/json"
    data = json.loads(body)
    assert data["serving"] and data["tiers"] == {"cpu": "up"}
    svc.call(lambda: setattr(svc.service, "draining", True))
    status, _, body = _get(port, "/health")
    assert status == 503 and json.loads(body)["serving"] is False
    svc.call(lambda: setattr(svc.service, "draining", False))


def test_metrics_parse_and_cover_the_required_families(admin: Any) -> None:
    svc, port = admin
    _exercise(svc.url)
    status, ctype, body = _get(port, "/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(body)}
    for name in (
        "kvtier_lookups",
        "kvtier_hit_chunks",
        "kvtier_hit_tokens",
        "kvtier_tier_read_bytes",
        "kvtier_tier_written_bytes",
        "kvtier_tier_evictions",
        "kvtier_tier_errors",
        "kvtier_leases_active",
        "kvtier_slots_in_use",
        "kvtier_write_queue_depth",
        "kvtier_lookup_seconds",
        "kvtier_stage_seconds",
        "kvtier_commit_seconds",
    ):
        assert name in families, name
    lookups = families["kvtier_lookups"].samples[0].value
    assert lookups == 2
    hits = {s.labels["tier"]: s.value for s in families["kvtier_hit_chunks"].samples}
    assert hits["cpu"] == 4
    tokens = {s.labels["tier"]: s.value for s in families["kvtier_hit_tokens"].samples}
    assert tokens["cpu"] == 4 * SPEC.chunk_size
    counts = [s for s in families["kvtier_lookup_seconds"].samples if s.name.endswith("_count")]
    assert counts[0].value == 2
    assert TOKEN not in body


def test_stats_matches_the_stats_call_and_hides_secrets(admin: Any) -> None:
    svc, port = admin
    via_call = _exercise(svc.url)
    status, _, body = _get(port, "/stats")
    assert status == 200
    data = json.loads(body)
    assert set(data) == set(via_call)
    assert data["tiers"]["cpu"]["chunks"] == via_call["tiers"]["cpu"]["chunks"] == 4
    assert {"leases_active", "slots_in_use"} <= set(data)
    for path in ("/stats", "/health", "/metrics"):
        assert TOKEN not in _get(port, path)[2]


def test_unknown_path_and_method(admin: Any) -> None:
    _svc, port = admin
    status, _, body = _get(port, "/nope")
    assert status == 404
    assert json.loads(body)["paths"] == ["/livez", "/readyz", "/health", "/metrics", "/stats"]
    request = urllib.request.Request(f"http://127.0.0.1:{port}/stats", method="POST", data=b"x")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=5)
    assert err.value.code == 405


def _probe(port: int, path: str) -> tuple[int, dict[str, Any]]:
    status, ctype, body = _get(port, path)
    assert ctype == "application/json"
    return status, json.loads(body)


def test_livez_stays_200_and_readyz_turns_503_while_draining(admin: Any) -> None:
    svc, port = admin
    instance = svc.service.instance_id
    assert _probe(port, "/livez") == (200, {"status": "alive", "instance_id": instance})
    assert _probe(port, "/readyz") == (200, {"ready": True, "reason": "ready", "instance_id": instance})
    svc.call(lambda: setattr(svc.service, "draining", True))
    try:
        assert _probe(port, "/readyz") == (
            503,
            {"ready": False, "reason": "draining", "instance_id": instance},
        )
        assert _probe(port, "/livez")[0] == 200
    finally:
        svc.call(lambda: setattr(svc.service, "draining", False))
    assert _probe(port, "/readyz")[0] == 200


def test_readyz_follows_the_listener_from_starting_to_stopping(tmp_path: Path) -> None:
    listening = threading.Event()
    with thread_service(tmp_path) as svc:

        async def start() -> AdminServer:
            assert svc.service is not None
            server = AdminServer(svc.service, "127.0.0.1", 0, accepting=listening.is_set)
            await server.start()
            return server

        server = svc.call(start)
        try:
            port = server.port
            states = []
            for step in ("starting", "accepting", "draining", "stopping"):
                if step == "accepting":
                    listening.set()
                elif step == "draining":
                    svc.call(lambda: setattr(svc.service, "draining", True))
                elif step == "stopping":
                    svc.call(lambda: setattr(svc.service, "draining", False))
                    listening.clear()
                status, body = _probe(port, "/readyz")
                states.append((step, status, body["ready"], body["reason"], _probe(port, "/livez")[0]))
        finally:
            svc.call(server.close)
    assert states == [
        ("starting", 503, False, "starting", 200),
        ("accepting", 200, True, "ready", 200),
        ("draining", 503, False, "draining", 200),
        ("stopping", 503, False, "stopping", 200),
    ]


def test_readyz_is_503_while_the_store_cannot_answer(admin: Any) -> None:
    svc, port = admin
    store = svc.service.store

    def broken() -> Any:
        raise RuntimeError("store closed")

    svc.call(lambda: setattr(store, "stats", broken))
    try:
        status, body = _probe(port, "/readyz")
        assert (status, body["ready"], body["reason"]) == (503, False, "store unavailable")
        assert _probe(port, "/livez")[0] == 200
    finally:
        svc.call(lambda: delattr(store, "stats"))
    assert _probe(port, "/readyz")[0] == 200


def test_livez_does_not_answer_while_the_event_loop_is_blocked(admin: Any) -> None:
    svc, port = admin
    release = threading.Event()
    blocked = threading.Event()

    def block() -> None:
        blocked.set()
        release.wait(30)  # holds the service's loop, as a stuck call would

    svc.loop.call_soon_threadsafe(block)
    try:
        assert blocked.wait(5)
        with pytest.raises(TimeoutError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/livez", timeout=1)
    finally:
        release.set()
    assert _probe(port, "/livez")[0] == 200
