"""Wire protocol: every message round-trips, framing survives any split, bad input is a typed error."""

from __future__ import annotations

import struct

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.app import protocol as p
from kvtier.storage.base import SlotList, SlotRef, Tier
from tests.app import SPEC, hashes

H = hashes(3)
SLOTS = [(0, 2048), (4096, 2048)]

REQUESTS = [
    p.Hello(id=1, version=p.PROTOCOL_VERSION),
    p.Hello(id=2, version=p.PROTOCOL_VERSION, token="s3cret", spec=SPEC),
    p.Lookup(id=3, namespace="ns", hashes=H, lease_id="req-1"),
    p.Lookup(id=3, namespace="ns", hashes=H, lease_id="req-2", replaces="req-1"),
    p.Stage(id=4, lease_id="req-1"),
    p.Reserve(id=5, namespace="ns", hashes=H),
    p.Commit(id=6, namespace="ns", hashes=H[:2], slots=SLOTS, instance_id="abc"),
    p.Abort(id=7, slots=SLOTS),
    p.Release(id=8, lease_id="req-1"),
    p.Release(id=8, lease_id="req-1", reply=False),
    p.Delete(id=9, namespace="ns", hashes=H),
    p.DiskReads(id=9, namespace="ns", hashes=H, nbytes=1 << 21, corrupt=H[:1]),
    p.Clear(id=10, tiers=[0, 2]),
    p.Stats(id=11),
    p.Health(id=12),
    p.Report(id=13, engine_id="engine-1", role="scheduler", active=True),
    p.Report(id=14, engine_id="engine-1", role="worker", active=False, reason="KV layout refused"),
]
REPLIES = [
    p.HelloOk(id=1, version=1, instance_id="i", arena_path="/dev/shm/a", arena_size=1 << 20),
    p.HelloOk(
        id=2, version=1, instance_id="i", arena_path="/a", arena_size=4, namespace="n", chunk_bytes=2048
    ),
    p.LookupOk(
        id=3,
        num_hit=2,
        tiers=[Tier.CPU, Tier.DISK],
        offsets=SlotList([0, None], 2048).packed,
        lengths=2048,
        instance_id="i",
    ),
    p.LookupOk(
        id=3,
        num_hit=2,
        tiers=Tier.CPU,
        offsets=SlotList([0, 4096], [2048, 1024]).packed,
        lengths=[2048, 1024],
        instance_id="i",
    ),
    p.StageOk(id=4, slots=[SLOTS[0], None], tiers=[Tier.CPU, Tier.REDIS], failed=[1], instance_id="i"),
    p.ReserveOk(id=5, slots=[SLOTS[1], None], instance_id="i"),
    p.OkReply(id=6),
    p.CountReply(id=9, count=3),
    p.StatsOk(id=11, stats={"tiers": {"cpu": {"chunks": 1}}, "leases_active": 0}),
    p.HealthOk(id=12, serving=True, instance_id="i", tiers={"cpu": True}),
    p.ErrorReply(id=13, code=p.ErrorCode.BAD_REQUEST, message="no"),
]


@pytest.mark.parametrize("msg", REQUESTS, ids=lambda m: type(m).__name__)
def test_every_request_round_trips(msg: p.Request) -> None:
    frame = p.FrameEncoder().encode(msg)
    assert struct.unpack(">I", frame[:4])[0] == len(frame) - 4
    assert p.request_decoder().feed(frame) == [msg]


@pytest.mark.parametrize("msg", REPLIES, ids=lambda m: type(m).__name__)
def test_every_reply_round_trips(msg: p.Reply) -> None:
    (decoded,) = p.reply_decoder().feed(p.FrameEncoder().encode(msg))
    assert decoded == msg
    if isinstance(decoded, p.LookupOk):  # typed on the way in: Tier members
        assert decoded.tiers is Tier.CPU or decoded.tiers[1] is Tier.DISK  # type: ignore[index]


def test_a_lookup_reply_names_one_tier_for_hits_all_in_it() -> None:
    assert p.one_value([Tier.CPU] * 3) is Tier.CPU and p.one_value([]) == []
    assert p.one_value([Tier.CPU, Tier.DISK]) == [Tier.CPU, Tier.DISK]
    one = p.FrameEncoder().encode(
        p.LookupOk(id=1, num_hit=64, tiers=Tier.DISK, offsets=b"", lengths=0, instance_id="i")
    )
    many = p.FrameEncoder().encode(
        p.LookupOk(id=1, num_hit=64, tiers=[Tier.DISK] * 64, offsets=b"", lengths=0, instance_id="i")
    )
    assert len(many) - len(one) == 64 + 2  # one int instead of an array of 64


def test_a_lookup_reply_is_smaller_than_one_slot_array_per_hit() -> None:
    enc = p.FrameEncoder()
    offsets = [(i + 1) << 31 for i in range(64)]  # arena offsets past 2 GiB: 9 bytes each as ints
    slots = SlotList(offsets, 1 << 21)
    packed = enc.encode(
        p.LookupOk(id=1, num_hit=64, tiers=Tier.CPU, offsets=slots.packed, lengths=1 << 21, instance_id="i")
    )
    per_hit = enc.encode(
        p.StageOk(id=1, slots=list(slots), tiers=[], failed=[], instance_id="i")  # type: ignore[arg-type]
    )
    assert len(per_hit) - len(packed) >= 64 * 5  # each hit's array header and length are gone
    (decoded,) = p.reply_decoder().feed(packed)
    assert SlotList.from_packed(decoded.offsets, decoded.lengths) == slots


def test_slots_travel_as_arrays_and_arrive_as_slot_refs() -> None:
    enc = p.FrameEncoder()
    refs = p.ReserveOk(id=3, slots=[SlotRef(0, 2048), None], instance_id="i")
    plain = p.ReserveOk(id=3, slots=[(0, 2048), None], instance_id="i")  # type: ignore[list-item]
    assert enc.encode(refs) == enc.encode(plain)  # the wire format did not change
    (decoded,) = p.reply_decoder().feed(enc.encode(plain))
    assert type(decoded.slots[0]) is SlotRef and decoded.slots == [SlotRef(0, 2048), None]
    commit = p.Commit(id=4, namespace="ns", hashes=[b"h"], slots=[SlotRef(4096, 2048)])
    (request,) = p.request_decoder().feed(enc.encode(commit))
    assert request == commit and request.slots == [(4096, 2048)]  # the service looks tuples up


def test_a_report_reason_longer_than_the_limit_is_refused() -> None:
    long = p.Report(id=1, engine_id="e", role="worker", active=False, reason="x" * (p.MAX_REASON_CHARS + 1))
    with pytest.raises(p.MalformedFrame):
        p.request_decoder().feed(p.FrameEncoder().encode(long))


def test_a_release_without_the_reply_field_wants_a_reply() -> None:
    # The field came last (protocol version 3): a frame without it decodes as the old release did.
    payload = msgspec.msgpack.encode(["release", 8, "req-1"])
    (msg,) = p.request_decoder().feed(struct.pack(">I", len(payload)) + payload)
    assert msg == p.Release(id=8, lease_id="req-1") and msg.reply is True


def test_every_message_type_is_covered() -> None:
    assert {type(m) for m in REQUESTS} == set(p.REQUEST_TYPES)
    assert {type(m) for m in REPLIES} == set(p.REPLY_TYPES)


def test_frames_survive_any_split_and_batching() -> None:
    enc = p.FrameEncoder()
    stream = b"".join(enc.encode(m) for m in REQUESTS)
    for cut in range(len(stream)):
        dec = p.request_decoder()
        assert dec.feed(stream[:cut]) + dec.feed(stream[cut:]) == REQUESTS
        assert dec.buffered == 0
    dec = p.request_decoder()
    assert [m for i in range(len(stream)) for m in dec.feed(stream[i : i + 1])] == REQUESTS


def test_oversized_header_is_rejected_before_buffering() -> None:
    dec = p.request_decoder(max_frame=1024)
    with pytest.raises(p.FrameTooLarge):
        dec.feed(struct.pack(">I", 1025))


def test_encoder_refuses_a_message_over_the_limit() -> None:
    huge = p.Lookup(id=1, namespace="n", hashes=[b"x" * 256] * 40000, lease_id="l")
    with pytest.raises(p.FrameTooLarge):
        p.FrameEncoder().encode(huge)


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # never-used msgpack byte
        msgspec.msgpack.encode(["lookup", 1]),  # missing fields
        msgspec.msgpack.encode(["nope", 1]),  # unknown tag
        msgspec.msgpack.encode(["stage", -1, "x"]),  # negative id
        msgspec.msgpack.encode(["lookup", 1, "n", [b"x" * 300], "l"]),  # hash too long
        msgspec.msgpack.encode(["hello_ok", 1, 1, "i", "a", 1]),  # a reply sent to the service
        msgspec.msgpack.encode({"t": "stats", "id": 1}),  # a map, not an array
    ],
)
def test_malformed_payloads_are_typed_errors(payload: bytes) -> None:
    with pytest.raises(p.MalformedFrame):
        p.request_decoder().feed(struct.pack(">I", len(payload)) + payload)


def test_no_pickle_on_the_wire() -> None:
    import pickle

    payload = pickle.dumps(p.Stats(id=1).__class__)
    with pytest.raises(p.ProtocolError):
        p.request_decoder().feed(struct.pack(">I", len(payload)) + payload)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_fuzz_request_decoder_raises_only_protocol_errors(data: bytes) -> None:
    dec = p.request_decoder(max_frame=4096)
    try:
        msgs = dec.feed(data)
    except p.ProtocolError:
        return
    assert all(isinstance(m, p.REQUEST_TYPES) for m in msgs)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.integers(min_value=0, max_value=2))
def test_fuzz_framed_garbage_raises_only_protocol_errors(payload: bytes, which: int) -> None:
    frame = struct.pack(">I", len(payload)) + payload
    dec = [p.request_decoder(), p.reply_decoder(), p.request_decoder(max_frame=64)][which]
    try:
        dec.feed(frame)
    except p.ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(REQUESTS), st.integers(min_value=0, max_value=2000), st.binary(max_size=8))
def test_fuzz_mutated_valid_frames(msg: p.Request, pos: int, junk: bytes) -> None:
    frame = bytearray(p.FrameEncoder().encode(msg))
    cut = 4 + pos % max(1, len(frame) - 4)
    frame[cut : cut + len(junk)] = junk
    try:
        for decoded in p.request_decoder().feed(bytes(frame)):
            assert isinstance(decoded, p.REQUEST_TYPES)
    except p.ProtocolError:
        pass
