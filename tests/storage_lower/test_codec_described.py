"""Described trailers: a chunk's description rests in its blob (versions 5 and 6), older blobs
(versions 3 and 4) still read, signing covers the description, damage is a BlobError."""

from __future__ import annotations

import struct

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.storage import codec
from kvtier.storage.base import BLOB_FORMAT_VERSION, BlobError, ChunkKey
from kvtier.storage.signing import Signer

KEY = ChunkKey("0123456789abcdef", b"\x07" * 32)
HASHES = [bytes([i]) * 32 for i in range(4)]
PAYLOAD = bytes(range(256)) * 40


def _version(blob: bytes) -> int:
    return int.from_bytes(blob[4:6], "little")


def _trailer(blob: bytes) -> bytes:
    header = codec.parse_header(blob)
    return blob[header.size + header.payload_len :]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.binary(min_size=1, max_size=64), min_size=1, max_size=32),
    st.binary(min_size=1, max_size=4096),
)
def test_a_described_trailer_round_trips_hashes_and_description(hashes: list[bytes], desc: bytes) -> None:
    blob = codec.encode(KEY, PAYLOAD, codec.Covered(hashes, desc))
    assert _version(blob) == codec.DESCRIBED_VERSION
    assert bytes(codec.decode(blob, KEY)) == PAYLOAD
    covered = codec.decode_trailer(_trailer(blob))
    assert list(covered) == hashes and covered.description == desc


def test_blobs_without_a_description_keep_the_older_format_byte_for_byte() -> None:
    plain = codec.encode(KEY, PAYLOAD, HASHES)
    assert plain == codec.encode(KEY, PAYLOAD, codec.Covered(HASHES))  # no description: as before
    assert _version(plain) == BLOB_FORMAT_VERSION
    assert _version(codec.encode(KEY, PAYLOAD)) == BLOB_FORMAT_VERSION  # a Redis value: no trailer
    covered = codec.decode_trailer(_trailer(plain))
    assert list(covered) == HASHES and covered.description == b""
    assert _version(codec.encode(KEY, PAYLOAD, HASHES, Signer([b"k" * 32]))) == codec.SIGNED_VERSION


def test_a_signed_described_blob_verifies_and_its_description_is_signed() -> None:
    signer = Signer([b"k" * 32])
    blob = bytearray(codec.encode(KEY, PAYLOAD, codec.Covered(HASHES, b"tokens"), signer))
    assert _version(bytes(blob)) == codec.SIGNED_DESCRIBED_VERSION
    assert bytes(codec.decode(bytes(blob), KEY, signer)) == PAYLOAD
    with pytest.raises(codec.BlobForgedError, match="unsigned"):
        codec.decode(codec.encode(KEY, PAYLOAD, codec.Covered(HASHES, b"tokens")), KEY, signer)
    # Another description with its trailer checksum made good: only the MAC can tell.
    header = codec.parse_header(bytes(blob))
    forged = codec.encode_trailer(codec.Covered(HASHES, b"tokenz"))
    blob[header.size + header.payload_len :] = forged
    with pytest.raises(codec.BlobForgedError, match="tag mismatch"):
        codec.decode(bytes(blob), KEY, signer)


def test_a_description_too_large_for_the_trailer_is_left_out_and_the_hashes_kept() -> None:
    trailer = codec.encode_trailer(codec.Covered(HASHES, b"x" * codec.MAX_TRAILER_LEN))
    assert not codec.is_described(trailer)
    covered = codec.decode_trailer(trailer)
    assert list(covered) == HASHES and covered.description == b""


@pytest.mark.parametrize(
    ("cut", "reason"),
    [(1, "shorter than its hash entries' length"), (3, "hash entries run past its end")],
)
def test_a_damaged_described_trailer_is_a_blob_error(cut: int, reason: str) -> None:
    """A described body cut short (its checksum made good) names what is missing."""
    body = b"\x00" + struct.pack("<H", 200) + b"\x01a"
    body = body[:cut]
    with pytest.raises(BlobError, match=reason):
        codec.decode_trailer(body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)))


def test_every_bit_flip_of_a_described_trailer_is_detected() -> None:
    blob = codec.encode(KEY, b"p", codec.Covered(HASHES[:1], b"desc"))
    start = len(blob) - len(_trailer(blob))
    for bit in range(start * 8, len(blob) * 8):
        damaged = bytearray(blob)
        damaged[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(BlobError):
            codec.decode(bytes(damaged), KEY)
