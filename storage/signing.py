"""Keyed MACs of the blobs kvtier writes to shared tiers (Redis, the object tier).

A checksum catches corruption; anyone who can write to a shared tier can compute one too. With tier
keys set, each blob carries the id of the key that signed it and a BLAKE3 keyed-mode tag over its
header fields (format, lengths, checksum, key echo: namespace and block hash) and its payload, so
only a holder of a key can write a chunk another node will load (codec.py lays the fields out).

Keys: one or more secrets of at least MIN_SECRET_BYTES; the first signs, any verifies (rotation).
Each secret is turned into a 32-byte MAC key and an 8-byte key id by BLAKE3's key derivation, so
a verifier picks the key by id (one pass over the payload, however many keys are listed). BLAKE3
over HMAC-SHA256: about four times the speed here (docs/performance.md, "Signed shared tiers").

Who owns what: a Signer is immutable and shared by the tiers' threads; each Mac is one thread's.
Nothing here logs or prints a secret (repr shows the key ids only).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import re
from collections.abc import Sequence
from pathlib import Path

import blake3

MIN_SECRET_BYTES = 32  # 256 bits
KEY_ID_SIZE = 8
TAG_SIZE = 32
_MAC_KEY_CONTEXT = "kvtier 2026-12 shared tier blob MAC key v1"
_KEY_ID_CONTEXT = "kvtier 2026-12 shared tier key id v1"

# Anything exposing the buffer protocol as bytes.
Buffer = bytes | bytearray | memoryview


def key_id(secret: bytes) -> bytes:
    """The public id of a secret: which key signed a blob (reveals nothing of the key)."""
    return blake3.blake3(secret, derive_key_context=_KEY_ID_CONTEXT).digest(KEY_ID_SIZE)


def _mac_key(secret: bytes) -> bytes:
    return blake3.blake3(secret, derive_key_context=_MAC_KEY_CONTEXT).digest()


class Mac:
    """One MAC computation: feed the signed bytes in order, then take the tag."""

    __slots__ = ("_state",)

    def __init__(self, mac_key: bytes) -> None:
        # max_threads stays 1: the tiers already hash on several threads at once.
        self._state = blake3.blake3(key=mac_key)

    def update(self, data: Buffer) -> None:
        """Feed the next bytes."""
        self._state.update(data)

    def tag(self) -> bytes:
        """The tag of everything fed so far."""
        return self._state.digest(TAG_SIZE)

    def matches(self, tag: bytes) -> bool:
        """Whether tag is the tag of everything fed so far (compared in constant time)."""
        return hmac.compare_digest(self.tag(), tag)


class Signer:
    """The tier keys: signs with the first, verifies with any of them."""

    __slots__ = ("_keys", "key_id")

    def __init__(self, secrets: Sequence[bytes]) -> None:
        if not secrets:
            raise ValueError("a Signer needs at least one key")
        for i, secret in enumerate(secrets, 1):
            if len(secret) < MIN_SECRET_BYTES:
                raise ValueError(
                    f"tier key {i} has {len(secret) * 8} bits; at least {MIN_SECRET_BYTES * 8} are needed"
                )
        self._keys: dict[bytes, bytes] = {}
        for secret in secrets:
            self._keys.setdefault(key_id(secret), _mac_key(secret))
        self.key_id = key_id(secrets[0])  # the id written into every blob this node signs

    def __repr__(self) -> str:
        return f"Signer(key ids {', '.join(k.hex() for k in self._keys)})"

    def signing_mac(self) -> Mac:
        """A fresh MAC of the signing (first) key."""
        return Mac(self._keys[self.key_id])

    def verifying_mac(self, blob_key_id: bytes) -> Mac | None:
        """A fresh MAC of the key a blob names, or None when it is none of this node's keys."""
        mac_key = self._keys.get(bytes(blob_key_id))
        return None if mac_key is None else Mac(mac_key)

    @property
    def key_count(self) -> int:
        """Distinct keys accepted."""
        return len(self._keys)


def parse_secrets(text: str) -> tuple[bytes, ...]:
    """The secrets a key setting lists (comma-separated, each hex or else base64, each at least
    256 bits); ValueError saying which one is wrong, never showing a key."""
    items = [item.strip() for item in text.split(",")]
    keys: list[bytes] = []
    for i, item in enumerate(items, 1):
        which = f"key {i} of {len(items)}"
        if not item:
            raise ValueError(f"{which} is empty")
        try:
            if re.fullmatch(r"(?:[0-9a-fA-F]{2})+", item):
                secret = bytes.fromhex(item)
            else:
                secret = base64.b64decode(item.replace("-", "+").replace("_", "/"), validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"{which} is neither hex nor base64") from None
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(
                f"{which} is too short: {len(secret) * 8} bits, at least {MIN_SECRET_BYTES * 8} "
                f"({MIN_SECRET_BYTES * 2} hex digits, e.g. `openssl rand -hex {MIN_SECRET_BYTES}`)"
            )
        keys.append(secret)
    return tuple(keys)


def read_secret_file(path: str) -> str:
    """The text of a key file; ValueError when it cannot be read or holds nothing."""
    try:
        text = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the file ({getattr(exc, 'strerror', None) or exc})") from None
    if not text:
        raise ValueError("the file holds no key")
    return text
