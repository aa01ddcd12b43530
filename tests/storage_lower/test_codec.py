"""Blob codec: round trip, and every truncation, bit flip or foreign key is detected as BlobError."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.storage import codec
from kvtier.storage.base import BLOB_FORMAT_VERSION, BlobError, ChunkKey

NS = "0123456789abcdef"
keys = st.builds(
    ChunkKey,
    st.text(alphabet="0123456789abcdef", min_size=16, max_size=16),
    st.binary(min_size=1, max_size=64),
)
payloads = st.binary(min_size=0, max_size=4096)
FAST = settings(max_examples=200, deadline=None)


@FAST
@given(keys, payloads)
def test_round_trip(key: ChunkKey, payload: bytes) -> None:
    blob = codec.encode(key, payload)
    assert bytes(codec.decode(blob, key)) == payload
    header = codec.parse_header(blob, key)
    assert header.size == codec.header_size(key)
    assert header.blob_size == len(blob)
    codec.verify_payload(header, blob[header.size :])


@FAST
@given(keys, payloads, st.data())
def test_any_truncation_is_detected(key: ChunkKey, payload: bytes, data: st.DataObject) -> None:
    blob = codec.encode(key, payload)
    cut = data.draw(st.integers(min_value=0, max_value=len(blob) - 1))
    with pytest.raises(BlobError):
        codec.decode(blob[:cut], key)


@FAST
@given(keys, payloads, st.data())
def test_any_bit_flip_is_detected(key: ChunkKey, payload: bytes, data: st.DataObject) -> None:
    blob = bytearray(codec.encode(key, payload))
    bit = data.draw(st.integers(min_value=0, max_value=len(blob) * 8 - 1))
    blob[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(BlobError):
        codec.decode(bytes(blob), key)


@FAST
@given(keys, keys, payloads)
def test_foreign_key_is_detected(key: ChunkKey, other: ChunkKey, payload: bytes) -> None:
    blob = codec.encode(key, payload)
    if other == key:
        return
    with pytest.raises(BlobError):
        codec.decode(blob, other)
    with pytest.raises(BlobError):
        codec.parse_header(blob, other)


@FAST
@given(st.binary(max_size=512), keys)
def test_arbitrary_bytes_raise_only_blob_error(data: bytes, key: ChunkKey) -> None:
    for call in (
        lambda: codec.decode(data, key),
        lambda: codec.parse_header(data),
    ):
        try:
            call()
        except BlobError:
            pass


@FAST
@given(keys, payloads, st.binary(max_size=300))
def test_mutated_header_prefix_raises_only_blob_error(key: ChunkKey, payload: bytes, garbage: bytes) -> None:
    blob = codec.encode(key, payload)
    mutated = garbage + blob[len(garbage) :]
    try:
        assert bytes(codec.decode(mutated, key)) == payload
    except BlobError:
        pass


def test_header_alone_then_payload_verified_apart() -> None:
    key = ChunkKey(NS, b"\x01" * 32)
    payload = bytes(range(256)) * 16
    blob = codec.encode(key, payload)
    head = blob[: codec.header_size(key)]
    header = codec.parse_header(head, key)
    assert header.payload_len == len(payload)
    dest = bytearray(header.payload_len)
    dest[:] = blob[header.size :]
    codec.verify_payload(header, dest)
    dest[7] ^= 0xFF
    with pytest.raises(BlobError, match="checksum"):
        codec.verify_payload(header, dest)
    with pytest.raises(BlobError, match="bytes"):
        codec.verify_payload(header, dest[:-1])


def test_trailing_bytes_and_reasons() -> None:
    key = ChunkKey(NS, b"\x02" * 8)
    blob = codec.encode(key, b"abc")
    with pytest.raises(BlobError, match="header says"):
        codec.decode(blob + b"x", key)
    with pytest.raises(BlobError, match="magic"):
        codec.decode(b"XXXX" + blob[4:], key)
    with pytest.raises(BlobError, match="truncated"):
        codec.parse_header(blob[:10])


def test_version_is_the_format_version() -> None:
    key = ChunkKey(NS, b"\x03")
    blob = codec.encode(key, b"")
    assert int.from_bytes(blob[4:6], "little") == BLOB_FORMAT_VERSION
    assert blob[:4] == codec.MAGIC


def spec_checksum(payload: bytes) -> int:
    """The format's payload checksum, written out: xxh3_64 of the segments' xxh3_64 digests (u64 LE)."""
    import xxhash

    step = codec.SEGMENT
    digests = [xxhash.xxh3_64_intdigest(payload[i : i + step]) for i in range(0, len(payload), step)]
    return int(xxhash.xxh3_64_intdigest(b"".join(d.to_bytes(8, "little") for d in digests)))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 3 * (256 << 10) + 99), st.lists(st.integers(0, 1 << 20), max_size=6))
def test_checksum_whole_in_parts_and_by_segment_agree(size: int, cuts: list[int]) -> None:
    """checksum(), the streaming hasher fed at any cuts, and per-segment digests give the format's."""
    payload = random.Random(size).randbytes(size)
    want = spec_checksum(payload)
    assert codec.checksum(payload) == want
    hasher = codec.PayloadHasher()
    view, start = memoryview(payload), 0
    for cut in sorted(min(c, size) for c in cuts):
        hasher.update(view[start:cut])
        start = cut
    hasher.update(view[start:])
    assert hasher.intdigest() == want
    segments = [view[i : i + codec.SEGMENT] for i in range(0, size, codec.SEGMENT)]
    digests = [0] * len(segments)
    for i in reversed(range(len(segments))):  # hashed back to front, as a disk read's companion does
        digests[i] = codec.segment_digest(segments[i])
    assert codec.combine(digests) == want


def test_checksum_depends_on_every_segment_and_their_order() -> None:
    a, b = bytes(codec.SEGMENT), b"\1" * codec.SEGMENT
    assert codec.SEGMENT == 256 << 10  # part of the format (BLOB_FORMAT_VERSION 2)
    sums = {codec.checksum(p) for p in (a + b, b + a, a + a, b + b, a, b, a + b + b"\0")}
    assert len(sums) == 7
