"""Routing on kvtier's events: two nodes, each a kvtier service and a vLLM engine with its own KV
events, sharing one Redis. A token-keyed indexer that follows llm-d's rules (tests/support/indexer.py),
fed every engine's GPU events and every service's events, names the node whose tiers hold the longest
prefix of a new prompt, and that node's engine then loads exactly that many tokens from kvtier, with
vLLM's outputs. After node B's service and engine restart, B's disk tier alone, announced by kvtier
without a GPU event, routes B's prompt back to B. Node A's chunks in the shared Redis are announced by
A only (kvtier does not list a shared Redis): B loads them too, but the indexer credits A.

Engines run one at a time (vLLM's connector state is per process): the oracle (no kvtier), B, A, B again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from vllm.config.kv_events import KVEventsConfig

from kvtier.bench.harness import (
    BLOCK_SIZE,
    Outputs,
    generate,
    kv_transfer_config,
    make_prompt,
    running_engine,
)
from kvtier.bench.introspect import scheduler_totals
from tests.e2e.oracle import assert_same_outputs, expected_external, forget_local_cache, wait_written
from tests.e2e.service import RunningService, running_service
from tests.e2e.test_kv_events import replay_all
from tests.support.indexer import Indexer
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.e2e
CHUNK = 64
MODEL = "tiny"
MAX_TOKENS = 6
WEIGHTS = {"gpu": 1.0, "cpu": 0.8, "cpu_kvtier": 0.8, "disk": 0.6, "redis": 0.5, "object": 0.4}
KVTIER_MEDIA = {"cpu_kvtier", "disk", "redis", "object"}
P_A, P_B = make_prompt(600, 270), make_prompt(601, 270)  # each node's first prompt: 4 chunks
# New prompts: a node's prompt with another ending (the router's question), and one of nobody's.
Q_A, Q_B, FRESH = P_A[:256] + make_prompt(602, 40), P_B[:256] + make_prompt(603, 40), make_prompt(604, 100)
STORED_BLOCKS = 256 // BLOCK_SIZE  # the four chunks of P_A or P_B


@dataclass
class Fleet:
    """The two nodes' settings and every event stream seen so far, in the order it was published."""

    tmp: Path
    redis_url: str
    streams: list[list[tuple[bytes, Any]]] = field(default_factory=list)  # finished streams
    live: dict[str, str] = field(default_factory=dict)  # kvtier replay endpoints still serving

    def settings(self, node: str) -> dict[str, Any]:
        return dict(
            disk_path=self.tmp / f"disk-{node}",
            redis_url=self.redis_url,
            events_url=f"ipc://{self.tmp}/{node}-events",
            events_replay_url=f"ipc://{self.tmp}/{node}-replay",
            events_topic=f"kv@pod-{node}@{MODEL}",
        )

    def gpu_events(self, node: str) -> KVEventsConfig:
        return KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=f"ipc://{self.tmp}/{node}-gpu-events",
            replay_endpoint=f"ipc://{self.tmp}/{node}-gpu-replay",
            topic=f"kv@pod-{node}@{MODEL}",
        )

    def indexer(self) -> Indexer:
        """An indexer fed every stream: the finished ones, then the services still serving."""
        indexer = Indexer(BLOCK_SIZE, WEIGHTS)
        for stream in [*self.streams, *(replay_all(url) for url in self.live.values())]:
            for topic, batch in stream:
                indexer.apply(topic, batch)
        assert not indexer.dropped, indexer.dropped
        return indexer


@pytest.fixture(scope="module")
def expected(tiny_model: str) -> Outputs:
    with running_engine(tiny_model) as llm:
        return Outputs([generate(llm, [q], MAX_TOKENS).tokens[0] for q in (Q_A, Q_B, FRESH)])


@pytest.fixture
def fleet(tmp_path: Path, redis_server_fn: RedisServer) -> Fleet:
    return Fleet(tmp_path, redis_server_fn.url)


@dataclass
class Node:
    """One node's running service and engine."""

    name: str
    svc: RunningService
    llm: Any


@contextlib.contextmanager
def _node(fleet: Fleet, name: str, tiny_model: str) -> Iterator[Node]:
    """Start a node's service and engine; on the way out keep their event streams (the GPU's only
    when the node's work ended without an error)."""
    with running_service(fleet.tmp / f"svc-{name}", **fleet.settings(name)) as svc:
        fleet.live[name] = fleet.settings(name)["events_replay_url"]
        try:
            cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK)
            with running_engine(tiny_model, cfg, kv_events_config=fleet.gpu_events(name)) as llm:
                yield Node(name, svc, llm)
                fleet.streams.append(replay_all(f"ipc://{fleet.tmp}/{name}-gpu-replay"))
        finally:
            fleet.streams.append(replay_all(fleet.live.pop(name)))


def _store(node: Node, prompt: list[int]) -> None:
    """Run a prompt and wait until its four chunks are in the node's disk and Redis tiers."""
    before = node.svc.stats()["tiers"]
    generate(node.llm, [prompt], MAX_TOKENS)
    for tier in ("disk", "redis"):
        wait_written(node.svc, tier, before[tier]["stores"] + 4)


def _count(node: Node, name: str) -> int:
    """A scheduler-side counter of the node's connector since its engine started (0 before any)."""
    return int(scheduler_totals(node.llm).get(name, 0))


def _route_and_load(fleet: Fleet, node: Node, prompt: list[int], want: list[int], media: set[str]) -> None:
    """The indexer sends prompt to node, crediting it with STORED_BLOCKS leading blocks in kvtier's
    media (the GPU's forgotten first); the node's engine then loads exactly those, with vLLM's outputs."""
    indexer = fleet.indexer()
    assert indexer.best_pod(prompt, MODEL) == f"pod-{node.name}"
    blocks = indexer.leading_blocks(prompt, MODEL, f"pod-{node.name}", media)
    assert blocks == STORED_BLOCKS
    forget_local_cache(node.llm)
    before = _count(node, "external_tokens")
    got = generate(node.llm, [prompt], MAX_TOKENS)
    loaded = _count(node, "external_tokens") - before
    assert (
        loaded
        == expected_external(blocks * BLOCK_SIZE // CHUNK, 0, len(prompt), CHUNK)
        == blocks * BLOCK_SIZE
    )
    assert_same_outputs(Outputs([want]), got)


def test_the_indexer_routes_each_prompt_to_the_node_holding_its_prefix_which_then_loads_exactly_it(
    tiny_model: str, expected: Outputs, fleet: Fleet
) -> None:
    want_a, want_b, want_fresh = expected.tokens
    with _node(fleet, "b", tiny_model) as node:
        _store(node, P_B)
    with _node(fleet, "a", tiny_model) as node:
        _store(node, P_A)
        _route_and_load(fleet, node, Q_A, want_a, KVTIER_MEDIA)
        assert fleet.indexer().best_pod(FRESH, MODEL) is None  # nobody holds any of it
        assert_same_outputs(Outputs([want_fresh]), generate(node.llm, [FRESH], MAX_TOKENS))
    # Node B restarts, service and engine: its CPU tier is empty, its disk kept.
    with _node(fleet, "b", tiny_model) as node:
        assert node.svc.stats()["tiers"]["cpu"]["chunks"] == 0
        _route_and_load(fleet, node, Q_B, want_b, {"disk"})
        # A's prefix sits in the shared Redis: B loads it too, though only A announced it.
        indexer = fleet.indexer()
        assert indexer.leading_blocks(Q_A, MODEL, "pod-a", {"redis"}) == STORED_BLOCKS
        assert indexer.leading_blocks(Q_A, MODEL, "pod-b") == 0
        before = _count(node, "hit_tokens_redis")
        assert_same_outputs(Outputs([want_a]), generate(node.llm, [Q_A], MAX_TOKENS))
        assert _count(node, "hit_tokens_redis") - before == STORED_BLOCKS * BLOCK_SIZE
