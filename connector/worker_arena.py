"""The worker's mapping of the service's arena, tied to one service instance, pinned for DMA.

Who owns what: the worker thread owns the ``WorkerArena`` and every mapping it adopts; with CUDA a pin
thread of its own pins new mappings and unpins replaced ones, off vLLM's serving path.
Design: docs/internals.md#worker-side-workerpy-worker_savespy-worker_arenapy
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import TYPE_CHECKING

import torch

from kvtier.connector.pinning import bind_device, pin_host_buffer, unpin_host_buffer
from kvtier.storage.arena import ArenaMapping
from kvtier.storage.base import SlotRef

if TYPE_CHECKING:
    from kvtier.app.client import HelloReply

log = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: its handler, format and level


def _pin(mapping: ArenaMapping, device: torch.device, slot_bytes: int) -> list[int]:
    pinned = pin_host_buffer(mapping.view(SlotRef(0, mapping.size)), device, slot_bytes)
    if pinned:
        log.info(
            "kvtier: arena of %d bytes pinned for DMA on %s (%d pieces)", mapping.size, device, len(pinned)
        )
    return pinned


def _release(
    mapping: ArenaMapping, pinning: concurrent.futures.Future[list[int]] | None, device: torch.device | None
) -> None:
    """Unpin (once any pinning in flight has ended) and unmap."""
    if pinning is not None and device is not None:
        unpin_host_buffer(pinning.result(), device)
    mapping.close()


class WorkerArena:
    """The arena of the service instance the worker's client talks to, mapped and, with a CUDA
    ``device``, pinned for DMA with that device's context in pieces that end on slots of
    ``slot_bytes``."""

    def __init__(self, cpus: frozenset[int] | None, device: torch.device | None, slot_bytes: int = 1) -> None:
        self.instance_id = ""
        self.mapping: ArenaMapping | None = None
        self._cpus = cpus
        self._device = device if device is not None and device.type == "cuda" else None
        self._slot_bytes = slot_bytes
        self._pinning: concurrent.futures.Future[list[int]] | None = None
        self._pool = None
        if self._device is not None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="kvtier-pin", initializer=bind_device, initargs=(self._device,)
            )

    @property
    def cuda(self) -> bool:
        """Whether mappings are pinned for a CUDA device."""
        return self._device is not None

    def adopt(self, hello: HelloReply, pin_here: bool = False) -> None:
        """Map this service instance's arena, replacing an older one (the caller has fenced every
        copy that used it). Pinning runs on the pin thread unless ``pin_here``."""
        if hello.instance_id == self.instance_id and self.mapping is not None:
            return
        self.close(wait=False)
        # Pre-faulted in the background (GIL released): a first touch of each page from this process
        # costs a fault, paid inside a step's copies while the mapping is fresh.
        mapping = ArenaMapping.open(hello.arena, prefault=True, cpus=self._cpus)
        self.mapping, self.instance_id = mapping, hello.instance_id
        if self._pool is None or self._device is None:
            return
        if pin_here:
            done: concurrent.futures.Future[list[int]] = concurrent.futures.Future()
            done.set_result(_pin(mapping, self._device, self._slot_bytes))
            self._pinning = done
        else:
            self._pinning = self._pool.submit(_pin, mapping, self._device, self._slot_bytes)

    @property
    def usable(self) -> bool:
        """True when a mapping is adopted and its pinning (if any) has ended."""
        return self.mapping is not None and (self._pinning is None or self._pinning.done())

    @property
    def pinned(self) -> bool:
        """True when the adopted mapping is registered for DMA."""
        pinning = self._pinning
        return pinning is not None and pinning.done() and bool(pinning.result())

    @property
    def unpinned(self) -> bool:
        """True when a CUDA worker's adopted mapping serves unpinned: its pinning ended and failed."""
        pinning = self._pinning
        return pinning is not None and pinning.done() and not pinning.result()

    def view(self, instance_id: str, slot: SlotRef) -> memoryview | None:
        """The slot's bytes when they belong to the usable mapping of that instance, else None."""
        if instance_id != self.instance_id or not self.usable:
            return None
        assert self.mapping is not None
        return self.mapping.view(slot)

    def close(self, wait: bool = True) -> None:
        """Unpin and unmap the current mapping (on the pin thread unless ``wait``)."""
        mapping, pinning = self.mapping, self._pinning
        self.mapping, self.instance_id, self._pinning = None, "", None
        if mapping is None:
            return
        if self._pool is None or wait:
            _release(mapping, pinning, self._device)
        else:
            self._pool.submit(_release, mapping, pinning, self._device)

    def shutdown(self) -> None:
        """Release the mapping and stop the pin thread once its work has ended."""
        self.close(wait=True)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
