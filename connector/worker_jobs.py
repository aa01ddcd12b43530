"""What the worker keeps of work in flight (saves, a step's loads, async loads), and the rule for
whether a forward waits for each layer's loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtier.app.client import Call, StageReply
from kvtier.connector.copy import LayerLoads
from kvtier.connector.disk_reads import DiskLoad
from kvtier.connector.metadata import LoadJob
from kvtier.storage.base import SlotRef


@dataclass(slots=True)
class SavedJob:
    """One request's chunks of a step's save batch: what to commit once the copies have ended."""

    hashes: list[bytes]
    slots: list[SlotRef]
    instance_id: str
    block_hashes: list[list[bytes]] = field(default_factory=list)  # each chunk's, for KV events
    descriptions: list[bytes] = field(default_factory=list)  # each chunk's (app/chunk_description.py)


@dataclass(slots=True)
class StepLoads:
    """A step's layer-by-layer sync loads, from start_load until they are finished and checked."""

    loads: LayerLoads
    jobs: list[tuple[LoadJob, list[int]]]  # each job and the indices of its chunks already failed
    started: float
    waited: set[int]  # layers the forward waited for


@dataclass(slots=True)
class PendingLoad:
    """An async load: a Stage call, or this worker's own reads of the chunk files (disk)."""

    job: LoadJob
    future: Call[StageReply] | None
    started: float
    disk: DiskLoad | None = None

    def ready(self) -> bool:
        """True once the stage has answered, or the disk reads have ended (reading what the page
        cache holds meanwhile)."""
        if self.disk is not None:
            return self.disk.advance()
        assert self.future is not None
        return self.future.done()


def layers_wait_in_forward(forward_context: Any) -> bool:
    """Whether the forward about to run asks for each layer's loads (``wait_for_layer_load``): an
    eager or piecewise-graph forward does (attention runs outside the graphs); a full CUDA graph
    replay does not, nor does a forward whose context is not set yet when loads start (vLLM's
    model runner V2 starts them outside any context before it replays a full graph)."""
    if forward_context is None:  # called outside vLLM's model runner (tests, benchmarks)
        return True
    mode = getattr(forward_context, "cudagraph_runtime_mode", None)
    if getattr(mode, "name", mode) == "FULL":
        return False
    return getattr(forward_context, "attn_metadata", None) is not None


class WindowReads:
    """Sliding-window blocks that save batches still in flight read (hybrid engines), by batch number.

    vLLM frees a window's blocks while the request runs and may hand them out again at once; a
    deferred save still reading one must end before vLLM writes it (see ``reused``).
    """

    def __init__(self) -> None:
        self._batches: list[tuple[int, set[int]]] = []

    def add(self, batch: int, blocks: set[int]) -> None:
        """Save batch number ``batch`` reads ``blocks`` of windowed groups."""
        if blocks:
            self._batches.append((batch, blocks))

    def reused(self, handed_out: set[int], batches_done: int) -> bool:
        """Whether a batch not ended yet (numbers above ``batches_done``) reads a block handed out."""
        self._batches = [(n, ids) for n, ids in self._batches if n > batches_done]
        return any(not ids.isdisjoint(handed_out) for _, ids in self._batches)

    def clear(self) -> None:
        """Every batch has ended (a fence)."""
        self._batches = []

    def __bool__(self) -> bool:
        return bool(self._batches)
