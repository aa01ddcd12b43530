"""Blob codec: the self-describing form a chunk takes at rest (disk file, Redis value).

Layout, little-endian::

    fixed header (36 bytes)
        magic            4s   b"KVTB"
        version          u16  base.BLOB_FORMAT_VERSION
        trailer length   u16  bytes of the trailer after the payload (0: none)
        key echo length  u32
        payload length   u64
        payload checksum u64  checksum() of the payload: see SEGMENT
        header checksum  u64  xxh3_64 of the 28 bytes above plus the key echo
    key echo             keys.key_echo(key)
    (version 4 only)     key id (8 bytes) and MAC tag (32 bytes): see "Signed blobs" below
    payload              raw bytes
    trailer (optional)   what the chunk covers, read by the disk scan and never by a load; then u64
                         xxh3_64 of the bytes before it. Two layouts:
                         plain (versions 3 and 4): the vLLM block hashes, per hash u8 length and bytes;
                         described (versions 5 and 6): u8 0 (no plain entry starts with a zero
                         length), u16 bytes of the hash entries, the hashes as above, then the
                         chunk's description to the end (opaque here: the app's encoding of its
                         tokens and parent hash)

The header checks itself, so a reader can read and validate the header alone, then read the payload
straight into its destination buffer and verify it there (no intermediate copy). Every mismatch raises
``BlobError`` with the reason; nothing here unpickles or evaluates anything.

Signed blobs (format SIGNED_VERSION, written to the shared tiers when tier keys are set): the key
echo is followed by the signing key's id and a tag, signing.Mac over the 28 fixed bytes before the
header checksum (magic, version, lengths, payload checksum), the key echo (namespace and block
hash), the key id, the payload and the trailer. The header checksum covers id and tag too, so a
damaged tag reads as corruption and a wrong one as forgery (``BlobForgedError``). Unsigned blobs
(BLOB_FORMAT_VERSION) keep the layout above byte for byte.

Versions: a blob whose trailer is described is written as DESCRIBED_VERSION (SIGNED_DESCRIBED_VERSION
signed), every other one as before (3, or 4 signed), so a blob without a description (a Redis value,
a chunk saved by a client that sent none) stays readable by builds that predate descriptions. Readers
take all four. The payload's layout is the same in all four, so the namespace (which names
BLOB_FORMAT_VERSION) does not change with them.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import xxhash

from kvtier.storage.base import BLOB_FORMAT_VERSION, BlobError, BlobFormatError, ChunkKey
from kvtier.storage.keys import key_echo
from kvtier.storage.signing import KEY_ID_SIZE, TAG_SIZE, Mac, Signer

# Anything exposing the buffer protocol as bytes (collections.abc.Buffer arrives in 3.12).
Buffer = bytes | bytearray | memoryview

MAGIC = b"KVTB"
_FIXED = struct.Struct("<4sHHIQQ")
_CHECK = struct.Struct("<Q")
_WHOLE = struct.Struct("<4sHHIQQQ")  # _FIXED then _CHECK, read in one go
MAX_TRAILER_LEN = 0xFFFF  # the header's u16
FIXED_HEADER_SIZE = _FIXED.size + _CHECK.size  # 36
# Bounds that keep a corrupt length field from making a reader allocate or wait for absurd sizes.
MAX_ECHO_LEN = 1024
MAX_PAYLOAD_LEN = 1 << 40
# The format of signed blobs: BLOB_FORMAT_VERSION's layout plus key id and tag after the key echo.
SIGNED_VERSION = 4
# The formats of blobs whose trailer carries a description, unsigned and signed.
DESCRIBED_VERSION = 5
SIGNED_DESCRIBED_VERSION = 6
SIGNATURE_SIZE = KEY_ID_SIZE + TAG_SIZE
_UNSIGNED_VERSIONS = (BLOB_FORMAT_VERSION, DESCRIBED_VERSION)
_SIGNED_VERSIONS = (SIGNED_VERSION, SIGNED_DESCRIBED_VERSION)
if len({*_UNSIGNED_VERSIONS, *_SIGNED_VERSIONS}) != 4:  # pragma: no cover - a bump must keep them apart
    raise ImportError("codec's four format versions must differ from each other and BLOB_FORMAT_VERSION")
_READS = (*_UNSIGNED_VERSIONS, *_SIGNED_VERSIONS)
_DESCRIBED = b"\x00"  # the described trailer's first byte
_COUNT = struct.Struct("<H")  # the described trailer's length of its hash entries


class Covered(tuple[bytes, ...]):
    """A chunk's vLLM block hashes in order, with its description: opaque bytes (the app's encoding
    of the tokens and parent hash behind the hashes), b"" when unknown. It travels wherever the
    block hashes do (commit, CPU entry, write-behind item, tier listener) and rests in the trailer."""

    description: bytes

    def __new__(cls, hashes: Iterable[bytes], description: bytes = b"") -> Covered:
        self = super().__new__(cls, hashes)
        self.description = description
        return self


def description_of(covered: Sequence[bytes]) -> bytes:
    """covered's description, b"" for plain block hashes."""
    return covered.description if isinstance(covered, Covered) else b""


class BlobForgedError(BlobError):
    """With tier keys set: a blob that is unsigned, signed by an unknown key, or whose tag is wrong."""


@dataclass(frozen=True, slots=True)
class BlobHeader:
    """A validated blob header: what the payload that follows must be."""

    echo: bytes
    payload_len: int
    checksum: int
    trailer_len: int = 0
    key_id: bytes = b""  # signed blobs: the id of the key that signed it
    tag: bytes = b""  # signed blobs: the MAC tag
    version: int = BLOB_FORMAT_VERSION

    @property
    def signed(self) -> bool:
        """True for a blob of SIGNED_VERSION (key id and tag present)."""
        return bool(self.key_id)

    @property
    def size(self) -> int:
        """Bytes of the header including the key echo (offset of the payload in the blob)."""
        return FIXED_HEADER_SIZE + len(self.echo) + (SIGNATURE_SIZE if self.signed else 0)

    @property
    def blob_size(self) -> int:
        """Bytes of the whole blob: header, payload and trailer."""
        return self.size + self.payload_len + self.trailer_len


# The payload checksum is xxh3_64 of the payload's segment digests: every SEGMENT bytes (the last
# segment may be shorter) hashed with xxh3_64, the digests packed as little-endian u64s in order. One
# xxh3 stream cannot be split between threads; segments can, so a reader verifies the parts of a payload
# on whichever threads read them (the disk tier reads a chunk on two cores at once).
SEGMENT = 256 << 10
# From this size on a segment is hashed through the hasher object, whose update() releases the GIL
# while it hashes (python-xxhash's one-shot functions hold it): a few microseconds more, but other
# threads run.
_RELEASE_GIL_FROM = 1 << 16


def segment_count(size: int) -> int:
    """Segments of a payload of size bytes."""
    return -(-size // SEGMENT)


def segment_span(index: int, size: int) -> tuple[int, int]:
    """Start and end of segment index of a payload of size bytes."""
    start = index * SEGMENT
    return start, min(size, start + SEGMENT)


def segment_digest(segment: Buffer) -> int:
    """xxh3_64 of one segment of a payload; large ones are hashed without holding the GIL."""
    if memoryview(segment).nbytes < _RELEASE_GIL_FROM:
        return int(xxhash.xxh3_64_intdigest(segment))
    return int(xxhash.xxh3_64(segment).intdigest())


def combine(digests: Sequence[int]) -> int:
    """The payload checksum from the digests of its segments, in order."""
    return int(xxhash.xxh3_64_intdigest(struct.pack(f"<{len(digests)}Q", *digests)))


def checksum(payload: Buffer) -> int:
    """The payload checksum the header carries (xxh3_64 over the segments' xxh3_64 digests)."""
    view = memoryview(payload).cast("B")
    size = view.nbytes
    return combine([segment_digest(view[slice(*segment_span(i, size))]) for i in range(segment_count(size))])


class PayloadHasher:
    """checksum() of a payload fed in order, in parts of any size (e.g. as they arrive off a socket)."""

    __slots__ = ("_digests", "_filled", "_hasher")

    def __init__(self) -> None:
        self._digests: list[int] = []
        self._hasher = xxhash.xxh3_64()
        self._filled = 0  # bytes of the current segment fed so far

    def update(self, part: Buffer) -> None:
        """Feed the next bytes of the payload."""
        view = memoryview(part).cast("B")
        while view.nbytes:
            piece = view[: SEGMENT - self._filled]
            view = view[piece.nbytes :]
            if not self._filled and piece.nbytes == SEGMENT:
                self._digests.append(segment_digest(piece))  # a whole segment in one part
                continue
            self._hasher.update(piece)
            self._filled += piece.nbytes
            if self._filled == SEGMENT:
                self._digests.append(int(self._hasher.intdigest()))
                self._hasher.reset()
                self._filled = 0

    def intdigest(self) -> int:
        """The checksum of everything fed so far."""
        tail = [int(self._hasher.intdigest())] if self._filled else []
        return combine(self._digests + tail)


def header_size(key: ChunkKey, signed: bool = False) -> int:
    """Bytes of the header a blob of this key carries (signed: with key id and tag)."""
    return FIXED_HEADER_SIZE + len(key_echo(key)) + (SIGNATURE_SIZE if signed else 0)


def is_described(trailer: Buffer) -> bool:
    """True for a trailer of the described layout (its blob is written as DESCRIBED_VERSION)."""
    return memoryview(trailer).cast("B")[:1].tobytes() == _DESCRIBED


def encode_header(
    key: ChunkKey,
    payload: Buffer,
    payload_checksum: int | None = None,
    trailer_len: int = 0,
    described: bool = False,
) -> bytes:
    """The header for payload stored under key; pass payload_checksum when already computed, and
    the length of the trailer (encode_trailer) that follows the payload, if any, and whether it is
    described (is_described)."""
    if not 0 <= trailer_len <= MAX_TRAILER_LEN:
        raise ValueError(f"a trailer of {trailer_len} bytes: at most {MAX_TRAILER_LEN} fit a blob")
    echo = key_echo(key)
    size = memoryview(payload).nbytes
    digest = checksum(payload) if payload_checksum is None else payload_checksum
    version = DESCRIBED_VERSION if described else BLOB_FORMAT_VERSION
    fixed = _FIXED.pack(MAGIC, version, trailer_len, len(echo), size, digest)
    return fixed + _CHECK.pack(xxhash.xxh3_64_intdigest(fixed + echo)) + echo


def encode_signed_header(
    key: ChunkKey, payload: Buffer, signer: Signer, trailer: Buffer = b"", payload_checksum: int | None = None
) -> bytes:
    """The signed header for payload (and the trailer that follows it) stored under key."""
    trailer_len = memoryview(trailer).nbytes
    if not 0 <= trailer_len <= MAX_TRAILER_LEN:
        raise ValueError(f"a trailer of {trailer_len} bytes: at most {MAX_TRAILER_LEN} fit a blob")
    echo = key_echo(key)
    size = memoryview(payload).nbytes
    digest = checksum(payload) if payload_checksum is None else payload_checksum
    version = SIGNED_DESCRIBED_VERSION if is_described(trailer) else SIGNED_VERSION
    fixed = _FIXED.pack(MAGIC, version, trailer_len, len(echo), size, digest)
    mac = signer.signing_mac()
    for part in (fixed, echo, signer.key_id, payload, trailer):
        mac.update(part)
    signature = signer.key_id + mac.tag()
    return fixed + _CHECK.pack(xxhash.xxh3_64_intdigest(fixed + echo + signature)) + echo + signature


def encode_for(signer: Signer | None, key: ChunkKey, payload: Buffer, trailer: Buffer = b"") -> bytes:
    """The header a tier writes: signed when it has a signer, else unsigned (as before keys)."""
    if signer is None:
        view = memoryview(trailer)
        return encode_header(key, payload, trailer_len=view.nbytes, described=is_described(view))
    return encode_signed_header(key, payload, signer, trailer)


def _hash_entries(hashes: Sequence[bytes]) -> bytearray:
    parts = bytearray()
    for block_hash in hashes:
        if not 0 < len(block_hash) <= 0xFF:
            raise ValueError(f"a block hash of {len(block_hash)} bytes: 1 to 255 fit a trailer")
        parts.append(len(block_hash))
        parts += block_hash
    return parts


def encode_trailer(covered: Sequence[bytes]) -> bytes:
    """The trailer naming covered (the chunk's block hashes, and its description when it is a
    Covered with one), b"" for none. A description that would not fit the u16 length the header
    holds is left out (the hashes are kept); ValueError when the hashes alone do not fit, or for a
    hash over 255 bytes."""
    if not covered:
        return b""
    entries = _hash_entries(covered)
    description = description_of(covered)
    if description and len(entries) <= 0xFFFF:
        body = _DESCRIBED + _COUNT.pack(len(entries)) + entries + description
        if len(body) + _CHECK.size <= MAX_TRAILER_LEN:
            return body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))
    trailer = bytes(entries) + _CHECK.pack(xxhash.xxh3_64_intdigest(entries))
    if len(trailer) > MAX_TRAILER_LEN:
        raise ValueError(f"{len(covered)} block hashes make a trailer over {MAX_TRAILER_LEN} bytes")
    return trailer


def _read_entries(body: bytes, at: int, end: int) -> list[bytes]:
    """The hash entries of body[at:end]; BlobError when one runs past end."""
    hashes = []
    while at < end:
        stop = at + 1 + body[at]
        if stop > end or body[at] == 0:
            raise BlobError("trailer entry runs past its end")
        hashes.append(body[at + 1 : stop])
        at = stop
    return hashes


def _read_described(body: bytes) -> Covered:
    """The hashes and description of a described trailer's body (its checksum verified)."""
    if len(body) < 1 + _COUNT.size:
        raise BlobError("described trailer shorter than its hash entries' length")
    (size,) = _COUNT.unpack_from(body, 1)
    start = 1 + _COUNT.size
    if start + size > len(body):
        raise BlobError("described trailer's hash entries run past its end")
    return Covered(_read_entries(body, start, start + size), body[start + size :])


def decode_trailer(trailer: Buffer) -> Covered:
    """The block hashes a trailer names, with its description (b"" for a plain trailer); BlobError
    when it is damaged."""
    view = memoryview(trailer).cast("B")
    if not view.nbytes:
        return Covered(())
    if view.nbytes < _CHECK.size:
        raise BlobError(f"a trailer of {view.nbytes} bytes is shorter than its checksum")
    body = bytes(view[: -_CHECK.size])
    if xxhash.xxh3_64_intdigest(body) != _CHECK.unpack_from(view, view.nbytes - _CHECK.size)[0]:
        raise BlobError("trailer checksum mismatch")
    if body[:1] == _DESCRIBED:
        return _read_described(body)
    return Covered(_read_entries(body, 0, len(body)))


def encode(
    key: ChunkKey, payload: Buffer, covered: Sequence[bytes] = (), signer: Signer | None = None
) -> bytes:
    """A whole blob in one bytes object (tests and small values; tiers send header and payload apart);
    signed when signer is given."""
    trailer = encode_trailer(covered)
    return encode_for(signer, key, payload, trailer) + bytes(payload) + trailer


def _check_prefix(magic: bytes, echo_len: int) -> None:
    if magic != MAGIC:
        raise BlobError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if echo_len > MAX_ECHO_LEN:
        raise BlobError(f"key echo length {echo_len} exceeds {MAX_ECHO_LEN}")


def parse_header(data: Buffer, key: ChunkKey | None = None) -> BlobHeader:
    """Validate the header at the start of data (which may hold more, e.g. the payload).

    With key, the key echo must be that key's; without it (a disk scan) any well-formed echo passes.
    """
    view = memoryview(data).cast("B")
    if view.nbytes < FIXED_HEADER_SIZE:
        raise BlobError(f"truncated header: {view.nbytes} of {FIXED_HEADER_SIZE} fixed bytes")
    # One unpack of all 36 fixed bytes: this runs on every read, where microseconds show.
    magic, version, trailer_len, echo_len, size, digest, stored_check = _WHOLE.unpack_from(view)
    _check_prefix(magic, echo_len)
    signed = version in _SIGNED_VERSIONS
    end = FIXED_HEADER_SIZE + echo_len + (SIGNATURE_SIZE if signed else 0)
    if view.nbytes < end:
        raise BlobError(f"truncated header: {view.nbytes} of {end} header bytes")
    echo = bytes(view[FIXED_HEADER_SIZE : FIXED_HEADER_SIZE + echo_len])
    signature = bytes(view[FIXED_HEADER_SIZE + echo_len : end])
    if xxhash.xxh3_64_intdigest(bytes(view[: _FIXED.size]) + echo + signature) != stored_check:
        raise BlobError("header checksum mismatch")
    if version not in _UNSIGNED_VERSIONS and not signed:
        raise BlobFormatError(
            f"format version {version}, this build reads {', '.join(map(str, sorted(_READS)))}"
        )
    if size > MAX_PAYLOAD_LEN:
        raise BlobError(f"payload length {size} exceeds {MAX_PAYLOAD_LEN}")
    if key is not None and echo != key_echo(key):
        raise BlobError(f"key echo {echo!r} belongs to another key than {key_echo(key)!r}")
    return BlobHeader(
        echo=echo,
        payload_len=int(size),
        checksum=int(digest),
        trailer_len=int(trailer_len),
        key_id=signature[:KEY_ID_SIZE],
        tag=signature[KEY_ID_SIZE:],
        version=int(version),
    )


def payload_mac(signer: Signer | None, header: BlobHeader) -> Mac | None:
    """The MAC to feed header's payload (and trailer) to, its signed header fields fed already;
    None without keys (nothing to verify). BlobForgedError, with keys, for a blob that is unsigned or
    signed by none of them: known before a byte of the payload is read."""
    if signer is None:
        return None
    if not header.signed:
        raise BlobForgedError("unsigned blob in a signed tier")
    mac = signer.verifying_mac(header.key_id)
    if mac is None:
        raise BlobForgedError(f"signed by key id {header.key_id.hex()}, none of this node's tier keys")
    fixed = _FIXED.pack(
        MAGIC, header.version, header.trailer_len, len(header.echo), header.payload_len, header.checksum
    )
    for part in (fixed, header.echo, header.key_id):
        mac.update(part)
    return mac


def verify_tag(mac: Mac | None, header: BlobHeader, *parts: Buffer) -> None:
    """Feed mac the rest of the signed bytes (parts) and check header's tag; BlobForgedError when it
    differs. No-op for mac None (no keys)."""
    if mac is None:
        return
    for part in parts:
        mac.update(part)
    if not mac.matches(header.tag):
        raise BlobForgedError("MAC tag mismatch")


def verify_payload(header: BlobHeader, payload: Buffer) -> None:
    """Check a payload read apart from its header: exact length and checksum."""
    size = memoryview(payload).nbytes
    if size != header.payload_len:
        raise BlobError(f"payload is {size} bytes, header says {header.payload_len}")
    if checksum(payload) != header.checksum:
        raise BlobError("payload checksum mismatch")


def misfit(header: BlobHeader, blob_size: int, payload_len: int) -> str | None:
    """Why a stored value of blob_size bytes with this header cannot fill a buffer of payload_len
    (the tiers' outcome names 'corrupt' and 'length_mismatch'), or None when it can."""
    if header.blob_size != blob_size:
        return "corrupt"  # truncated, or bytes after its end
    if header.payload_len != payload_len:
        return "length_mismatch"
    return None


def judge(header: BlobHeader, mac: Mac | None, payload: Buffer, trailer: Buffer = b"") -> str:
    """The tiers' outcome name of a payload read apart from its header: 'hit' when it matches the
    checksum and (mac given) the tag, else 'corrupt' or 'forged'."""
    try:
        verify_payload(header, payload)
        verify_tag(mac, header, payload, trailer)
    except BlobForgedError:
        return "forged"
    except BlobError:
        return "corrupt"
    return "hit"


def decode(blob: Buffer, key: ChunkKey, signer: Signer | None = None) -> memoryview:
    """The verified payload of a whole blob stored under key, as a view into blob (no copy); with
    signer, its MAC is verified too (BlobForgedError)."""
    view = memoryview(blob).cast("B")
    header = parse_header(view, key)
    if view.nbytes != header.blob_size:
        raise BlobError(f"blob is {view.nbytes} bytes, header says {header.blob_size}")
    mac = payload_mac(signer, header)
    payload = view[header.size : header.size + header.payload_len]
    verify_payload(header, payload)
    trailer = view[header.size + header.payload_len :]
    decode_trailer(trailer)
    verify_tag(mac, header, payload, trailer)
    return payload
