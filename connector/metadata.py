"""What travels from the scheduler-side connector to the workers each step, and back.

Plain dataclasses of ints, bytes and strings: vLLM serializes scheduler output between processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.connector.planning import rank_lease_id

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
    )
except ImportError:  # the worker side also runs where only torch is (tools/gpu_check.py on a GPU machine)

    class KVConnectorMetadata:  # type: ignore[no-redef]
        """vLLM's base class of connector metadata, where vLLM is not installed."""

    class KVConnectorWorkerMetadata:  # type: ignore[no-redef]
        """vLLM's base class of worker metadata, where vLLM is not installed."""


@dataclass(slots=True)
class ChunkLoad:
    """Copy blocks ``[first, first + len(block_ids))`` of leased chunk ``index`` into ``block_ids``.

    ``slot`` is the arena slot (offset, length) of a CPU-tier hit for rank 0, ``rank_slots`` those
    of ranks 1 on (each rank's lookup leased its own copy); None where that rank's copy is in a lower
    tier (loaded asynchronously: staged, or read from its file). ``key`` is the chunk's hash and
    ``tier`` the slowest tier any rank holds it in (a Tier value), for a worker that reads disk hits
    itself. ``first`` and ``block_ids`` are KV cache group 0's; ``groups`` holds (first, block_ids) of
    groups 1 on, in hybrid engines (a sliding-window group loads only the blocks inside its window).
    """

    index: int
    first: int
    block_ids: list[int]
    slot: tuple[int, int] | None = None
    rank_slots: list[tuple[int, int] | None] = field(default_factory=list)
    key: bytes = b""
    tier: int = 0
    groups: list[tuple[int, list[int]]] = field(default_factory=list)

    def group_loads(self) -> list[tuple[int, list[int]]]:
        """(first, block_ids) of every KV cache group, in group order."""
        return [(self.first, self.block_ids), *self.groups]

    def num_blocks(self) -> int:
        """Blocks of the chunk this load fills: the most any group loads (a window's group may load
        fewer, where its blocks outside the window are null)."""
        return max(len(ids) for _, ids in self.group_loads())

    def all_block_ids(self) -> list[int]:
        """The destination blocks of every group."""
        return self.block_ids + [b for _, ids in self.groups for b in ids]

    def slot_of(self, rank: int) -> tuple[int, int] | None:
        """The arena slot rank ``rank`` loads from (None: none, or a lower-tier hit)."""
        if rank == 0:
            return self.slot
        return self.rank_slots[rank - 1] if rank <= len(self.rank_slots) else None


@dataclass(slots=True)
class LoadJob:
    """One request's load: the lease that pins its chunks and the pieces to copy.

    ``lease_id`` is rank 0's lease; every other rank loads under its own (``lease_of``).
    """

    req_id: str
    lease_id: str
    chunks: list[ChunkLoad]
    is_async: bool
    instance_id: str = ""
    failed: bool = False  # planned to fail at once (the plan found blocks it cannot fill)

    def lease_of(self, rank: int) -> str:
        """The lease rank ``rank`` stages and releases."""
        return rank_lease_id(self.lease_id, rank)

    @property
    def block_ids(self) -> list[int]:
        """Every destination block of this load, of every KV cache group."""
        return [b for c in self.chunks for b in c.all_block_ids()]


@dataclass(slots=True)
class SaveJob:
    """Chunks of one request to store: a hash and the chunk's whole block list for each (KV cache
    group 0's; ``groups`` has, per chunk, the block lists of groups 1 on in hybrid engines)."""

    req_id: str
    hashes: list[bytes]
    block_ids: list[list[int]]
    block_hashes: list[list[bytes]] = field(default_factory=list)  # each chunk's block hashes (KV events)
    descriptions: list[bytes] = field(default_factory=list)  # each chunk's (app/chunk_description.py)
    groups: list[list[list[int]]] = field(default_factory=list)

    def chunk_groups(self, i: int) -> list[list[int]]:
        """Chunk ``i``'s block ids of every KV cache group, in group order."""
        return [self.block_ids[i], *(self.groups[i] if self.groups else ())]


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    """One step's plan: loads, saves, requests preempted now, finished requests whose blocks we hold."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    held: list[str] = field(default_factory=list)
    generation: str = ""  # the scheduler side's generation of the namespaces (see reset_cache)
    step: int = 0  # the scheduler side's step number (build_connector_meta calls), for KVTierWorkerMeta
    idle: bool = False  # no token is scheduled: vLLM runs the step only to poll the connector
    # Hybrid engines: every block vLLM handed out this step. A deferred save still reading one of
    # them (a sliding-window block freed meanwhile) is fenced before the forward writes it.
    allocated: list[int] = field(default_factory=list)

    def is_empty(self) -> bool:
        """True when the worker has nothing to do this step."""
        return not (self.loads or self.saves or self.preempted or self.held)


@dataclass
class KVTierWorkerMeta(KVConnectorWorkerMetadata):
    """What a worker tells the scheduler side after each step: every save planned in a step up to
    ``saved_through`` has ended (copied, or given up), so the blocks it read may be reused."""

    saved_through: int

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Every rank's saves: the step through which all of them have ended."""
        if isinstance(other, KVTierWorkerMeta):
            return KVTierWorkerMeta(min(self.saved_through, other.saved_through))
        return self
