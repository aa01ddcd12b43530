"""kvtier's wire protocol: length-prefixed msgpack frames carrying msgspec structs.

A frame is a 4-byte big-endian payload length followed by one msgpack message. Every message is a
tagged, array-like struct whose first field after the tag is the request id, so many calls can be in
flight on one connection and replies may come back in any order. The first request on a connection
must be ``Hello`` (protocol version and, when the service has one, the auth token); later ``Hello``s
register namespaces. A call's answer is a message named for its tag (``LookupOk``, tag ``lookup_ok``,
answers ``Lookup``) or one of the shared ``OkReply``, ``CountReply`` and ``ErrorReply``; errors come
with a stable ``code``. These are the frames on the wire; kvtier.app.client_results holds what the
client makes of them. No pickle: msgspec decodes only the types declared here, with bounded sizes,
and anything else is a ``ProtocolError``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Annotated, Final, TypeVar

import msgspec

from kvtier.storage.base import NamespaceSpec, SlotRef, Tier

# The version of the messages declared below; the service refuses a Hello that names another.
PROTOCOL_VERSION: Final = 8
HEADER = struct.Struct(">I")
HEADER_BYTES: Final = HEADER.size
# A 512-chunk lookup (128k tokens at chunk_size 256) is ~20 KB; 8 MiB leaves room without letting a
# bad peer make the service buffer gigabytes.
MAX_FRAME_BYTES: Final = 8 << 20
KEEP_BUFFER_BYTES: Final = 1 << 20  # an encoder keeps a buffer this big for the next frame

Hash = Annotated[bytes, msgspec.Meta(max_length=256)]
MAX_NAME_CHARS: Final = 256
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]
# An arena slot on the wire is the array [offset, length]; SlotRef (a NamedTuple) encodes as exactly that.
# Replies decode into SlotRefs (what the client hands out); requests into plain tuples, cheaper to
# decode, which the service only uses to look up the SlotRefs it reserved.
Slot = tuple[int, int]
Token = Annotated[str, msgspec.Meta(max_length=4096)]
MAX_REASON_CHARS: Final = 1024  # a Report's reason; senders cut a longer one to this
Reason = Annotated[str, msgspec.Meta(max_length=MAX_REASON_CHARS)]
ReqId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
V = TypeVar("V")


class ErrorCode:
    """Stable codes of ErrorReply; clients switch on these, never on the message text."""

    BAD_REQUEST: Final = "bad_request"
    VERSION: Final = "version"
    AUTH: Final = "auth"
    HELLO_REQUIRED: Final = "hello_required"
    UNKNOWN_NAMESPACE: Final = "unknown_namespace"
    ARENA_FULL: Final = "arena_full"
    STALE_INSTANCE: Final = "stale_instance"
    SHUTTING_DOWN: Final = "shutting_down"
    INTERNAL: Final = "internal"


# ------------------------------------------------------------------------------------------- errors
class ProtocolError(Exception):
    """A frame that cannot be accepted; the connection that sent it is closed."""


class FrameTooLarge(ProtocolError):
    """A frame header announced more bytes than the limit."""


class MalformedFrame(ProtocolError):
    """A frame whose payload is not a valid message of this protocol."""


# ----------------------------------------------------------------------------------------- requests
class _Msg(msgspec.Struct, array_like=True, tag_field="t"):
    """Base of every message: tagged, encoded as an array, first field the request id."""

    id: ReqId


class Hello(_Msg, tag="hello"):
    """Handshake (first frame) and namespace registration (spec set)."""

    version: int
    token: Token = ""
    spec: NamespaceSpec | None = None


class Lookup(_Msg, tag="lookup"):
    """Count leading stored chunks and lease them under lease_id; then end the lease replaces
    (when set), as a Release of it right after this call would. stage: when the hit has chunks in
    lower tiers, start staging the lease right after answering, within the service's prestage
    budget (protocol 7; a later Stage joins those reads)."""

    namespace: Name
    hashes: list[Hash]
    lease_id: Name
    replaces: Name = ""
    stage: bool = False
    direct_disk: bool = False  # the engine reads disk hits itself: read ahead only Redis hits (8)


class Stage(_Msg, tag="stage"):
    """Bring every chunk of a lease into arena slots."""

    lease_id: Name


class Reserve(_Msg, tag="reserve"):
    """Slots to fill for these chunks."""

    namespace: Name
    hashes: list[Hash]


class Commit(_Msg, tag="commit"):
    """Publish filled slots; instance_id (when set) must match the service's or nothing happens.

    block_hashes: each chunk's vLLM block hashes in order (for KV events); empty when not sent.
    descriptions: each chunk's description (app/chunk_description.py: token ids and parent hash, for
    self-describing KV events), b"" for a chunk without one; empty when not sent.
    """

    namespace: Name
    hashes: list[Hash]
    slots: Sequence[Slot]
    instance_id: Name = ""
    block_hashes: list[list[Hash]] = []
    descriptions: list[bytes] = []


class Abort(_Msg, tag="abort"):
    """Give reserved slots back unfilled."""

    slots: Sequence[Slot]
    instance_id: Name = ""


class Release(_Msg, tag="release"):
    """End a lease; with reply False the service answers nothing, not even an error."""

    lease_id: Name
    reply: bool = True


class Delete(_Msg, tag="delete"):
    """Remove chunks from every tier."""

    namespace: Name
    hashes: list[Hash]


class DiskReads(_Msg, tag="disk_reads"):
    """An engine read these disk chunks from their files itself (file channel, protocol 8): the
    good ones (nbytes in all) count as disk hits; the corrupt ones are counted and removed."""

    namespace: Name
    hashes: list[Hash]
    nbytes: int
    corrupt: list[Hash] = []


class Clear(_Msg, tag="clear"):
    """Drop every unleased chunk of the named tiers (Tier values); empty = every tier."""

    tiers: list[int]


class Stats(_Msg, tag="stats"):
    """Counters of every tier, leases and slots (same shape as `kvtier stats --json`)."""


class Health(_Msg, tag="health"):
    """Whether the service can serve, and each tier's state."""


class Report(_Msg, tag="report"):
    """A connector's state: whether its side (role) of an engine serves, and why not. The service
    keeps the connection's latest Report, lists it in Stats as one of ``engines``, and forgets it
    when the connection closes."""

    engine_id: Name
    role: Name
    active: bool
    reason: Reason = ""


def one_value(values: list[V]) -> list[V] | V:
    """values as LookupOk carries its tiers and lengths: their one value when all are equal."""
    return values[0] if values and values.count(values[0]) == len(values) else values


Request = (
    Hello
    | Lookup
    | Stage
    | Reserve
    | Commit
    | Abort
    | Release
    | Delete
    | DiskReads
    | Clear
    | Stats
    | Health
    | Report
)


# ------------------------------------------------------------------------------------------ replies
class HelloOk(_Msg, tag="hello_ok"):
    """Handshake answer; namespace and chunk_bytes are set when a spec was registered. files: the
    service serves its disk tier's files beside its unix socket (``kvtier.app.file_channel``)."""

    version: int
    instance_id: str
    arena_path: str
    arena_size: int
    namespace: str = ""
    chunk_bytes: int = 0
    files: bool = False


class LookupOk(_Msg, tag="lookup_ok"):
    """Answer of Lookup: the tier of each hit, and its arena slot when it is a CPU-tier hit.

    ``tiers`` is a single Tier when every hit is in that tier (the usual answer: one small int on
    the wire instead of one per chunk, see one_value); receivers expand it to num_hit entries.
    ``offsets`` holds one little-endian int64 per hit, its slot's offset, or -1 for a lower-tier
    hit, which has no slot (kvtier.storage.base.SlotList.packed); ``lengths`` is the slots' one length
    when all are equal, as the slots of one namespace are, or one per hit. One bytes field decodes
    faster than an int per hit, and a client that only counts the hits never unpacks it.
    """

    num_hit: int
    tiers: list[Tier] | Tier
    offsets: bytes
    lengths: list[int] | int
    instance_id: str


class StageOk(_Msg, tag="stage_ok"):
    """Answer of Stage: a slot per leased chunk (None where missing) and the failed indices."""

    slots: list[SlotRef | None]
    tiers: list[Tier]
    failed: list[int]
    instance_id: str


class ReserveOk(_Msg, tag="reserve_ok"):
    """Answer of Reserve: a slot per key, None where stored already or out of space."""

    slots: list[SlotRef | None]
    instance_id: str


class OkReply(_Msg, tag="ok"):
    """Answer of Commit, Abort, Report and Release (unless it asked for no reply)."""


class CountReply(_Msg, tag="count"):
    """Answer of Delete and Clear: how many chunks were affected."""

    count: int


class StatsOk(_Msg, tag="stats_ok"):
    """Answer of Stats: a JSON-shaped dict."""

    stats: dict[str, object]


class HealthOk(_Msg, tag="health_ok"):
    """Answer of Health."""

    serving: bool
    instance_id: str
    tiers: dict[str, bool]


class ErrorReply(_Msg, tag="error"):
    """A call that failed: a stable code from ErrorCode and a human message."""

    code: str
    message: str


Reply = HelloOk | LookupOk | StageOk | ReserveOk | OkReply | CountReply | StatsOk | HealthOk | ErrorReply
REQUEST_TYPES: Final = Request.__args__
REPLY_TYPES: Final = Reply.__args__


# -------------------------------------------------------------------------------------------- codec
class FrameEncoder:
    """Encodes messages into length-prefixed frames, reusing one buffer per call site (one thread)."""

    __slots__ = ("_buf", "_encoder")

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._buf = bytearray(HEADER_BYTES)  # keeps its capacity: no growing a fresh one per frame

    def encode(self, msg: msgspec.Struct) -> bytes:
        """One frame: header and payload."""
        buf = self._buf
        self._encoder.encode_into(msg, buf, HEADER_BYTES)
        size = len(buf) - HEADER_BYTES
        if size > MAX_FRAME_BYTES:
            self._buf = bytearray(HEADER_BYTES)
            raise FrameTooLarge(f"message of {size} bytes exceeds the {MAX_FRAME_BYTES} byte frame limit")
        HEADER.pack_into(buf, 0, size)
        frame = bytes(buf)
        if size > KEEP_BUFFER_BYTES:  # a rare big message: do not hold on to its buffer
            self._buf = bytearray(HEADER_BYTES)
        return frame


class FrameDecoder:
    """Splits a byte stream into frames and decodes each into one of the declared message types.

    ``feed`` returns every complete message so far; it raises only ProtocolError subclasses, after
    which the stream is unusable (the caller closes the connection).
    """

    __slots__ = ("_buf", "_decoder", "_max")

    def __init__(self, kind: type, max_frame: int = MAX_FRAME_BYTES) -> None:
        self._decoder: msgspec.msgpack.Decoder = msgspec.msgpack.Decoder(kind)
        self._buf = bytearray()
        self._max = max_frame

    @property
    def buffered(self) -> int:
        """Bytes received but not yet decoded."""
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> list:
        """Append received bytes and return the messages they complete."""
        size = len(data) - HEADER_BYTES
        if not self._buf and size > 0 and HEADER.unpack_from(data)[0] == size <= self._max:
            # The usual case, one whole frame and nothing left over: decode it straight away (a
            # slice of bytes copies a few KB, which costs less than setting up a memoryview).
            try:
                return [self._decoder.decode(data[HEADER_BYTES:])]
            except Exception:  # _decode says how
                return [self._decode(data[HEADER_BYTES:], size)]
        if self._buf:
            self._buf += data
            with memoryview(self._buf) as view:
                out, used = self._split(view)
            del self._buf[:used]
            return out
        # Nothing left over (the usual case): decode straight from data, keep only a partial tail.
        with memoryview(data) as view:
            out, used = self._split(view)
            if used < len(view):
                self._buf += view[used:]
        return out

    def _split(self, view: memoryview) -> tuple[list, int]:
        """Decode every complete frame in view; returns them and the bytes they took."""
        out = []
        pos, end = 0, len(view)
        while end - pos >= HEADER_BYTES:
            (size,) = HEADER.unpack_from(view, pos)
            if size > self._max:
                raise FrameTooLarge(f"frame of {size} bytes exceeds the {self._max} byte limit")
            stop = pos + HEADER_BYTES + size
            if stop > end:
                break
            out.append(self._decode(view[pos + HEADER_BYTES : stop], size))
            pos = stop
        return out, pos

    def _decode(self, payload: bytes | bytearray | memoryview, size: int) -> object:
        try:
            return self._decoder.decode(payload)
        except Exception as exc:
            # msgspec raises DecodeError/ValidationError, but also UnicodeDecodeError for a bad tag
            # string: any of them is a malformed frame.
            raise MalformedFrame(f"undecodable frame of {size} bytes: {exc}") from None


def request_decoder(max_frame: int = MAX_FRAME_BYTES) -> FrameDecoder:
    """Decoder of the frames a service receives."""
    return FrameDecoder(Request, max_frame)  # type: ignore[arg-type]


def reply_decoder(max_frame: int = MAX_FRAME_BYTES) -> FrameDecoder:
    """Decoder of the frames a client receives."""
    return FrameDecoder(Reply, max_frame)  # type: ignore[arg-type]
