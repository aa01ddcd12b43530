"""The object tier's loads: a blob's bytes, fed in the order they arrive off the store, verified and
copied into the caller's slot on the way.

``BlobSink`` takes an object's bytes piece by piece: the header is checked first (key echo, its
checksum, with tier keys the MAC's key id), the payload goes into the slot and into the checksum
(and the MAC) while each piece is still in cache, the trailer is kept for the MAC. So the copy out
of the client's buffer and the checksum run while the rest of the object is still arriving, instead
of after its last byte (docs/performance.md, "The object tier's hit against its floor"). The slot
counts as loaded only on HIT.

Who owns what: a sink belongs to one load; it writes into the caller's slot and keeps nothing past
the load but the trailer's bytes.
"""

from __future__ import annotations

import enum

from kvtier.storage import codec
from kvtier.storage.base import BlobError, ChunkKey
from kvtier.storage.signing import Mac, Signer
from kvtier.storage.tiers.object_client import Buffer


class Outcome(enum.Enum):
    """How a load's decode ended."""

    HIT = "hit"
    CORRUPT = "corrupt"  # not a valid blob of this key: damaged, truncated or foreign
    LENGTH_MISMATCH = "length_mismatch"  # a valid blob of another payload size
    FORGED = "forged"  # with tier keys: unsigned, signed by an unknown key, or a wrong MAC tag


class BlobSink:
    """One object of key, size bytes as the store says, fed in order into dest (its payload's size)."""

    __slots__ = ("_dest", "_filled", "_hasher", "_head", "_key", "_mac", "_need", "_received",
                 "_signer", "_size", "_trailer", "header")  # fmt: skip

    def __init__(self, key: ChunkKey, dest: memoryview, size: int, signer: Signer | None = None) -> None:
        self._key = key
        self._dest = dest
        self._size = size
        self._signer = signer
        # The header is read once this many bytes are in: either layout's, or the whole object.
        self._need = min(size, codec.header_size(key, signed=True))
        self._head = bytearray()  # the header's bytes, where the first piece holds too few
        self._received = 0
        self._filled = 0  # payload bytes in dest
        self._hasher = codec.PayloadHasher()
        self._mac: Mac | None = None
        self._trailer = bytearray()
        self.header: codec.BlobHeader | None = None

    def feed(self, piece: Buffer) -> Outcome | None:
        """Take the next bytes; an Outcome when the load is decided already (no later byte can make
        it a hit: the header is damaged, foreign or forged, or the sizes do not fit), else None."""
        view = memoryview(piece).cast("B")
        self._received += view.nbytes
        if self._received > self._size:
            return Outcome.CORRUPT  # more than the store said the object holds
        if self.header is None:
            if self._head or view.nbytes < self._need:
                self._head += view
                if len(self._head) < self._need:
                    return None
                view = memoryview(bytes(self._head))
            decided = self._read_header(view)
            if decided is not None:
                return decided
            assert self.header is not None
            view = view[self.header.size :]
        self._take(view)
        return None

    def _read_header(self, view: memoryview) -> Outcome | None:
        try:
            header = codec.parse_header(view, self._key)
            self._mac = codec.payload_mac(self._signer, header)
        except codec.BlobForgedError:
            return Outcome.FORGED
        except BlobError:
            return Outcome.CORRUPT
        misfit = codec.misfit(header, self._size, self._dest.nbytes)
        if misfit is not None:
            return Outcome(misfit)
        self.header = header
        return None

    def _take(self, view: memoryview) -> None:
        """Payload bytes into dest (hashed from there, while in cache), the rest into the trailer."""
        n = min(view.nbytes, self._dest.nbytes - self._filled)
        if n:
            part = self._dest[self._filled : self._filled + n]
            part[:] = view[:n]
            self._hasher.update(part)
            if self._mac is not None:
                self._mac.update(part)
            self._filled += n
        if n < view.nbytes:
            self._trailer += view[n:]

    def finish(self) -> Outcome:
        """The outcome once the store has sent every byte: HIT only for a whole blob of this key
        whose checksum (and, with tier keys, MAC tag) matches."""
        if self.header is None or self._received != self._size or self._filled != self._dest.nbytes:
            return Outcome.CORRUPT  # the stream ended short of what the store said
        if self._hasher.intdigest() != self.header.checksum:
            return Outcome.CORRUPT
        try:
            codec.verify_tag(self._mac, self.header, self._trailer)
        except codec.BlobForgedError:
            return Outcome.FORGED
        return Outcome.HIT
