"""The service's KV-event stream: vLLM's ZMQ PUB + replay ROUTER pattern, on the service's loop.

Frames are vLLM's ``ZmqEventPublisher``'s: on PUB ``(topic, seq, payload)`` with ``seq`` an 8-byte
big-endian sequence number counted from 0 and ``payload`` a msgpack ``KVEventBatch``. The replay
ROUTER takes ``(identity, b"", start_seq)`` (what a DEALER sends as ``(b"", start_seq)``) and answers
every kept batch from ``start_seq`` on as ``(identity, b"", topic, seq, payload)``, then the end
marker ``(identity, b"", b"", seq -1, b"")``.

Never blocking the loop: PUB sends with NOBLOCK. A subscriber past its high-water mark loses
messages silently, as with vLLM's publisher (PUB never refuses a send, so ``dropped`` stays 0); it
finds the gap in the sequence numbers and asks the replay socket. Replay requests are read by a
task on zmq's asyncio sockets and answered from memory. No socket exists unless
``events_url`` is set: the publisher is built only then. The PUB socket binds ``events_url``, or
connects to it (``events_connect``) for a subscriber that binds, as llm-d's indexer does with a
static endpoint; the topic frame is ``events_topic`` (llm-d filters on ``kv@`` and reads the pod
and model from ``kv@<pod>@<model>``).

Who owns what: the publisher owns its zmq context and both sockets, and closes them in ``close()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque

import msgspec
import zmq
import zmq.asyncio

from kvtier.app.events import KVEventBatch

log = logging.getLogger("kvtier.events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
BUFFER_STEPS = 10_000  # batches kept for replay (vLLM's default)
HWM = 100_000  # PUB high-water mark, in messages (vLLM's default)


class EventPublisher:
    """Sends KVEventBatches on PUB with sequence numbers and answers replays on a ROUTER."""

    def __init__(
        self,
        url: str,
        replay_url: str = "",
        *,
        topic: str = "",
        connect: bool = False,
        buffer_steps: int = BUFFER_STEPS,
        hwm: int = HWM,
    ) -> None:
        self.url = url
        self._connect = connect
        self.replay_url = replay_url
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._hwm = hwm
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = 0
        self.dropped = 0  # sends zmq refused (EAGAIN); a slow subscriber's losses are not among them
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._pub: zmq.Socket[bytes] | None = None  # a plain socket: a NOBLOCK send returns at once
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch gets."""
        return self._seq

    def start(self) -> None:
        """Bind the sockets and start answering replays (on the running loop); raises
        zmq.ZMQError (e.g. the address is in use) after closing whatever was opened."""
        self._ctx = zmq.Context()
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.set_hwm(self._hwm)
            if self._connect:
                self._pub.connect(self.url)
            else:
                self._pub.bind(self.url)
            if self.replay_url:
                self._replay = zmq.asyncio.Context.shadow(self._ctx).socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(self.replay_url)
                self._replay_task = asyncio.get_running_loop().create_task(
                    self._serve_replays(self._replay), name="kvtier-events-replay"
                )
        except BaseException:
            self._close_sockets()
            raise

    def publish(self, batch: KVEventBatch) -> None:
        """Send one batch now, without waiting; keep it for replay."""
        seq = self._seq
        self._seq += 1
        payload = self._encoder.encode(batch)
        self._buffer.append((seq, payload))
        if self._pub is None:
            return
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1

    async def _serve_replays(self, router: zmq.asyncio.Socket) -> None:
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("ignoring a malformed replay request of %d frames", len(frames))
                continue
            identity, _, start = frames
            start_seq = int.from_bytes(start, "big")
            # A ROUTER never waits on a send: past a peer's high-water mark it drops (as vLLM's).
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await router.send_multipart((identity, b"", self._topic, seq.to_bytes(8, "big"), payload))
            await router.send_multipart((identity, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        """Stop answering replays and close both sockets and the context."""
        task, self._replay_task = self._replay_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
