"""The object tier's streamed loads (``BlobSink``): a blob fed in pieces of any size, the header split
across them or not, loads exactly its payload; a damaged, truncated, overlong, foreign, resized or
forged one is refused with its outcome, whatever the pieces. No store here: this is about the bytes."""

from __future__ import annotations

import os

import pytest

from kvtier.storage import codec
from kvtier.storage.base import ChunkKey
from kvtier.storage.signing import Signer
from kvtier.storage.tiers.object_read import BlobSink, Outcome

KEY = ChunkKey("aabbccddeeff0011", b"chunk-1".ljust(32, b"."))
OTHER = ChunkKey("aabbccddeeff0011", b"chunk-2".ljust(32, b"."))
PAYLOAD = os.urandom(2 * codec.SEGMENT + 12345)  # segments, and a short last one
COVERED = [b"hash-a", b"hash-b"]
SIGNER = Signer([b"k" * 32])
# Piece sizes: a few bytes (the header arrives in many), a page and change, a segment and change
# (pieces straddle segments), larger than the blob (one piece).
PIECES = [13, 4099, codec.SEGMENT + 3, 1 << 24]


def feed(blob: bytes, pieces: int, key: ChunkKey = KEY, size: int | None = None,
         signer: Signer | None = None, dest_size: int = len(PAYLOAD)) -> tuple[Outcome, bytes]:  # fmt: skip
    """The outcome of feeding blob in pieces of that size (size: what the store says it holds)."""
    dest = memoryview(bytearray(dest_size))
    sink = BlobSink(key, dest, len(blob) if size is None else size, signer)
    for at in range(0, len(blob), pieces):
        decided = sink.feed(blob[at : at + pieces])
        if decided is not None:
            return decided, bytes(dest)
    return sink.finish(), bytes(dest)


@pytest.mark.parametrize("signer", [None, SIGNER], ids=["unsigned", "signed"])
@pytest.mark.parametrize("pieces", PIECES)
def test_a_blob_in_pieces_of_any_size_loads_exactly_its_payload(pieces: int, signer: Signer | None) -> None:
    blob = codec.encode(KEY, PAYLOAD, COVERED, signer)
    assert feed(blob, pieces, signer=signer) == (Outcome.HIT, PAYLOAD)


@pytest.mark.parametrize("pieces", PIECES)
def test_damaged_truncated_overlong_and_foreign_blobs_are_corrupt(pieces: int) -> None:
    blob = codec.encode(KEY, PAYLOAD, COVERED)
    header = codec.header_size(KEY)
    flipped = bytearray(blob)
    flipped[header + len(PAYLOAD) // 2] ^= 0x01
    assert feed(bytes(flipped), pieces)[0] is Outcome.CORRUPT  # payload bit flip: the checksum
    broken = bytearray(blob)
    broken[3] ^= 0x01
    assert feed(bytes(broken), pieces)[0] is Outcome.CORRUPT  # header bit flip
    assert feed(blob[:-5], pieces)[0] is Outcome.CORRUPT  # truncated, and the store says so
    assert feed(blob[:-5], pieces, size=len(blob))[0] is Outcome.CORRUPT  # the stream ends short
    assert feed(blob[: header - 2], pieces, size=len(blob))[0] is Outcome.CORRUPT  # inside the header
    assert feed(blob + b"x", pieces, size=len(blob))[0] is Outcome.CORRUPT  # more than the store said
    assert feed(blob, pieces, key=OTHER)[0] is Outcome.CORRUPT  # another key's blob
    assert feed(b"", pieces)[0] is Outcome.CORRUPT
    assert feed(os.urandom(len(blob)), pieces)[0] is Outcome.CORRUPT  # not a blob at all


def test_a_valid_blob_of_another_payload_size_is_a_length_mismatch() -> None:
    blob = codec.encode(KEY, PAYLOAD, COVERED)
    for pieces in PIECES:
        assert feed(blob, pieces, dest_size=len(PAYLOAD) + 1)[0] is Outcome.LENGTH_MISMATCH
        assert feed(blob, pieces, dest_size=len(PAYLOAD) - 1)[0] is Outcome.LENGTH_MISMATCH


@pytest.mark.parametrize("pieces", PIECES)
def test_with_tier_keys_unsigned_unknown_and_tampered_blobs_are_forged(pieces: int) -> None:
    assert feed(codec.encode(KEY, PAYLOAD, COVERED), pieces, signer=SIGNER)[0] is Outcome.FORGED
    stranger = codec.encode(KEY, PAYLOAD, COVERED, Signer([b"s" * 32]))
    assert feed(stranger, pieces, signer=SIGNER)[0] is Outcome.FORGED
    # Another trailer of the same length: the payload's checksum holds, only the MAC can tell.
    signed = codec.encode(KEY, PAYLOAD, COVERED, SIGNER)
    trailer, other = codec.encode_trailer(COVERED), codec.encode_trailer([b"hash-x", b"hash-y"])
    assert len(other) == len(trailer) and other != trailer
    assert feed(signed[: -len(trailer)] + other, pieces, signer=SIGNER)[0] is Outcome.FORGED
