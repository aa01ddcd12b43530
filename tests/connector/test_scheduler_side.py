"""The scheduler side on hand-built scheduler outputs: both model runners' shapes, async lag, failures."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import inspect
import random
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.app.client import LookupReply, ServiceClient, ServiceUnavailable
from kvtier.app.settings import KVTierSettings
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.metadata import KVTierWorkerMeta
from kvtier.connector.planning import Geometry
from kvtier.connector.scheduler import SchedulerSide
from kvtier.storage.base import LookupResult, NamespaceSpec, SlotRef, Tier

BLOCK, CHUNK = 32, 64  # 2 blocks per chunk


def _cfg(
    ranks: tuple[str, ...] = (), loads: bool = True, saves: bool = True, **settings: Any
) -> ConnectorConfig:
    spec = NamespaceSpec("m", "bf16", "x", BLOCK, CHUNK, 2, 4096)
    return ConnectorConfig(
        rank_namespaces=ranks,
        loads=loads,
        saves=saves,
        settings=KVTierSettings(chunk_size=CHUNK, **settings),
        geometry=Geometry(BLOCK, CHUNK),
        spec=spec,
        namespace="ns",
        engine_id="eng",
        num_blocks=64,
        layer_names=("l0", "l1"),
        failure_policy="recompute",
        async_scheduling=False,
    )


@dataclass
class FakeClient:
    """Answers lookups from a table of stored chunk hashes; records releases."""

    stored: dict[bytes, Tier] = field(default_factory=dict)
    by_namespace: dict[str, dict[bytes, Tier]] = field(default_factory=dict)  # else `stored`
    down: bool = False
    down_namespaces: set[str] = field(default_factory=set)
    hold: bool = False  # leave lookup futures unanswered
    released: list[str] = field(default_factory=list)
    lookups: list[str] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)  # of each lookup
    pending: list[tuple[concurrent.futures.Future, LookupReply]] = field(default_factory=list)
    url: str = "unix:///run/kvtier.sock"
    direct_disk: list[bool] = field(default_factory=list)  # of each lookup
    registered: list[NamespaceSpec | None] = field(default_factory=list)  # specs of hello calls

    def lookup(
        self,
        namespace: str,
        hashes: list[bytes],
        lease_id: str,
        timeout: float | None = None,
        *,
        replaces: str = "",
        hold: bool = False,
        stage: bool = False,
        direct_disk: bool = False,
    ):
        self.lookups.append(lease_id)
        self.direct_disk.append(direct_disk)
        self.namespaces.append(namespace)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self.down or namespace in self.down_namespaces:
            fut.set_exception(ServiceUnavailable("down"))
            return fut
        if replaces:  # the service ends it with the lookup
            self.released.append(replaces)
        stored = self.by_namespace.get(namespace, self.stored)
        n = 0
        while n < len(hashes) and hashes[n] in stored:
            n += 1
        tiers = [stored[h] for h in hashes[:n]]
        slots = [SlotRef(4096 * i, 4096) if t == Tier.CPU else None for i, t in enumerate(tiers)]
        reply = LookupReply(LookupResult(n, tiers, slots), "inst-1")
        if self.hold:
            self.pending.append((fut, reply))
        else:
            fut.set_result(reply)
        return fut

    def release(self, lease_id: str) -> None:
        self.released.append(lease_id)

    def hello(self, spec: NamespaceSpec | None = None, timeout: float | None = None) -> None:
        self.registered.append(spec)


def test_the_fake_client_takes_the_real_clients_parameters() -> None:
    """FakeClient stands in for ServiceClient: a changed signature of the real one fails here."""
    for name in ("lookup", "release", "hello"):
        real = inspect.signature(getattr(ServiceClient, name)).parameters
        fake = inspect.signature(getattr(FakeClient, name)).parameters
        assert [(p.name, p.kind, p.default) for p in real.values()] == [
            (p.name, p.kind, p.default) for p in fake.values()
        ], name


class FakeRequest:
    """The fields of vllm.v1.request.Request the scheduler side reads."""

    def __init__(self, req_id: str, num_prompt: int, hashed_blocks: int, seed: int = 0) -> None:
        self.request_id = req_id
        self.num_prompt_tokens = num_prompt
        self.num_tokens = num_prompt
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.block_hashes = [bytes([seed, i]) for i in range(hashed_blocks)]
        self.all_token_ids = list(range(num_prompt))
        self.lora_request = None
        self.mm_features: list[Any] = []
        self.cache_salt = None


def _blocks(ids: list[int]) -> Any:
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def _new(req_id: str, block_ids: list[int], computed: int) -> Any:
    return SimpleNamespace(req_id=req_id, block_ids=(list(block_ids),), num_computed_tokens=computed)


def _output(new=(), cached=(), scheduled=None, preempted=(), spec=None) -> Any:
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = list(new)
    data = CachedRequestData.make_empty()
    for req_id, ids, computed, resumed in cached:
        data.req_ids.append(req_id)
        data.new_block_ids.append(None if ids is None else (list(ids),))
        data.num_computed_tokens.append(computed)
        if resumed:
            data.resumed_req_ids.add(req_id)
    out.scheduled_cached_reqs = data
    out.num_scheduled_tokens = dict(scheduled or {})
    out.scheduled_spec_decode_tokens = dict(spec or {})
    out.preempted_req_ids = set(preempted)
    return out


def _chunk_hash(req: FakeRequest, chunk: int) -> bytes:
    return req.block_hashes[(chunk + 1) * 2 - 1]


def _cpu_hit(num_prompt: int, hashed: int, stored: int) -> tuple[SchedulerSide, FakeRequest, int, bool]:
    """A new request whose first `stored` chunks are in the CPU tier, after its first lookup: the
    scheduler side, the request, and the lookup's (external tokens, is_async)."""
    client = FakeClient()
    side = SchedulerSide(_cfg(), client)
    req = FakeRequest("a", num_prompt, hashed)
    client.stored = {_chunk_hash(req, c): Tier.CPU for c in range(stored)}
    ext, is_async = side.get_num_new_matched_tokens(req, 0)
    return side, req, ext, is_async


def test_cpu_hit_becomes_a_sync_load_of_exact_blocks() -> None:
    side, req, ext, is_async = _cpu_hit(300, 9, 3)  # 4 full chunks hashed, 3 stored
    assert (ext, is_async) == (192, False)
    table = list(range(10, 20))
    side.update_state_after_alloc(req, _blocks(table), ext)
    meta = side.build_connector_meta(_output(new=[_new("a", table, 192)], scheduled={"a": 108}))
    (load,) = meta.loads
    assert not load.is_async and load.instance_id == "inst-1"
    assert [(c.index, c.first, c.block_ids, c.slot) for c in load.chunks] == [
        (0, 0, [10, 11], (0, 4096)),
        (1, 0, [12, 13], (4096, 4096)),
        (2, 0, [14, 15], (8192, 4096)),
    ]
    # 192 loaded + 108 computed = 300 tokens: chunk 3 (tokens 192..255) is new and hashed: saved.
    (save,) = meta.saves
    assert save.hashes == [_chunk_hash(req, 3)] and save.block_ids == [[16, 17]]


def test_lower_tier_hit_loads_async_even_when_not_scheduled() -> None:
    client = FakeClient()
    side = SchedulerSide(_cfg(), client)
    req = FakeRequest("a", 300, 9)
    client.stored = {_chunk_hash(req, 0): Tier.CPU, _chunk_hash(req, 1): Tier.DISK}
    ext, is_async = side.get_num_new_matched_tokens(req, 0)
    assert (ext, is_async) == (128, True)
    side.update_state_after_alloc(req, _blocks(list(range(10))), ext)
    meta = side.build_connector_meta(_output())  # the request waits for its KV: not scheduled
    (load,) = meta.loads
    assert load.is_async
    # The CPU chunk keeps its leased slot (a worker reading the disk chunk from its file copies it
    # from there); the disk chunk carries its key and tier for that read.
    cpu, disk = load.chunks
    assert cpu.slot is not None and cpu.tier == Tier.CPU
    assert disk.slot is None and (disk.key, disk.tier) == (_chunk_hash(req, 1), Tier.DISK)
    assert load.block_ids == [0, 1, 2, 3]
    # While the load is in flight the request's blocks are held if it is aborted.
    assert side.request_finished(req, (list(range(10)),)) == (True, None)


def test_external_tokens_never_cover_the_whole_prompt() -> None:
    _, _, ext, _ = _cpu_hit(256, 8, 4)
    assert ext == 224  # the last block is computed so a token can be sampled


def test_slow_lookup_asks_again_then_uses_the_answer() -> None:
    client = FakeClient(hold=True)
    side = SchedulerSide(_cfg(lookup_budget_ms=1), client)
    req = FakeRequest("a", 300, 9)
    client.stored = {_chunk_hash(req, 0): Tier.CPU}
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    assert side.counters.lookups_deferred == 1
    fut, reply = client.pending.pop()
    fut.set_result(reply)
    side.build_connector_meta(_output())  # next step: the budget is renewed
    assert side.get_num_new_matched_tokens(req, 0) == (64, False)
    assert len(client.lookups) == 1, "the pending lookup is reused, not sent again"


def test_dead_service_is_a_miss_at_once_and_still_an_admission() -> None:
    side = SchedulerSide(_cfg(), FakeClient(down=True))
    req = FakeRequest("a", 300, 9)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert side.counters.lookup_errors == 1
    side.update_state_after_alloc(req, _blocks(list(range(10))), 0)
    assert (side.counters.admissions, side.counters.admissions_with_hit) == (1, 0)


def test_prompt_shorter_than_a_chunk_is_counted_as_an_admission() -> None:
    client = FakeClient()
    side = SchedulerSide(_cfg(), client)
    req = FakeRequest("a", 40, 1)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    side.update_state_after_alloc(req, _blocks([0, 1]), 0)
    assert side.counters.admissions == 1 and not client.lookups


def test_repeated_lookup_replaces_the_lease() -> None:
    client = FakeClient()
    side = SchedulerSide(_cfg(), client)
    req = FakeRequest("a", 300, 9)
    client.stored = {_chunk_hash(req, 0): Tier.CPU}
    side.get_num_new_matched_tokens(req, 0)  # allocation fails: no update_state_after_alloc
    side.get_num_new_matched_tokens(req, 0)
    assert client.released == [client.lookups[0]]
    side.request_finished(req, ([],))
    assert client.released == client.lookups


def test_a_failed_lookup_still_ends_the_lease_it_replaced() -> None:
    client = FakeClient()
    side = SchedulerSide(_cfg(), client)
    req = FakeRequest("a", 300, 9)
    client.stored = {_chunk_hash(req, 0): Tier.CPU}
    side.get_num_new_matched_tokens(req, 0)  # allocation fails: no update_state_after_alloc
    client.down = True  # the next lookup never reaches the service, nor does its replacing
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert client.released == [client.lookups[0]]


def _decode(side: SchedulerSide, req: FakeRequest, req_id: str, start: int, stop: int) -> list[list[bytes]]:
    """Decode steps of one token from start to stop computed tokens (vLLM's sync shape: a request
    knows one token more than it computed); the hashes each step saves."""
    saved = []
    for computed in range(start, stop):
        req.num_tokens = computed + 1
        out = _output(cached=[(req_id, None, computed, False)], scheduled={req_id: 1})
        meta = side.build_connector_meta(out)
        saved.append([h for s in meta.saves for h in s.hashes])
    return saved


def test_decode_chunk_saved_when_its_hash_appears_a_step_late() -> None:
    side = SchedulerSide(_cfg(), FakeClient())
    req = FakeRequest("a", 100, 3)  # 100 prompt tokens: blocks 0-2 hashed, chunk 0 full
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, _blocks([1, 2, 3, 4]), 0)
    meta = side.build_connector_meta(_output(new=[_new("a", [1, 2, 3, 4], 0)], scheduled={"a": 100}))
    assert [s.hashes for s in meta.saves] == [[_chunk_hash(req, 0)]]
    # Decode up to token 127 (async scheduling: the hash of block 3 is not known yet).
    assert _decode(side, req, "a", 100, 128) == [[]] * 28
    req.block_hashes.append(b"\x00\x03")  # the placeholder was filled one step later
    meta = side.build_connector_meta(_output(cached=[("a", None, 128, False)], scheduled={"a": 1}))
    assert [s.hashes for s in meta.saves] == [[_chunk_hash(req, 1)]]
    assert meta.saves[0].block_ids == [[3, 4]]


class CountedRequest(FakeRequest):
    """A FakeRequest that counts how often the scheduler side reads its id."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.reads = 0
        super().__init__(*args, **kwargs)

    @property
    def request_id(self) -> str:
        self.reads += 1
        return self._id

    @request_id.setter
    def request_id(self, value: str) -> None:
        self._id = value


def test_a_decoding_request_is_not_visited_until_a_save_can_fall_due() -> None:
    side = SchedulerSide(_cfg(), FakeClient())
    req = CountedRequest("a", 100, 3)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, _blocks([1, 2, 3, 4]), 0)
    side.build_connector_meta(_output(new=[_new("a", [1, 2, 3, 4], 0)], scheduled={"a": 100}))
    req.reads = 0
    req.block_hashes.append(b"\x00\x03")
    assert _decode(side, req, "a", 100, 127) == [[]] * 27  # tokens 101-127: chunk 1 ends at 128
    assert req.reads == 0
    assert _decode(side, req, "a", 127, 128) == [[_chunk_hash(req, 1)]]
    assert req.reads > 0


@pytest.mark.parametrize("step_tokens", [1, 3])
@pytest.mark.parametrize("seed", range(4))
def test_each_chunk_is_saved_once_when_written_and_hashed(step_tokens: int, seed: int) -> None:
    """Looking at a request only when a save can fall due saves each chunk once, at the step its KV
    and its hashes are complete: chunked prefill, decode with drafts (some rejected), hashes a step
    late."""
    rng = random.Random(seed)
    side = SchedulerSide(dataclasses.replace(_cfg(), step_tokens=step_tokens), FakeClient())
    prompt = rng.randrange(40, 300)
    req = FakeRequest("a", prompt, prompt // BLOCK)
    side.get_num_new_matched_tokens(req, 0)
    table = list(range(100, 140))
    computed = blocks = 0
    planned: set[int] = set()
    for step in range(400):
        known = req.num_tokens - computed
        drafts = rng.randrange(step_tokens) if known == 1 else 0
        scheduled = known + drafts if known == 1 else min(known, rng.choice([known, 64, 100]))
        need = -(-(computed + scheduled) // BLOCK)
        ids, blocks = table[blocks:need], need
        if step == 0:
            side.update_state_after_alloc(req, _blocks(ids), 0)
            out = _output(new=[_new("a", ids, 0)], scheduled={"a": scheduled})
        else:
            out = _output(cached=[("a", ids or None, computed, False)], scheduled={"a": scheduled},
                          spec={"a": list(range(drafts))})  # fmt: skip
        valid = scheduled - drafts
        # The rule: a chunk is saved once, at the first step after which its KV is written (no
        # draft counted) and the hashes of all its blocks are known.
        ready = min((computed + valid) // CHUNK, len(req.block_hashes) // (CHUNK // BLOCK))
        expected = [c for c in range(ready) if c not in planned]
        planned.update(expected)
        meta = side.build_connector_meta(out)
        saved = [h for s in meta.saves for h in s.hashes]
        assert saved == [_chunk_hash(req, c) for c in expected], f"step {step}"
        # vLLM's side of the step: drafts accepted or rejected, a token sampled once every known
        # token is computed, and the hash of each full block (now, or a step late).
        computed += valid + rng.randrange(drafts + 1)
        if computed >= req.num_tokens:
            req.num_tokens = computed + 1
        while len(req.block_hashes) < req.num_tokens // BLOCK - rng.randrange(2):
            req.block_hashes.append(bytes([0, len(req.block_hashes)]))
    assert len(planned) >= prompt // CHUNK + 4  # decode chunks were saved all along


def test_a_failed_load_moving_computed_back_saves_the_recomputed_chunk() -> None:
    side, req, ext, _ = _cpu_hit(150, 4, 2)
    assert ext == 128
    side.update_state_after_alloc(req, _blocks([1, 2, 3, 4, 5]), ext)
    meta = side.build_connector_meta(_output(new=[_new("a", [1, 2, 3, 4, 5], 128)], scheduled={"a": 22}))
    assert meta.loads and meta.saves == []
    req.num_tokens = 151
    # The load of chunk 1 failed: vLLM recomputes from token 64 (kv_load_failure_policy recompute).
    meta = side.build_connector_meta(_output(cached=[("a", None, 64, False)], scheduled={"a": 87}))
    assert [h for s in meta.saves for h in s.hashes] == [_chunk_hash(req, 1)]


def test_spec_decode_tokens_are_not_counted_as_valid() -> None:
    side = SchedulerSide(_cfg(), FakeClient())
    req = FakeRequest("a", 60, 4)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, _blocks([1, 2, 3]), 0)
    side.build_connector_meta(_output(new=[_new("a", [1, 2, 3], 0)], scheduled={"a": 60}))
    meta = side.build_connector_meta(
        _output(cached=[("a", [4], 60, False)], scheduled={"a": 5}, spec={"a": [7, 8, 9, 10]})
    )
    assert meta.saves == []  # 60 + 1 certain token < 128


@pytest.mark.parametrize("runner", ["v1", "mrv2"])
def test_preempted_request_is_reloaded_in_either_runner_shape(runner: str) -> None:
    client = FakeClient()
    side = SchedulerSide(_cfg(), client)
    req = FakeRequest("a", 150, 4)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, _blocks([1, 2, 3, 4, 5]), 0)
    meta = side.build_connector_meta(_output(new=[_new("a", [1, 2, 3, 4, 5], 0)], scheduled={"a": 150}))
    saved = [h for s in meta.saves for h in s.hashes]
    assert saved == [_chunk_hash(req, 0), _chunk_hash(req, 1)]
    client.stored = {h: Tier.CPU for h in saved}
    meta = side.build_connector_meta(_output(preempted=["a"]))
    assert meta.preempted == ["a"]
    req.num_preemptions = 1
    ext, _ = side.get_num_new_matched_tokens(req, 0)
    assert ext == 128
    side.update_state_after_alloc(req, _blocks([9, 8, 7, 6, 5]), ext)
    if runner == "v1":
        out = _output(cached=[("a", [9, 8, 7, 6, 5], 128, True)], scheduled={"a": 22})
    else:
        out = _output(new=[_new("a", [9, 8, 7, 6, 5], 128)], scheduled={"a": 22})
    meta = side.build_connector_meta(out)
    (load,) = meta.loads
    assert load.block_ids == [9, 8, 7, 6]
    assert meta.saves == []  # the reloaded chunks are not stored again
    assert side.counters.readmissions == 1


def test_finished_request_with_saves_is_held_until_reported() -> None:
    side = SchedulerSide(_cfg(), FakeClient())
    req = FakeRequest("a", 70, 2)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, _blocks([1, 2, 3]), 0)
    side.build_connector_meta(_output(new=[_new("a", [1, 2, 3], 0)], scheduled={"a": 70}))
    assert side.request_finished(req, ([1, 2, 3],)) == (True, None)
    assert side.build_connector_meta(_output()).held == ["a"]
    assert side.build_connector_meta(_output()).held == []


def test_a_finished_request_whose_saves_the_workers_report_ended_frees_its_blocks_at_once() -> None:
    """The workers report, after each step, the step through which their saves have ended
    (KVTierWorkerMeta, every rank's least); a request whose last save planned is no later goes
    free at once instead of waiting a step for get_finished."""
    side = SchedulerSide(_cfg(), FakeClient())
    reqs = {r: FakeRequest(r, 70, 2, seed=i) for i, r in enumerate("ab")}
    for req in reqs.values():
        side.get_num_new_matched_tokens(req, 0)
        side.update_state_after_alloc(req, _blocks([1, 2, 3]), 0)
    first = side.build_connector_meta(_output(new=[_new("a", [1, 2, 3], 0)], scheduled={"a": 70}))
    second = side.build_connector_meta(_output(new=[_new("b", [4, 5, 6], 0)], scheduled={"b": 70}))
    assert [s.req_id for s in first.saves] == ["a"] and [s.req_id for s in second.saves] == ["b"]
    ranks = KVTierWorkerMeta(second.step).aggregate(KVTierWorkerMeta(first.step))
    side.update_connector_output(SimpleNamespace(finished_recving=None, kv_connector_worker_meta=ranks))
    assert side.request_finished(reqs["a"], ([1, 2, 3],)) == (False, None)
    assert side.request_finished(reqs["b"], ([4, 5, 6],)) == (True, None), "rank 1 has not ended b's"
    assert side.build_connector_meta(_output()).held == ["b"]


def test_save_decode_off_stops_at_the_prompt() -> None:
    side = SchedulerSide(_cfg(save_decode=False), FakeClient())
    req = FakeRequest("a", 70, 6)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, _blocks([1, 2, 3, 4, 5, 6]), 0)
    meta = side.build_connector_meta(_output(new=[_new("a", [1, 2, 3, 4, 5, 6], 0)], scheduled={"a": 70}))
    assert [len(s.hashes) for s in meta.saves] == [1]
    meta = side.build_connector_meta(_output(cached=[("a", None, 127, False)], scheduled={"a": 60}))
    assert meta.saves == []


# --------------------------------------------------------------------------- more than one rank
def _two_ranks(
    rank0: dict[int, Tier], rank1: dict[int, Tier]
) -> tuple[SchedulerSide, FakeClient, FakeRequest]:
    """A scheduler side of a two-rank engine whose ranks hold these chunks of request "a"."""
    client = FakeClient()
    side = SchedulerSide(_cfg(ranks=("ns0", "ns1")), client)
    req = FakeRequest("a", 300, 9)
    client.by_namespace = {
        "ns0": {_chunk_hash(req, c): t for c, t in rank0.items()},
        "ns1": {_chunk_hash(req, c): t for c, t in rank1.items()},
    }
    return side, client, req


def test_every_rank_is_looked_up_under_its_own_lease_and_a_hit_needs_every_rank() -> None:
    cpu = Tier.CPU
    side, client, req = _two_ranks({0: cpu, 1: cpu, 2: cpu}, {0: cpu, 1: cpu})
    assert side.get_num_new_matched_tokens(req, 0) == (128, False)  # rank 1 lacks chunk 2
    assert client.namespaces == ["ns0", "ns1"]
    assert client.lookups == ["eng:a:1", "eng:a:1@1"]
    table = list(range(10, 20))
    side.update_state_after_alloc(req, _blocks(table), 128)
    meta = side.build_connector_meta(_output(new=[_new("a", table, 128)], scheduled={"a": 172}))
    (load,) = meta.loads
    assert [load.lease_of(rank) for rank in (0, 1)] == ["eng:a:1", "eng:a:1@1"]
    # Each rank loads from the slots its own lookup leased.
    assert [(c.block_ids, c.slot_of(0), c.slot_of(1)) for c in load.chunks] == [
        ([10, 11], (0, 4096), (0, 4096)),
        ([12, 13], (4096, 4096), (4096, 4096)),
    ]
    assert client.released == []  # the workers end their leases once their copies are done


def test_a_chunk_one_rank_holds_in_a_lower_tier_makes_the_load_async_on_every_rank() -> None:
    side, _, req = _two_ranks({0: Tier.CPU, 1: Tier.CPU}, {0: Tier.CPU, 1: Tier.DISK})
    assert side.get_num_new_matched_tokens(req, 0) == (128, True)
    side.update_state_after_alloc(req, _blocks(list(range(10))), 128)
    assert side.counters.hit_tokens_disk == 64 and side.counters.hit_tokens_cpu == 64
    (load,) = side.build_connector_meta(_output()).loads
    assert load.is_async
    # Each rank's own copy: rank 1 reads chunk 1 from disk; rank 0 copies it from its CPU slot.
    assert [(c.slot_of(0), c.slot_of(1), Tier(c.tier)) for c in load.chunks] == [
        ((0, 4096), (0, 4096), Tier.CPU),
        ((4096, 4096), None, Tier.DISK),
    ]


def test_a_rank_that_holds_nothing_ends_the_lease_of_the_rank_that_holds_some() -> None:
    side, client, req = _two_ranks({0: Tier.CPU}, {})
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert client.released == ["eng:a:1"]  # rank 1's lookup found nothing: it has no lease
    side.update_state_after_alloc(req, _blocks(list(range(10))), 0)
    side.request_finished(req, ([],))
    assert client.released == ["eng:a:1"]


def test_every_ranks_lease_ends_when_a_rank_fails_or_the_request_ends_unloaded() -> None:
    side, client, req = _two_ranks({0: Tier.CPU}, {0: Tier.CPU})
    assert side.get_num_new_matched_tokens(req, 0) == (64, False)  # allocation fails
    client.down_namespaces = {"ns1"}
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # rank 1's lookup fails: a miss
    assert side.counters.lookup_errors == 1
    side.update_state_after_alloc(req, _blocks(list(range(10))), 0)
    # Every lease of both lookups ended: the first's when the second replaced it, the second's
    # (rank 0's answered, rank 1's failed) at admission without a hit.
    assert set(client.released) == {"eng:a:1", "eng:a:1@1", "eng:a:2", "eng:a:2@1"}


def test_a_lookup_answered_by_two_service_instances_is_a_miss() -> None:
    side, client, req = _two_ranks({0: Tier.CPU}, {0: Tier.CPU})
    real = client.lookup

    def second_instance(namespace: str, *args: Any, **kwargs: Any) -> Any:
        fut = real(namespace, *args, **kwargs)
        if namespace == "ns1":
            reply = fut.result()
            fut = concurrent.futures.Future()
            fut.set_result(LookupReply(reply.result, "inst-2"))
        return fut

    client.lookup = second_instance  # type: ignore[method-assign]
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert sorted(client.released) == ["eng:a:1", "eng:a:1@1"]


# ---------------------------------------------------------------------------------- kv_role
def test_a_producer_never_looks_up_and_saves_what_it_computes() -> None:
    client = FakeClient()
    side = SchedulerSide(_cfg(loads=False), client)
    req = FakeRequest("a", 300, 9)
    client.stored = {_chunk_hash(req, 0): Tier.CPU}
    side.on_new_request(req)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert client.lookups == []
    side.update_state_after_alloc(req, _blocks(list(range(10))), 0)
    assert side.counters.admissions == 1
    meta = side.build_connector_meta(_output(new=[_new("a", list(range(10)), 0)], scheduled={"a": 300}))
    assert [s.hashes for s in meta.saves] == [[_chunk_hash(req, c) for c in range(4)]]


def test_a_consumer_loads_and_never_saves_nor_holds_blocks() -> None:
    client = FakeClient()
    side = SchedulerSide(_cfg(saves=False), client)
    req = FakeRequest("a", 300, 9)
    client.stored = {_chunk_hash(req, 0): Tier.CPU}
    assert side.get_num_new_matched_tokens(req, 0) == (64, False)
    side.update_state_after_alloc(req, _blocks(list(range(10))), 64)
    meta = side.build_connector_meta(_output(new=[_new("a", list(range(10)), 64)], scheduled={"a": 236}))
    assert len(meta.loads) == 1 and meta.saves == []
    assert side.request_finished(req, (list(range(10)),)) == (False, None)
    assert side.build_connector_meta(_output()).saves == []


def test_a_cache_reset_moves_lookups_and_saves_to_a_new_generation() -> None:
    client = FakeClient()
    side = SchedulerSide(_cfg(), client)
    req = FakeRequest("a", 300, 9)
    client.by_namespace = {"ns": {_chunk_hash(req, 0): Tier.CPU}}  # nothing in any other namespace
    side.on_new_request(req)
    assert client.namespaces == ["ns"]
    assert side.build_connector_meta(_output()).generation == ""
    assert side.reset_cache() is True
    gen = side.cfg.generation
    assert gen and side.cfg.spec.model == f"m~gen:{gen}" and side.cfg.namespace != "ns"
    assert client.registered == [side.cfg.spec]  # registered before the first lookup in it
    assert client.released == ["eng:a:1"]  # the answer from the old generation is dropped
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # looked up again, in the new one
    assert client.namespaces == ["ns", side.cfg.namespace]
    assert side.build_connector_meta(_output()).generation == gen
    side.reset_cache()
    assert side.cfg.generation != gen and side.cfg.spec.model == f"m~gen:{side.cfg.generation}"


# ----------------------------------------------------------------------------- hybrid engines
def _hybrid() -> ConnectorConfig:
    """Two KV cache groups of one layer: a sliding window of 32 tokens (reach 31), full attention."""
    return dataclasses.replace(_cfg(), group_sizes=(1, 1), group_reach=(31, None))


def _group_blocks(*tables: list[int]) -> Any:
    return SimpleNamespace(get_block_ids=lambda: tuple(list(t) for t in tables))


def test_a_hybrid_engine_loads_asynchronously_and_only_the_windows_blocks() -> None:
    client = FakeClient()
    side = SchedulerSide(_hybrid(), client)
    req = FakeRequest("a", 300, 9)
    client.stored = {_chunk_hash(req, c): Tier.CPU for c in range(4)}
    assert side.get_num_new_matched_tokens(req, 0) == (256, True), "a CPU hit too: async"
    # vLLM's tables: the window's group keeps the blocks from (256 - 31) // 32 = 7 on, nulls before.
    window, full = [0] * 7 + [17, 18, 19], list(range(1, 11))
    side.update_state_after_alloc(req, _group_blocks(window, full), 256)
    (load,) = side.build_connector_meta(_output()).loads
    assert load.is_async and not load.failed
    assert [(c.first, c.block_ids) for c in load.chunks] == [(2, []), (2, []), (2, []), (1, [17])]
    assert [c.groups for c in load.chunks] == [[(0, [1, 2])], [(0, [3, 4])], [(0, [5, 6])], [(0, [7, 8])]]


def test_a_hybrid_engines_steps_name_every_block_handed_out() -> None:
    side = SchedulerSide(_hybrid(), FakeClient())
    req = FakeRequest("a", 70, 2)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, _group_blocks([1, 2, 3], [4, 5, 6]), 0)
    new = SimpleNamespace(req_id="a", block_ids=([1, 2, 3], [4, 5, 6]), num_computed_tokens=0)
    meta = side.build_connector_meta(_output(new=[new], scheduled={"a": 70}))
    assert sorted(meta.allocated) == [1, 2, 3, 4, 5, 6]
    (save,) = meta.saves
    assert save.block_ids == [[1, 2]] and save.groups == [[[4, 5]]]
    assert SchedulerSide(_cfg(), FakeClient()).build_connector_meta(_output()).allocated == []


def test_chunks_whose_window_blocks_vllm_freed_are_not_saved() -> None:
    """A request scheduled afresh with 192 tokens computed: vLLM has freed its window's blocks before
    (192 - 31) // 32 = 5, so chunks 0 to 3 (blocks 0 to 7) cannot be saved whole."""
    side = SchedulerSide(_hybrid(), FakeClient())
    req = FakeRequest("a", 300, 9)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, _group_blocks([0] * 5 + [6, 7, 8, 9], list(range(1, 10))), 0)
    tables = ([0] * 5 + [6, 7, 8, 9], list(range(1, 10)))
    new = SimpleNamespace(req_id="a", block_ids=tables, num_computed_tokens=192)
    meta = side.build_connector_meta(_output(new=[new], scheduled={"a": 64}))
    assert meta.saves == [] and side.counters.unsaved_chunks == 4


def test_every_tier_has_a_hit_counter_and_a_metric() -> None:
    """A tier added to storage.base.Tier is counted and exported, never an AttributeError in vLLM."""
    from kvtier.connector.prom import COUNTERS
    from kvtier.connector.stats import SchedulerCounters

    counters = SchedulerCounters()
    counters.count_hits({tier: 64 for tier in Tier})
    counts = counters.take()
    for tier in Tier:
        assert counts[f"hit_tokens_{tier.label}"] == 64, tier
        assert COUNTERS[f"hit_tokens_{tier.label}"][2] == ("tier", tier.label), tier
