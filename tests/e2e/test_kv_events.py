"""KV events through a real engine: a subscriber that reads only kvtier's events holds, per tier,
exactly the block hashes the service holds, through CPU eviction, disk writes, a corrupt blob, a
clear and a restart with the disk kept; a late subscriber catches up through the replay socket; the
admin lookup answers as the connector's lookup does."""

from __future__ import annotations

import importlib.util
import json
import socket
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvtier.app.events import MEDIUM
from kvtier.bench.harness import generate_each, kv_transfer_config, make_prompt, running_engine
from kvtier.bench.introspect import scheduler_connector
from kvtier.storage import codec
from kvtier.storage.base import ChunkKey, Tier
from kvtier.storage.keys import disk_relpath
from tests.app import wait_until
from tests.e2e.oracle import forget_local_cache, wait_written
from tests.e2e.service import RunningService, running_service

pytestmark = pytest.mark.e2e
CHUNK = 64
PROMPTS = [
    make_prompt(300 + i, 270) for i in range(5)
]  # 4 chunks each: 20 chunks, more than the CPU tier holds
EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "kv_events_subscriber.py"


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("kv_events_subscriber", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its structs' annotations are resolved in its namespace
    spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(port: int, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/lookup", data=json.dumps(body).encode(), method="POST"
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
        return answer


def record_block_hashes(llm: Any) -> list[list[bytes]]:
    """From now on, the vLLM block hashes of every request the engine's connector sees, in order."""
    side = scheduler_connector(llm)._sched
    arrive = side.on_new_request
    seen: list[list[bytes]] = []

    def recording(request: Any) -> None:
        seen.append([bytes(h) for h in request.block_hashes])
        arrive(request)

    side.on_new_request = recording
    return seen


def service_holds(port: int, ns: str, bpc: int, prompts_blocks: list[list[bytes]]) -> dict[str, set[bytes]]:
    """Per medium, the block hashes of every chunk the service's index holds, asked chunk by chunk."""
    held: dict[str, set[bytes]] = {MEDIUM[Tier.CPU]: set(), MEDIUM[Tier.DISK]: set()}
    for blocks in prompts_blocks:
        for end in range(bpc, len(blocks) + 1, bpc):
            chunk = blocks[end - bpc : end]
            answer = _post(
                port, {"namespace": ns, "block_hashes": [h.hex() for h in chunk], "blocks_per_chunk": bpc}
            )
            for tier in (Tier.CPU, Tier.DISK):
                if answer["tiers"][tier.label]:
                    held[MEDIUM[tier]].update(chunk)
    return held


def drain(view: Any) -> None:
    """Apply every batch published so far (the stream goes quiet once the service is idle)."""
    while view.poll(500):
        pass


def settled(view: Any, expected: dict[str, set[bytes]]) -> bool:
    drain(view)
    return {m: view.held.get(m, set()) for m in expected} == expected


def test_a_subscriber_rebuilds_every_tier_through_eviction_corruption_clear_and_restart(
    tiny_model: str, tmp_path: Path
) -> None:
    mod = _example()
    events, replay = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    admin = _free_port()
    settings = dict(
        disk_path=tmp_path / "disk",
        cpu_size="1MiB",
        events_url=events,
        events_replay_url=replay,
        events_hash_format="bytes",
        admin_port=admin,
    )
    view = mod.TierView(events, replay)
    try:
        with running_service(tmp_path / "svc1", **settings) as svc:
            cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK)
            with running_engine(tiny_model, cfg) as llm:
                seen = record_block_hashes(llm)
                generate_each(llm, PROMPTS, 4)
                wait_written(svc, "disk", len(PROMPTS) * 4)
                ns, spec = next(iter(svc.stats()["namespace_specs"].items()))
                bpc = spec["chunk_size"] // spec["block_size"]
                blocks = seen[: len(PROMPTS)]
                assert svc.stats()["tiers"]["cpu"]["evictions"] > 0, "the CPU tier never evicted"
                _corrupt_first_chunk(tmp_path / "disk", ns, blocks[0][bpc - 1], svc, llm)
                _lookup_api_matches_the_connectors(svc, admin, ns, bpc, blocks)
                assert svc.clear(Tier.CPU) > 0
            before = service_holds(admin, ns, bpc, blocks)
            assert before[MEDIUM[Tier.CPU]] == set() and before[MEDIUM[Tier.DISK]]
            assert wait_until(lambda: settled(view, before), 30), (view.held, before)
        with running_service(tmp_path / "svc2", **settings) as svc:
            wait_until(lambda: not svc.stats()["tiers"]["disk"]["loading"], 30)
            truth = service_holds(admin, ns, bpc, blocks)
            assert truth == before  # the disk kept what it held; the CPU tier starts empty
            assert wait_until(lambda: settled(view, truth), 30), (view.held, truth)
            late = mod.TierView(events, replay)
            try:
                late.catch_up()
                assert {m: late.held.get(m, set()) for m in truth} == truth
            finally:
                late.close()
    finally:
        view.close()


def _corrupt_first_chunk(disk: Path, ns: str, last_hash: bytes, svc: RunningService, llm: Any) -> None:
    """Flip a payload byte of the first prompt's first chunk on disk, then make a load read it."""
    key = ChunkKey(ns, last_hash)
    path = disk / disk_relpath(key)
    with open(path, "r+b") as f:
        f.seek(codec.header_size(key) + 100)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    svc.clear(Tier.CPU)
    forget_local_cache(llm)
    generate_each(llm, PROMPTS[:1], 4)  # a disk hit that fails verification: the file is deleted
    assert svc.stats()["tiers"]["disk"]["errors"] == 1  # the corrupt read, counted


def _lookup_api_matches_the_connectors(
    svc: RunningService, admin: int, ns: str, bpc: int, blocks: list[list[bytes]]
) -> None:
    """The admin lookup's leading blocks equal the service's answer to the connector's lookup."""
    svc.wait_leases_ended()
    for i, prompt_blocks in enumerate(blocks):
        answer = _post(admin, {"namespace": ns, "block_hashes": [h.hex() for h in prompt_blocks]})
        chunk_hashes = prompt_blocks[bpc - 1 :: bpc]
        result = svc.client.lookup(ns, chunk_hashes, f"events-test-{i}").result(10).result
        svc.client.release(f"events-test-{i}")
        assert answer["held"] == result.num_hit * bpc, (i, answer, result)
    svc.wait_leases_ended()
