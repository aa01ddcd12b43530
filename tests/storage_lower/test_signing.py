"""Signed blobs (codec + signing): sign, verify, wrong and rotated keys, borrowed keys, truncation."""

from __future__ import annotations

import base64
import struct

import pytest
import xxhash

from kvtier.storage import codec
from kvtier.storage.base import BlobError, ChunkKey
from kvtier.storage.signing import Signer, parse_secrets

NS = "aabbccddeeff0011"
OLD, NEW, OTHER = b"o" * 32, b"n" * 40, b"x" * 32
PAYLOAD = bytes(range(256)) * 1200  # over one checksum segment


def key(i: int, ns: str = NS) -> ChunkKey:
    return ChunkKey(ns, i.to_bytes(8, "big"))


def reheader(blob: bytes, echo: bytes, payload: bytes | None = None) -> bytes:
    """blob under another key echo (and payload), header checksum recomputed: what an attacker
    with write access can do; the tag is carried over."""
    header = codec.parse_header(blob)
    body = blob[header.size : header.size + header.payload_len] if payload is None else payload
    digest = codec.checksum(body)
    fixed = struct.pack("<4sHHIQQ", codec.MAGIC, codec.SIGNED_VERSION, 0, len(echo), len(body), digest)
    signature = header.key_id + header.tag
    check = struct.pack("<Q", xxhash.xxh3_64_intdigest(fixed + echo + signature))
    return fixed + check + echo + signature + body


def test_a_signed_blob_verifies_with_its_key_and_carries_key_id_and_tag() -> None:
    signer = Signer([NEW])
    blob = codec.encode(key(1), PAYLOAD, [b"h1"], signer=signer)
    header = codec.parse_header(blob, key(1))
    assert header.signed and header.key_id == signer.key_id and len(header.tag) == 32
    assert header.size == codec.header_size(key(1), signed=True)
    assert bytes(codec.decode(blob, key(1), signer)) == PAYLOAD


def test_a_wrong_key_is_a_forgery() -> None:
    blob = codec.encode(key(1), PAYLOAD, signer=Signer([OTHER]))
    with pytest.raises(codec.BlobForgedError, match="none of this node's tier keys"):
        codec.decode(blob, key(1), Signer([NEW]))


def test_rotation_signs_with_the_first_key_and_verifies_with_any() -> None:
    rotated = Signer([NEW, OLD])
    old_blob = codec.encode(key(1), PAYLOAD, signer=Signer([OLD]))
    new_blob = codec.encode(key(1), PAYLOAD, signer=rotated)
    assert bytes(codec.decode(old_blob, key(1), rotated)) == PAYLOAD
    assert codec.parse_header(new_blob).key_id == Signer([NEW]).key_id
    assert bytes(codec.decode(new_blob, key(1), Signer([NEW]))) == PAYLOAD
    with pytest.raises(codec.BlobForgedError):
        codec.decode(new_blob, key(1), Signer([OLD]))  # the old key alone cannot read the new


def test_an_unsigned_blob_with_a_valid_checksum_is_a_forgery_only_when_keys_are_set() -> None:
    blob = codec.encode(key(1), PAYLOAD)
    assert bytes(codec.decode(blob, key(1))) == PAYLOAD
    with pytest.raises(codec.BlobForgedError, match="unsigned"):
        codec.decode(blob, key(1), Signer([NEW]))


def test_a_signed_blob_reads_on_its_checksum_without_keys() -> None:
    blob = codec.encode(key(1), PAYLOAD, signer=Signer([NEW]))
    assert bytes(codec.decode(blob, key(1))) == PAYLOAD


def test_a_signed_blob_copied_under_another_key_is_refused() -> None:
    signer = Signer([NEW])
    blob = codec.encode(key(1), PAYLOAD, signer=signer)
    with pytest.raises(BlobError, match="another key"):
        codec.decode(blob, key(2), signer)  # copied as is: the key echo says whose it is
    for other in (key(2), key(1, ns="1100ffeeddccbbaa")):  # echo rewritten: the MAC covers it
        borrowed = reheader(blob, f"{other.namespace}:".encode() + other.prefix_hash)
        assert codec.parse_header(borrowed, other).signed
        with pytest.raises(codec.BlobForgedError, match="tag mismatch"):
            codec.decode(borrowed, other, signer)


def test_a_payload_replaced_with_its_checksum_recomputed_is_a_forgery() -> None:
    signer = Signer([NEW])
    blob = codec.encode(key(1), PAYLOAD, signer=signer)
    echo = f"{NS}:".encode() + key(1).prefix_hash
    forged = reheader(blob, echo, payload=bytes(len(PAYLOAD)))
    with pytest.raises(codec.BlobForgedError, match="tag mismatch"):
        codec.decode(forged, key(1), signer)


def test_a_damaged_tag_is_corruption_and_a_truncated_blob_is_refused() -> None:
    signer = Signer([NEW])
    blob = bytearray(codec.encode(key(1), PAYLOAD, signer=signer))
    damaged = bytearray(blob)
    damaged[codec.header_size(key(1), signed=True) - 1] ^= 1
    with pytest.raises(BlobError, match="header checksum") as caught:
        codec.decode(damaged, key(1), signer)
    assert not isinstance(caught.value, codec.BlobForgedError)
    for cut in (10, codec.header_size(key(1), signed=True) - 4, len(blob) - 1):
        with pytest.raises(BlobError):
            codec.decode(blob[:cut], key(1), signer)


def test_unsigned_blobs_keep_their_layout_byte_for_byte() -> None:
    blob = codec.encode(key(1), PAYLOAD)
    assert blob == codec.encode_header(key(1), PAYLOAD) + PAYLOAD
    assert struct.unpack_from("<H", blob, 4)[0] == 3 and codec.parse_header(blob).size == codec.header_size(
        key(1)
    )


def test_secrets_parse_as_hex_or_base64_and_short_ones_are_named() -> None:
    hex_key, b64_key = "ab" * 32, base64.b64encode(b"k" * 32).decode()
    assert parse_secrets(f"{hex_key}, {b64_key}") == (bytes.fromhex(hex_key), b"k" * 32)
    with pytest.raises(ValueError, match="key 2 of 2 is too short: 128 bits, at least 256"):
        parse_secrets(f"{hex_key},{'cd' * 16}")
    with pytest.raises(ValueError, match="key 1 of 1 is neither hex nor base64"):
        parse_secrets("not a key!")
    with pytest.raises(ValueError, match="tier key 1 has 40 bits; at least 256"):
        Signer([b"short"])


def test_a_signer_shows_key_ids_never_secrets() -> None:
    signer = Signer([NEW, OLD])
    assert NEW.hex() not in repr(signer) and "nnnn" not in repr(signer) and signer.key_count == 2
