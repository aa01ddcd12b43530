"""The object store fails under a running vLLM engine: outputs never change, every fault is counted.

One engine and one service (a small CPU tier and an object tier, nothing else) serve every test of
the module; the service reaches a real SeaweedFS through ``S3FaultProxy``, which makes the store
slow, answers 503 SlowDown, 500 or 403 when told, and sees the server killed and restarted behind
it. Each test stores its own prefix groups, then empties the CPU tier (``clear_cpu``) and vLLM's own
cache (``forget_local``) so that each prompt of the next batch asks the object tier for all three
prefix chunks. The prefix groups are those of other modules' tests (the session's oracle holds
them): this module's engine, service and bucket are its own, so no state is shared with them.
Faults aimed at one chunk are set up as the engine's connector starts that prompt's lookup
(``on_lookup``), so they hit the lookup's reads, not a race. The store-level behaviour (retry
counts, breaker, index) is tested in tests/storage_lower/test_object_faults.py; here the oracle and
the engine's exact counts are what is checked.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import obstore
import pytest

from kvtier.bench.harness import BLOCK_SIZE, generate, generate_each, kv_transfer_config, running_engine
from kvtier.bench.introspect import scheduler_connector, worker_connector
from kvtier.storage import codec
from kvtier.storage.base import ChunkKey
from kvtier.storage.config import ObjectConfig
from kvtier.storage.tiers.object_client import build_store
from kvtier.storage.tiers.object_index import object_path
from tests.e2e.oracle import Probe, assert_same_outputs
from tests.reliability.conftest import (
    CHUNK,
    MAX_TOKENS,
    PREFIX_TOKENS,
    Oracle,
    ServiceProc,
    batch,
    before_lookup,
    clear_cpu,
    delta,
    forget_local,
    local_hits,
    prompt,
    sched_counts,
    wait_for,
    wait_quiet,
    worker_counts,
)
from tests.support.object_store import BUCKET, S3FaultProxy, SeaweedServer

pytestmark = pytest.mark.e2e

CHUNKS = PREFIX_TOKENS // CHUNK  # chunks of each prompt's prefix
BLOCKS_PER_CHUNK = CHUNK // BLOCK_SIZE
TIMEOUT = 3.0  # object_timeout: a load held by the slow store ends as a miss after this long
NO_HITS = {"cpu": 0, "disk": 0, "redis": 0, "object": 0}


class Fleet:
    """The module's store, proxy, service and engine, and what the tests read from them."""

    def __init__(self, server: SeaweedServer, proxy: S3FaultProxy, sp: ServiceProc, llm: Any, url: str):
        self.server, self.proxy, self.sp, self.llm = server, proxy, sp, llm
        self.raw = build_store(ObjectConfig(url=url, endpoint=server.endpoint))  # behind the proxy
        self.probe = Probe(scheduler_connector(llm), worker_connector())

    @property
    def svc(self) -> Any:
        assert self.sp.svc is not None
        return self.sp.svc

    def object_stats(self) -> dict[str, Any]:
        return dict(self.svc.stats()["tiers"]["object"])

    def namespace(self) -> str:
        (ns,) = self.svc.stats()["namespace_specs"]
        return str(ns)

    def healthy(self) -> None:
        """Wait until the object tier serves again (its next LIST closed the breaker)."""
        wait_for(lambda: self.object_stats()["healthy"], 30, "the object tier to be healthy")

    def store(self, groups: list[int], j: int, oracle: Oracle) -> None:
        """Run prompt j of the groups (oracle checked) and wait until their chunks are uploaded."""
        self.healthy()
        stores = self.object_stats()["stores"]
        assert_same_outputs(oracle(batch(groups, j)), generate(self.llm, batch(groups, j), MAX_TOKENS))
        want = stores + len(groups) * CHUNKS
        wait_for(lambda: self.object_stats()["stores"] >= want, 30, f"{want} object stores")
        clear_cpu(self.svc)
        forget_local(self.llm)

    def key(self, key_hash: bytes) -> ChunkKey:
        """The chunk key of a prefix hash in the engine's namespace."""
        return ChunkKey(self.namespace(), key_hash)

    def object_bytes(self, key_hash: bytes) -> bytes:
        """The object's bytes, read straight from the store (not through the proxy)."""
        return bytes(obstore.get(self.raw, object_path(self.key(key_hash))).bytes())

    def put_object(self, key_hash: bytes, data: bytes) -> None:
        """Replace the object, straight in the store."""
        obstore.put(self.raw, object_path(self.key(key_hash)), data)


def warm_up(server: SeaweedServer) -> None:
    """One write outside kvtier's prefix with a long timeout: a fresh (or restarted) SeaweedFS grows
    a volume on its first write, which would outlast the service's short object_timeout."""
    store = build_store(ObjectConfig(url=f"s3://{BUCKET}/warm-up", endpoint=server.endpoint, timeout=60))
    obstore.put(store, "x", b"x")


@pytest.fixture(scope="module")
def fleet(
    tiny_model: str,
    s3_server: SeaweedServer,
    aws_env_module: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Fleet]:
    warm_up(s3_server)
    url = f"s3://{BUCKET}/faults-{uuid.uuid4().hex[:8]}"
    tmp: Path = tmp_path_factory.mktemp("object-faults")
    with S3FaultProxy(s3_server.port) as proxy:
        sp = ServiceProc(
            tmp / "svc",
            cpu_size="4MiB",
            object_url=url,
            object_endpoint=proxy.endpoint,
            object_timeout=TIMEOUT,
            object_refresh=1.0,  # a LIST a second: the breaker closes soon after the store is back
            breaker_period=0.5,
        )
        try:
            svc = sp.start()
            wait_for(lambda: not svc.stats()["tiers"]["object"]["loading"], 30, "the first LIST")
            with running_engine(tiny_model, kv_transfer_config(service_url=sp.url, chunk_size=CHUNK)) as llm:
                yield Fleet(s3_server, proxy, sp, llm, url)
        finally:
            sp.stop()


@contextlib.contextmanager
def on_lookup(llm: Any, action: Callable[[list[bytes], str], object]) -> Iterator[list[str]]:
    """While the block runs, call action(chunk hashes, request id) on vLLM's scheduler thread as the
    connector starts the first lookup of each prompt with a full prefix, before the lookup goes out.
    Yields the request ids seen, in order."""
    side = scheduler_connector(llm)._sched
    start = side._start_lookup
    seen: list[str] = []

    def hooked(st: Any, hashes: list[bytes], *args: Any, **kwargs: Any) -> Any:
        rid = st.request.request_id
        if len(hashes) == CHUNKS and rid not in seen:
            seen.append(rid)
            action(list(hashes), rid)
        return start(st, hashes, *args, **kwargs)

    side._start_lookup = hooked
    try:
        yield seen
    finally:
        side._start_lookup = start


class Reading:
    """Counter readings of the engine and the service around a batch."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.sched, self.worker = sched_counts(fleet.llm), worker_counts()
        self.hits, self.local = fleet.svc.hit_tokens(), local_hits(fleet.llm)
        self.errors = dict(fleet.object_stats()["errors_by_kind"])
        self.failed_blocks = set(fleet.probe.failed_blocks)

    def since(self) -> dict[str, Any]:
        """What changed since this reading."""
        f = self.fleet
        errors = f.object_stats()["errors_by_kind"]
        return {
            "sched": delta(sched_counts(f.llm), self.sched),
            "worker": delta(worker_counts(), self.worker),
            "hits": delta(f.svc.hit_tokens(), self.hits),
            "local": local_hits(f.llm) - self.local,
            "errors": {k: n - self.errors.get(k, 0) for k, n in errors.items() if n != self.errors.get(k, 0)},
            "failed_blocks": f.probe.failed_blocks - self.failed_blocks,
        }


def run_each(fleet: Fleet, oracle: Oracle, prompts: list[list[int]]) -> None:
    """The prompts one at a time, each checked against the oracle."""
    assert_same_outputs(oracle(prompts), generate_each(fleet.llm, prompts, MAX_TOKENS))


def test_slowdown_is_retried_into_a_hit_and_500s_past_the_retries_fail_exactly_their_chunk(
    fleet: Fleet, oracle: Oracle
) -> None:
    retried, failing = 0, 1
    fleet.store([retried, failing], 0, oracle)
    ns = fleet.namespace()
    before, slowdowns0 = Reading(fleet), fleet.proxy.count("GET", 503, path=ns)
    with on_lookup(fleet.llm, lambda _h, _r: fleet.proxy.fail(503, "SlowDown", 2, "GET", path=ns)):
        run_each(fleet, oracle, [prompt(retried, 1)])
    slowed = before.since()
    slowdowns = fleet.proxy.count("GET", 503, path=ns) - slowdowns0
    fleet.healthy()
    before = Reading(fleet)

    def fail_middle(hashes: list[bytes], _rid: str) -> None:
        fleet.proxy.fail(500, "InternalError", 3, "GET", path=hashes[1].hex())

    with on_lookup(fleet.llm, fail_middle) as rids:
        run_each(fleet, oracle, [prompt(failing, 1)])
    failed = before.since()
    assert slowdowns == 2
    assert slowed["hits"] == {**NO_HITS, "object": PREFIX_TOKENS}, slowed
    assert slowed["worker"]["loaded_chunks"] == CHUNKS and slowed["worker"]["failed_load_chunks"] == 0
    assert slowed["errors"] == {}, "a SlowDown retried into an answer is no error"
    # The middle chunk's GET and its two retries got 500: one counted miss, exactly its blocks failed.
    assert failed["hits"] == {**NO_HITS, "object": PREFIX_TOKENS}, failed
    assert failed["errors"] == {"server_error": 1}, failed
    assert failed["worker"]["failed_load_chunks"] == 1, failed
    assert failed["failed_blocks"] == fleet.probe.blocks_of(rids[0], [1]), failed
    assert len(failed["failed_blocks"]) == BLOCKS_PER_CHUNK
    assert slowed["local"] == failed["local"] == 0


def test_damaged_objects_between_lookup_and_load_fail_exactly_their_blocks(
    fleet: Fleet, oracle: Oracle
) -> None:
    flipped, truncated = 2, 3
    fleet.store([flipped, truncated], 0, oracle)
    damaged: dict[bytes, bytes] = {}

    def damage(hashes: list[bytes], _rid: str) -> None:
        which = 1 if len(damaged) == 0 else 2  # the first prompt's chunk 1, the second's chunk 2
        blob = bytearray(fleet.object_bytes(hashes[which]))
        if which == 1:
            blob[codec.header_size(fleet.key(hashes[1])) + 100] ^= 0x01  # a payload bit: the checksum tells
        else:
            del blob[len(blob) // 2 :]
        fleet.put_object(hashes[which], bytes(blob))
        damaged[hashes[which]] = bytes(blob)

    before = Reading(fleet)
    with on_lookup(fleet.llm, damage) as rids:
        run_each(fleet, oracle, batch([flipped, truncated], 1))
    got = before.since()
    wait_quiet(fleet.svc)
    assert got["hits"] == {**NO_HITS, "object": 2 * PREFIX_TOKENS}, got
    assert got["errors"] == {"corrupt": 2}, got
    assert got["worker"]["failed_load_chunks"] == 2 and got["worker"]["loaded_chunks"] == 2 * CHUNKS - 2
    assert got["failed_blocks"] == fleet.probe.blocks_of(rids[0], [1]) | fleet.probe.blocks_of(rids[1], [2])
    assert len(got["failed_blocks"]) == 2 * BLOCKS_PER_CHUNK
    assert got["local"] == 0
    # A damaged object is deleted in the background once the lease that held it lets go.
    wait_for(
        lambda: all(_bytes_or_none(fleet, h) != blob for h, blob in damaged.items()),
        30,
        "the damaged objects to leave the bucket after their loads failed",
    )


def _bytes_or_none(fleet: Fleet, key_hash: bytes) -> bytes | None:
    try:
        return fleet.object_bytes(key_hash)
    except FileNotFoundError:
        return None


def test_a_denied_write_is_counted_and_the_other_tiers_serve_the_chunk(fleet: Fleet, oracle: Oracle) -> None:
    group = 4
    fleet.healthy()
    before = Reading(fleet)
    stores = fleet.object_stats()["stores"]

    def deny_last(hashes: list[bytes], _rid: str) -> None:
        fleet.proxy.fail(403, "AccessDenied", 1, "PUT", path=hashes[CHUNKS - 1].hex())

    with on_lookup(fleet.llm, deny_last):
        run_each(fleet, oracle, [prompt(group, 0)])
    wait_for(
        lambda: (
            fleet.object_stats()["stores"] == stores + CHUNKS - 1
            and fleet.object_stats()["errors_by_kind"].get("denied", 0) == before.errors.get("denied", 0) + 1
        ),
        30,
        "two uploads and one denied",
    )
    wait_quiet(fleet.svc)
    stored = before.since()
    forget_local(fleet.llm)  # the CPU tier kept every chunk
    cpu = Reading(fleet)
    run_each(fleet, oracle, [prompt(group, 1)])
    from_cpu = cpu.since()
    clear_cpu(fleet.svc)
    forget_local(fleet.llm)
    lower = Reading(fleet)
    run_each(fleet, oracle, [prompt(group, 2)])
    from_object = lower.since()
    assert stored["errors"] == {"denied": 1}, stored
    assert fleet.object_stats()["healthy"], "a denied write leaves the tier serving reads"
    assert from_cpu["hits"] == {**NO_HITS, "cpu": PREFIX_TOKENS}, from_cpu
    # The bucket lacks only the denied chunk: the two before it load, the last is recomputed.
    assert from_object["hits"] == {**NO_HITS, "object": PREFIX_TOKENS - CHUNK}, from_object
    assert from_object["sched"]["external_tokens"] == PREFIX_TOKENS - CHUNK, from_object
    assert from_object["worker"]["failed_load_chunks"] == 0, from_object
    assert from_cpu["local"] == from_object["local"] == 0


def test_a_slow_store_never_holds_a_lookup_and_its_loads_time_out_into_recompute(
    fleet: Fleet, oracle: Oracle
) -> None:
    groups = [5, 6]
    fleet.store(groups, 0, oracle)
    before = Reading(fleet)
    fleet.proxy.hang(path=fleet.namespace())  # every chunk object held; LISTs of the prefix pass
    try:
        # Submitted together: both lookups are answered (from the index) before any load times out.
        got = generate(fleet.llm, batch(groups, 1), MAX_TOKENS)
        slow = before.since()
    finally:
        fleet.proxy.hang(False)
    fleet.healthy()
    wait_quiet(fleet.svc)
    clear_cpu(fleet.svc)
    forget_local(fleet.llm)
    after = Reading(fleet)
    run_each(fleet, oracle, batch(groups, 2))
    back = after.since()
    assert_same_outputs(oracle(batch(groups, 1)), got)
    # The lookups promised every prefix while the store answered nothing: they never asked it.
    assert slow["sched"]["admissions_with_hit"] == len(groups) and slow["sched"]["lookup_errors"] == 0, slow
    assert slow["sched"]["external_tokens"] == len(groups) * PREFIX_TOKENS, slow
    assert slow["worker"]["loaded_chunks"] == 0, slow
    assert slow["worker"]["failed_load_chunks"] == len(groups) * CHUNKS, slow
    assert len(slow["failed_blocks"]) == len(groups) * CHUNKS * BLOCKS_PER_CHUNK, slow
    assert slow["errors"].get("timeout", 0) >= 1, slow
    assert back["hits"] == {**NO_HITS, "object": len(groups) * PREFIX_TOKENS}, back
    assert back["worker"]["loaded_chunks"] == len(groups) * CHUNKS, back
    assert slow["local"] == back["local"] == 0


def test_the_store_killed_mid_workload_then_restarted(fleet: Fleet, oracle: Oracle) -> None:
    a, b = [7, 8], [9, 10]
    fleet.store(a, 0, oracle)
    up = Reading(fleet)
    run_each(fleet, oracle, batch(a, 1))
    served = up.since()
    clear_cpu(fleet.svc)
    forget_local(fleet.llm)
    # kill -9 the store after the first prompt's lookup was served, before the second's starts.
    with before_lookup(fleet.llm, 2, fleet.server.kill) as killed:
        run_each(fleet, oracle, batch(a, 2))
    assert killed.is_set(), "the workload ended before the store could be killed in its middle"
    clear_cpu(fleet.svc)
    forget_local(fleet.llm)
    down = Reading(fleet)
    run_each(fleet, oracle, batch(a, 3))
    missed = down.since()
    healthy_while_down = fleet.object_stats()["healthy"]

    fleet.server.restart()
    warm_up(fleet.server)
    fleet.store(b, 0, oracle)  # a SIGKILLed SeaweedFS may lose recent writes: store anew
    back = Reading(fleet)
    run_each(fleet, oracle, batch(b, 1))
    resumed = back.since()
    assert served["hits"] == {**NO_HITS, "object": len(a) * PREFIX_TOKENS}, served
    # Down: every lookup answered at once (a miss), nothing loaded, nothing failed.
    assert missed["sched"]["admissions"] == len(a) and missed["sched"]["lookup_errors"] == 0, missed
    assert missed["sched"]["external_tokens"] == 0, missed
    assert missed["worker"]["loaded_chunks"] == missed["worker"]["failed_load_chunks"] == 0, missed
    assert not healthy_while_down
    assert resumed["hits"] == {**NO_HITS, "object": len(b) * PREFIX_TOKENS}, resumed
    assert resumed["worker"]["loaded_chunks"] == len(b) * CHUNKS, resumed
    assert served["local"] == missed["local"] == resumed["local"] == 0
