"""Copies of a hybrid engine's chunks: one BlockCopier per KV cache group, each over its part of the slot.

A chunk of an engine with several KV cache groups (vLLM's hybrid memory allocator) holds group 0's
layers, then group 1's, and so on, each laid out as a one-group chunk is. The groups' block ids differ
(a sliding-window group loads only the blocks inside its window), so each group has a copier of its
own; on CUDA each has its own lanes, on the CPU its own copy and save threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from kvtier.connector.copy import BlockCopier
from kvtier.connector.layout import PageLayout

GroupSlot = list[torch.Tensor]  # a slot as each group's copier sees its part
GroupLoad = tuple[int, Sequence[int]]  # (first block row of the chunk, block ids) of one group


class GroupedCopier:
    """Copies chunks whose bytes are every KV cache group's layers in turn."""

    def __init__(self, copiers: Sequence[BlockCopier]) -> None:
        if not copiers:
            raise ValueError("a grouped copier needs at least one group")
        self.copiers = list(copiers)
        self.offsets = [0]
        for copier in self.copiers:
            self.offsets.append(self.offsets[-1] + copier.chunk_bytes)
        self.layout: PageLayout = self.copiers[0].layout
        self.device = self.copiers[0].device
        self.host_planes = None  # disk hits of hybrid engines are read by the service (see worker)

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one full chunk, every group's."""
        return self.offsets[-1]

    def slot_view(self, buf: memoryview | bytearray) -> GroupSlot:
        """Each group's part of a slot buffer as its copier's tensor (no copy)."""
        if len(buf) != self.chunk_bytes:
            raise ValueError(f"slot has {len(buf)} bytes, a chunk needs {self.chunk_bytes}")
        view = memoryview(buf)
        return [
            copier.slot_view(view[lo:hi])
            for copier, lo, hi in zip(self.copiers, self.offsets, self.offsets[1:], strict=False)
        ]

    def load(self, slot: GroupSlot, loads: Sequence[GroupLoad]) -> None:
        """Copy each group's rows ``[first, first + len(ids))`` of the slot into its blocks."""
        for copier, part, (first, ids) in zip(self.copiers, slot, loads, strict=True):
            if ids:
                copier.load(part, first, ids)

    def save_batch(
        self,
        chunks: Sequence[tuple[GroupSlot, Sequence[Sequence[int]]]],
        done: Callable[[BaseException | None], object],
    ) -> None:
        """Each group's copier saves its blocks of every chunk; done(first error or None) once all
        have ended. Batches end in the order they were issued, as BlockCopier.save_batch's do."""
        lock = threading.Lock()
        left = len(self.copiers)
        errors: list[BaseException] = []

        def one(error: BaseException | None) -> None:
            nonlocal left
            with lock:
                if error is not None:
                    errors.append(error)
                left -= 1
                last = left == 0
            if last:
                done(errors[0] if errors else None)

        for g, copier in enumerate(self.copiers):
            try:
                copier.save_batch([(slot[g], groups[g]) for slot, groups in chunks], one)
            except Exception as exc:  # refused at once (closed): counts as this group's end
                one(exc)

    def wait(self) -> None:
        """Block until every group's copies have ended; the first group's CopyError is raised."""
        errors = []
        for copier in self.copiers:
            try:
                copier.wait()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Stop every group's copier."""
        for copier in self.copiers:
            copier.close()


def copiers_of(copier: BlockCopier | GroupedCopier) -> list[BlockCopier]:
    """The one-group copiers a copier is made of (itself for one group)."""
    return copier.copiers if isinstance(copier, GroupedCopier) else [copier]


def build_copier(
    groups: Sequence[Sequence[torch.Tensor]],
    num_blocks: int,
    blocks_per_chunk: int,
    helper_cpus: frozenset[int] | None,
) -> BlockCopier | GroupedCopier:
    """A BlockCopier over one KV cache group's layers, or a GroupedCopier over several groups'."""
    copiers: list[BlockCopier] = []
    try:
        for layers in groups:
            copiers.append(BlockCopier(layers, num_blocks, blocks_per_chunk, helper_cpus=helper_cpus))
    except Exception:
        for made in copiers:
            made.close()
        raise
    return copiers[0] if len(copiers) == 1 else GroupedCopier(copiers)
