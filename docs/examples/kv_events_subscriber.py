"""A small subscriber of kvtier's KV events: which block hashes this node holds, per medium.

    python docs/examples/kv_events_subscriber.py tcp://127.0.0.1:5557 tcp://127.0.0.1:5558

It needs only pyzmq and msgspec, and decodes kvtier's batches with structs of vLLM's event format (a
vLLM install can use ``vllm.distributed.kv_events.KVEventBatch`` instead). It follows the sequence
numbers: a batch it missed (a late start, a slow joiner, a dropped message) is fetched from the replay
socket before the batch that revealed the gap is applied, and a sequence that starts again from 0 is
a restarted service, whose first event (AllBlocksCleared) voids what it said before.
"""

from __future__ import annotations

import sys
from typing import Any

import msgspec
import zmq

END_SEQ = -1


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


class KVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class TierView:
    """The block hashes each medium holds, rebuilt from the event stream (gaps filled by replay)."""

    def __init__(self, url: str, replay_url: str, ctx: zmq.Context[Any] | None = None) -> None:
        self._ctx = ctx or zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(url)
        self._replay_url = replay_url
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.next_seq = 0
        self.held: dict[str, set[int | bytes]] = {}

    def poll(self, timeout_ms: int) -> bool:
        """Apply the next published batch if one comes within timeout_ms; False if none came."""
        if not self._sub.poll(timeout_ms):
            return False
        _topic, seq_bytes, payload = self._sub.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big")
        if seq < self.next_seq:  # numbering starts again: the service restarted
            self.next_seq = 0
        if seq > self.next_seq:
            self.catch_up(until=seq)
        if seq == self.next_seq:
            self._apply(seq, payload)
        return True

    def catch_up(self, until: int | None = None) -> None:
        """Ask the replay socket for every batch from next_seq on (up to until) and apply them."""
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 10_000)  # a dead replay socket must not hang us forever
        try:
            dealer.connect(self._replay_url)
            dealer.send_multipart([b"", self.next_seq.to_bytes(8, "big")])
            while True:
                _empty, _topic, seq_bytes, payload = dealer.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_SEQ:
                    return
                if seq == self.next_seq and (until is None or seq < until):
                    self._apply(seq, payload)
        finally:
            dealer.close(linger=0)

    def _apply(self, seq: int, payload: bytes) -> None:
        for event in self._decoder.decode(payload).events:
            if isinstance(event, AllBlocksCleared):
                self.held.clear()
            elif isinstance(event, BlockStored):
                self.held.setdefault(event.medium or "", set()).update(event.block_hashes)
            else:
                self.held.setdefault(event.medium or "", set()).difference_update(event.block_hashes)
        self.next_seq = seq + 1

    def close(self) -> None:
        """Close the subscription."""
        self._sub.close(linger=0)


def main(argv: list[str]) -> int:
    """Print each medium's block count whenever a batch arrives."""
    if len(argv) != 3:
        print(f"usage: {argv[0]} EVENTS_URL REPLAY_URL", file=sys.stderr)
        return 2
    view = TierView(argv[1], argv[2])
    view.catch_up()  # what the node announced before we started
    try:
        while True:
            if view.poll(1000):
                print(view.next_seq, {medium: len(hashes) for medium, hashes in sorted(view.held.items())})
    except KeyboardInterrupt:
        return 0
    finally:
        view.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
