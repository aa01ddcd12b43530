"""A fleet of two nodes that share nothing but a bucket (a real SeaweedFS): an engine on node A stores,
an engine on node B hits from the object tier, and both give vLLM's outputs without kvtier. Each
node's KV events, `kvtier stats`, `kvtier clear --tier object` and the Prometheus metrics of the
service and of the connector show the tier."""

from __future__ import annotations

import asyncio
import urllib.request
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import obstore
import pytest

from kvtier.app import cli
from kvtier.app.events import MEDIUM
from kvtier.bench.harness import Outputs, generate_each, kv_transfer_config, make_prompt, running_engine
from kvtier.bench.introspect import scheduler_connector
from kvtier.bench.ports import free_port
from kvtier.connector.stats import merge_counts
from kvtier.storage.base import Tier
from kvtier.storage.config import ObjectConfig
from kvtier.storage.tiers.object_client import build_store
from tests.app import wait_until
from tests.e2e.oracle import assert_same_outputs, expected_external, wait_written
from tests.e2e.service import RunningService, running_service
from tests.support.events_example import load_subscriber_example
from tests.support.object_store import BUCKET, SeaweedServer

pytestmark = pytest.mark.e2e
CHUNK = 64
MAX_TOKENS = 10
PROMPTS = [make_prompt(500, 330), make_prompt(501, 270)]
STORED = sum(len(p) // CHUNK for p in PROMPTS)  # 5 + 4 full chunks
HIT = sum(expected_external(len(p) // CHUNK, 0, len(p), CHUNK) for p in PROMPTS)
OBJECT = MEDIUM[Tier.OBJECT]


@pytest.fixture(scope="module")
def expected(tiny_model: str) -> Outputs:
    with running_engine(tiny_model) as llm:
        return generate_each(llm, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def bucket(s3_server: SeaweedServer, aws_env_module: dict[str, str]) -> dict[str, Any]:
    """The object tier's settings of every node: one prefix of the module's bucket (the services
    inherit the AWS variables of aws_env_module)."""
    return {
        "object_url": f"s3://{BUCKET}/fleet-{uuid.uuid4().hex[:8]}",
        "object_endpoint": s3_server.endpoint,
        "object_timeout": 30,  # a fresh SeaweedFS grows a volume on its first write
    }


def node(tmp: Path, name: str, bucket: dict[str, Any]) -> dict[str, Any]:
    """A node's settings: its own runtime dir, disk tier, events sockets and admin port."""
    return dict(
        disk_path=tmp / name / "disk",
        events_url=f"ipc://{tmp}/{name}-events",
        events_replay_url=f"ipc://{tmp}/{name}-replay",
        events_hash_format="bytes",
        admin_port=free_port(),
        **bucket,
    )


def sched_counts(llm: Any) -> dict[str, Any]:
    """The scheduler side's counters since the engine started (reported and not yet)."""
    side = scheduler_connector(llm)._sched
    return merge_counts(side.totals, asdict(side.counters))


def connector_hit_tokens(llm: Any) -> dict[str, float]:
    """vLLM's exported `vllm:kvtier_hit_tokens`, by tier."""
    return {m.labels["tier"]: float(m.value) for m in llm.get_metrics() if m.name == "vllm:kvtier_hit_tokens"}


def service_metric(port: int, line_start: str) -> float:
    """The value of one sample of the service's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    (line,) = [ln for ln in text.splitlines() if ln.startswith(line_start + " ")]
    return float(line.rsplit(" ", 1)[1])


def record_block_hashes(llm: Any) -> list[list[bytes]]:
    """From now on, the vLLM block hashes of every request the engine's connector sees."""
    side = scheduler_connector(llm)._sched
    arrive = side.on_new_request
    seen: list[list[bytes]] = []

    def recording(request: Any) -> None:
        seen.append([bytes(h) for h in request.block_hashes])
        arrive(request)

    side.on_new_request = recording
    return seen


def held_objects(view: Any, expected: set[bytes]) -> bool:
    """Apply the events published so far; whether the OBJECT medium holds exactly expected."""
    while view.poll(200):
        pass
    return view.held.get(OBJECT, set()) == expected


def bucket_keys(bucket: dict[str, Any]) -> list[str]:
    """Paths of every object under the fleet's prefix, read by a client of the test's own."""
    store = build_store(ObjectConfig(url=bucket["object_url"], endpoint=bucket["object_endpoint"]))

    async def listed() -> list[str]:
        return [m["path"] async for page in obstore.list(store, None) for m in page]

    return asyncio.run(listed())


def cli_run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """`kvtier ARGV` in this process; its stdout (fails on a non-zero exit)."""
    capsys.readouterr()
    assert cli.main(argv) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def test_a_node_hits_what_another_stored_through_the_bucket_alone(
    tiny_model: str,
    expected: Outputs,
    bucket: dict[str, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    events = load_subscriber_example()
    a_settings, b_settings = node(tmp_path, "a", bucket), node(tmp_path, "b", bucket)
    with running_service(tmp_path / "a", **a_settings) as a:
        view = events.TierView(a_settings["events_url"], a_settings["events_replay_url"])
        try:
            with running_engine(tiny_model, kv_transfer_config(service_url=a.url, chunk_size=CHUNK)) as llm:
                seen = record_block_hashes(llm)
                stored = generate_each(llm, PROMPTS, MAX_TOKENS)
            wait_written(a, "object", STORED)
            chunks = _chunk_blocks(a, seen)
            uploaded = {h for blocks in chunks for h in blocks}
            # Node A announces each upload with the block hashes of its chunk.
            assert wait_until(lambda: held_objects(view, uploaded), 30), (view.held.get(OBJECT), uploaded)
        finally:
            view.close()
        assert a.stats()["tiers"]["object"]["stores"] == STORED
    assert_same_outputs(expected, stored)
    assert len(bucket_keys(bucket)) == STORED

    with running_service(tmp_path / "b", **b_settings) as b:
        view = events.TierView(b_settings["events_url"], b_settings["events_replay_url"])
        try:
            assert wait_until(lambda: not b.stats()["tiers"]["object"]["loading"], 30)
            view.catch_up()  # the LIST's batches went out before this subscriber joined
            # Node B's LIST at start found them: announced in full from their trailers, as node A did.
            listed = uploaded
            assert wait_until(lambda: held_objects(view, listed), 30), (view.held.get(OBJECT), listed)
            with running_engine(tiny_model, kv_transfer_config(service_url=b.url, chunk_size=CHUNK)) as llm:
                got = generate_each(llm, PROMPTS, MAX_TOKENS)
                counts = sched_counts(llm)
                exported = connector_hit_tokens(llm)
            hits = b.hit_tokens()
            admin = b_settings["admin_port"]
            exported_tier = {
                name: service_metric(admin, f'kvtier_tier_{name}{{tier="object"}}')
                for name in ("hits_total", "chunks", "loading", "healthy")
            }
            table = cli_run(["stats", "--url", b.url], capsys)
            b.wait_leases_ended()
            cleared = cli_run(["clear", "--tier", "object", "--url", b.url, "--json"], capsys)
            assert wait_until(lambda: held_objects(view, set()), 30), view.held.get(OBJECT)
            after = b.stats()["tiers"]["object"]
        finally:
            view.close()
    assert_same_outputs(expected, got)
    assert hits == {"cpu": 0, "disk": 0, "redis": 0, "object": HIT}, hits
    assert counts["hit_tokens_object"] == HIT and counts["external_tokens"] == HIT, counts
    assert exported.get("object") == HIT, exported
    assert exported_tier == {"hits_total": STORED, "chunks": STORED, "loading": 0, "healthy": 1}
    (row,) = [line for line in table.splitlines() if line.startswith("object ")]
    assert row[8 + 33 : 8 + 44].strip() == str(STORED) and row.endswith("up"), table  # hits, state
    assert cleared.strip() == f'{{"absent": [], "dropped": {STORED}, "tiers": ["object"]}}'
    assert (after["chunks"], bucket_keys(bucket)) == (0, [])


def _chunk_blocks(svc: RunningService, seen: list[list[bytes]]) -> list[list[bytes]]:
    """The block hashes of every full chunk of the recorded requests."""
    spec = next(iter(svc.stats()["namespace_specs"].values()))
    bpc = spec["chunk_size"] // spec["block_size"]
    return [blocks[end - bpc : end] for blocks in seen for end in range(bpc, len(blocks) + 1, bpc)]
