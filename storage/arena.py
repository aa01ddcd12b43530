"""The shared-memory arena: one tmpfs file mapped by the service and by vLLM workers, cut in slots.

Who owns what: ``Arena`` (service) owns the file, its mapping, its pre-fault thread and its unlink;
``ArenaMapping`` (any process) maps an arena by path; ``SlotAllocator`` (service event loop) owns the
byte ranges, and the CPU tier decides what lives in them.
Design: docs/internals.md#arena-arenapy
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import threading
import time
from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from itertools import repeat
from operator import itemgetter, setitem
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.runtime.mounts import MEMORY_FILESYSTEMS, filesystem_type, free_bytes
from kvtier.storage.base import ArenaError, ArenaInfo, SlotRef, SlotStateError

log = logging.getLogger(__name__)

PAGE = 4096
ARENA_PREFIX = "kvtier-"
ARENA_SUFFIX = ".arena"
_ARENA_NAME = re.compile(r"^kvtier-[0-9a-f]+\.arena$")
_NEW_SUFFIX = ".creating"  # an arena being created, before it is locked and renamed into place
_NEW_NAME = re.compile(r"^kvtier-[0-9a-f]+\.creating$")
_PREFAULT_STEP = 32 << 20  # bytes per fallocate call: short enough to stop promptly
_POPULATE_STEP = 4 << 20  # bytes per madvise call: short enough to stop promptly
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
_STALE_AGE_S = 10.0  # a '.creating' file this young may belong to a service starting right now
_offset_of = itemgetter(0)  # of a SlotRef
_length_of = itemgetter(1)  # of a SlotRef
_new_tuple = tuple.__new__  # a SlotRef without its Python-level __new__


def _load_madvise() -> Any:
    """libc's madvise through ctypes (which releases the GIL during the call), or None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _load_madvise()


def _address(mm: mmap.mmap) -> int:
    """Start address of a writable mapping (the ctypes view is dropped at once)."""
    view = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(view)
    finally:
        del view


def align_up(n: int, align: int = PAGE) -> int:
    """n rounded up to a multiple of align."""
    return (n + align - 1) // align * align


# -------------------------------------------------------------------------------- mapping
class ArenaMapping:
    """A read/write mapping of an existing arena file, used by worker processes and the Arena."""

    def __init__(self, fd: int, path: str, size: int) -> None:
        self.path = path
        self.size = size
        try:
            self._mm: mmap.mmap | None = mmap.mmap(
                fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        except (OSError, ValueError) as exc:
            raise ArenaError(f"cannot map arena {path} ({size} bytes): {exc}") from exc
        self._base: memoryview | None = memoryview(self._mm)
        self._address = _address(self._mm)
        self._stop = threading.Event()
        self._prefaulted = threading.Event()
        self._prefaulted.set()
        self._thread: threading.Thread | None = None
        self.prefault_error: str | None = None

    @classmethod
    def open(
        cls, info: ArenaInfo | str, *, prefault: bool = False, cpus: frozenset[int] | None = None
    ) -> ArenaMapping:
        """Map the arena named by info (or a path); the size is checked against the file.

        With prefault, a background thread maps every page into this process, so a worker's first
        copies into the arena do not page-fault; it runs on `cpus` when given (a thread inherits
        its creator's binding, which may be the core vLLM runs its model on).
        """
        path = info if isinstance(info, str) else info.path
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as exc:
            raise ArenaError(f"cannot open arena {path}: {exc.strerror}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ArenaError(f"arena {path} is not a regular file")
            if not isinstance(info, str) and st.st_size != info.size:
                raise ArenaError(f"arena {path} has {st.st_size} bytes, expected {info.size}")
            if st.st_size <= 0:
                raise ArenaError(f"arena {path} is empty")
            mapping = cls(fd, path, st.st_size)
        finally:
            os.close(fd)  # the mapping keeps the file alive
        if prefault:
            mapping._start_prefault(None, cpus)
        return mapping

    @property
    def closed(self) -> bool:
        """True once close() ran."""
        return self._base is None

    def view(self, slot: SlotRef) -> memoryview:
        """Writable view of a slot's bytes (no copy); release it (or let it go) before close()."""
        if self._base is None:
            raise ArenaError(f"arena {self.path} is closed")
        if slot.offset < 0 or slot.length < 0 or slot.offset + slot.length > self.size:
            raise SlotStateError(f"{slot} lies outside the arena of {self.size} bytes")
        return self._base[slot.offset : slot.offset + slot.length]

    def ndarray(self, slot: SlotRef, dtype: np.dtype | type = np.uint8) -> np.ndarray:
        """The slot as a 1-D numpy array of dtype, sharing memory with the arena."""
        return np.frombuffer(self.view(slot), dtype=dtype)

    # -------------------------------------------------------------------------- pre-faulting
    def wait_prefaulted(self, timeout: float | None = None) -> bool:
        """Block until pre-faulting ends (for benchmarks and tests, never on the event loop)."""
        return self._prefaulted.wait(timeout)

    def _start_prefault(self, fd: int | None, cpus: frozenset[int] | None = None) -> None:
        self._prefaulted.clear()
        self._thread = threading.Thread(
            target=self._prefault, args=(fd, cpus), name="kvtier-prefault", daemon=True
        )
        self._thread.start()

    def _prefault(self, fd: int | None, cpus: frozenset[int] | None = None) -> None:
        """Allocate (when fd is given) and map every page, step by step, until done or stopped."""
        if cpus:
            with contextlib.suppress(OSError, AttributeError):
                os.sched_setaffinity(0, cpus)  # 0: this thread only
        try:
            offset = 0
            while offset < self.size and not self._stop.is_set():
                step = min(_PREFAULT_STEP, self.size - offset)
                if fd is not None:
                    os.posix_fallocate(fd, offset, step)  # allocation and zeroing, without the GIL
                # madvise holds the GIL: small steps keep the event loop's stalls to a few ms.
                for sub in range(offset, offset + step, _POPULATE_STEP):
                    self._populate(sub, min(_POPULATE_STEP, offset + step - sub))
                offset += step
        except (OSError, ValueError) as exc:
            # Best effort: without it the first writes are slower, nothing else changes.
            self.prefault_error = str(exc)
            log.warning("pre-faulting arena %s stopped: %s", self.path, exc)
        finally:
            self._prefaulted.set()

    def _populate(self, offset: int, length: int) -> None:
        """Fault in page tables for a byte range of this mapping without changing its contents."""
        mm = self._mm
        if mm is None:
            return
        # close() joins this thread before it unmaps, so the address stays mapped during the call.
        if _madvise is not None:
            if _madvise(self._address + offset, length, _MADV_POPULATE_WRITE) == 0:
                return
            err = ctypes.get_errno()
            if err != errno.EINVAL:  # EINVAL: kernel older than 5.14
                raise OSError(err, os.strerror(err))
        else:
            try:
                mm.madvise(_MADV_POPULATE_WRITE, offset, length)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
        # Reading one byte per page maps it; on a shared tmpfs mapping the page is writable.
        window = memoryview(mm)[offset : offset + length]
        int(np.frombuffer(window, dtype=np.uint8)[::PAGE].sum())
        window.release()

    def _stop_prefault(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def close(self) -> None:
        """Unmap; safe to call twice. Views still alive keep their pages mapped until dropped."""
        self._stop_prefault()
        base, mm = self._base, self._mm
        self._base = self._mm = None
        if base is not None:
            with contextlib.suppress(BufferError):
                base.release()
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                log.warning("arena %s closed with views alive; unmapped when dropped", self.path)


# -------------------------------------------------------------------------------- arena
class Arena(ArenaMapping):
    """The service's arena: creates the 0600 file, pre-faults it, and unlinks it on close."""

    def __init__(self, fd: int, path: str, size: int, prefault: bool) -> None:
        super().__init__(fd, path, size)
        self._fd: int | None = fd
        if prefault:
            self._start_prefault(fd)

    @classmethod
    def create(cls, shm_dir: str | os.PathLike[str], size: int, *, prefault: bool = True) -> Arena:
        """Create ``<shm_dir>/kvtier-<id>.arena`` of size bytes (mode 0600, O_EXCL) and map it."""
        if size < PAGE:
            raise ArenaError(f"arena size {size} is below one page ({PAGE} bytes)")
        directory = Path(shm_dir)
        if not directory.is_dir():
            raise ArenaError(f"shm_dir {directory} is not a directory")
        reap_stale_arenas(directory)
        _check_space(directory, size)
        _warn_unless_in_memory(directory)
        name = f"{ARENA_PREFIX}{secrets.token_hex(8)}"
        path, new = directory / f"{name}{ARENA_SUFFIX}", directory / f"{name}{_NEW_SUFFIX}"
        try:
            fd = os.open(new, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ArenaError(f"cannot create arena {path}: {exc.strerror}") from exc
        try:
            os.fchmod(fd, 0o600)  # a umask can only remove bits; make the mode exact anyway
            # The owner holds this lock for its lifetime: a later service reaps files nobody holds.
            # Locked before it gets its final name, so an unlocked '.arena' is always a dead one.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(new, path)
            os.ftruncate(fd, size)
            return cls(fd, str(path), size, prefault)
        except BaseException as exc:
            os.close(fd)
            for leftover in (new, path):
                with contextlib.suppress(OSError):
                    os.unlink(leftover)
            if isinstance(exc, OSError):
                msg = f"cannot size arena {path} to {size} bytes: {exc.strerror}"
                raise ArenaError(msg) from exc
            raise

    def info(self) -> ArenaInfo:
        """What a client needs to map this arena."""
        return ArenaInfo(self.path, self.size)

    def close(self) -> None:
        """Stop pre-faulting, unmap, unlink the file and drop its lock; safe to call twice."""
        self._stop_prefault()  # before the fd closes: the thread may be in fallocate on it
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        super().close()
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _check_space(directory: Path, size: int) -> None:
    # A full tmpfs would SIGBUS the first writer of an unbacked page: refuse at start instead.
    free = free_bytes(directory)
    if free < size:
        raise ArenaError(
            f"shm_dir {directory} has {free} bytes free, the arena needs {size} (lower cpu_size "
            "or enlarge the tmpfs)"
        )


def _warn_unless_in_memory(directory: Path) -> None:
    # On a disk filesystem the arena is a shared file mapping: the kernel writes every page the
    # prefault and the saves dirty back to the disk, tens of seconds later, whatever runs then.
    kind = filesystem_type(directory)
    if kind and kind not in MEMORY_FILESYSTEMS:
        log.warning(
            "shm_dir %s is on a %s filesystem, not tmpfs: the kernel will write the arena's pages back "
            "to disk; set shm_dir (KVTIER_SHM_DIR) to a tmpfs such as /dev/shm",
            directory,
            kind,
        )


def reap_stale_arenas(directory: str | os.PathLike[str], min_age_s: float = _STALE_AGE_S) -> list[str]:
    """Remove arena files whose owner died (nobody holds their lock); returns the removed paths.

    An arena is locked before it is renamed to its final name, so an unlocked ``.arena`` file is
    reaped at once (a service killed and respawned within a second leaves nothing behind); an
    unlocked ``.creating`` file only once it is min_age_s old, as its creator may not have locked it yet.
    """
    removed: list[str] = []
    uid = os.getuid()
    now = time.time()
    for entry in os.scandir(directory):
        final = bool(_ARENA_NAME.match(entry.name))
        if not final and not _NEW_NAME.match(entry.name):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
                continue
            if not final and now - st.st_mtime < min_age_s:
                continue
            fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live service holds it
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
            removed.append(entry.path)
            log.info("removed stale arena %s (%d bytes)", entry.path, st.st_size)
        finally:
            os.close(fd)
    return removed


# -------------------------------------------------------------------------------- allocator
class SlotAllocator:
    """Best-fit free-extent allocator over ``[0, size)`` with PAGE alignment and coalescing; each
    allocated slot has a dense id (1, 2, ...; reused once freed) naming its offset and length.

    A slot is *open* from alloc() until it is given back (free) or claimed (claim: the CPU tier
    took it over, and names it by its id from then on, until release). Only open slots are found by
    offset: a claimed slot's id is its owner's to keep, so no map from offset to id is kept for it.
    """

    def __init__(self, size: int, align: int = PAGE) -> None:
        if align <= 0 or align & (align - 1):
            raise ValueError(f"alignment {align} is not a power of two")
        self.align = align
        self.capacity = size // align * align
        self._free_offsets: list[int] = [0] if self.capacity else []
        self._free_len: dict[int, int] = {0: self.capacity} if self.capacity else {}
        # By slot id (id 0 is never handed out): arrays, not an object per slot.
        self.offsets = array("q", [0])
        self.lengths = array("q", [0])
        self._spare_ids: list[int] = []  # ids of freed slots, the last freed reused first
        self._open: dict[int, int] = {}  # offset -> id of each open slot
        self._in_use = 0
        self._used_bytes = 0
        self._lengths_seen: set[int] = set()  # every length ever allocated (one, usually)

    @property
    def used_bytes(self) -> int:
        """Bytes of allocated extents (aligned)."""
        return self._used_bytes

    @property
    def free_bytes(self) -> int:
        """Bytes not allocated, possibly fragmented."""
        return self.capacity - self._used_bytes

    @property
    def slots_in_use(self) -> int:
        """Allocated slots (open or claimed)."""
        return self._in_use

    @property
    def id_limit(self) -> int:
        """One more than the largest slot id handed out so far."""
        return len(self.offsets)

    @property
    def one_length(self) -> int | None:
        """The length of every slot ever allocated, when they all had one (then a batch of slots
        needs no read of their lengths), else None."""
        seen = self._lengths_seen
        return next(iter(seen)) if len(seen) == 1 else None

    def extent(self, length: int) -> int:
        """Bytes a slot of length occupies."""
        return align_up(max(length, 1), self.align)

    def _best_fit(self, need: int) -> tuple[int, int]:
        """The offset and length of the smallest free extent of at least need bytes (ties: the lowest
        offset); (-1, 0) when none fits."""
        best, best_len = -1, 0
        for off in self._free_offsets:
            ext = self._free_len[off]
            if need <= ext and (best < 0 or ext < best_len):
                best, best_len = off, ext
                if ext == need:
                    break
        return best, best_len

    def _cut(self, best: int, best_len: int, used: int) -> None:
        """Take the first used bytes of the free extent at best (best_len long); the rest stays free."""
        idx = bisect.bisect_left(self._free_offsets, best)
        del self._free_offsets[idx]
        del self._free_len[best]
        if best_len > used:
            rest = best + used
            self._free_offsets.insert(idx, rest)
            self._free_len[rest] = best_len - used

    def alloc(self, length: int) -> SlotRef | None:
        """An open slot of exactly length bytes at an aligned offset, or None when no extent fits."""
        need = self.extent(length)
        best, best_len = self._best_fit(need)
        if best < 0:
            return None
        self._cut(best, best_len, need)
        self._lengths_seen.add(length)
        if self._spare_ids:
            sid = self._spare_ids.pop()
            self.offsets[sid] = best
            self.lengths[sid] = length
        else:
            sid = len(self.offsets)
            self.offsets.append(best)
            self.lengths.append(length)
        self._open[best] = sid
        self._in_use += 1
        self._used_bytes += need
        return SlotRef(best, length)

    def alloc_many(self, length: int, count: int) -> list[SlotRef]:
        """Up to count open slots of length bytes, as that many alloc() calls would give them, until
        one fails: in C-level passes per free extent they are cut from.

        The extent alloc() picks is the smallest that fits, so what is left of it after a cut is
        smaller than every other extent that fits: the calls that follow cut from it too, as long
        as it holds a slot.
        """
        need = self.extent(length)
        out: list[SlotRef] = []
        self._lengths_seen.add(length)
        while len(out) < count:
            best, best_len = self._best_fit(need)
            if best < 0:
                break
            k = min(count - len(out), best_len // need)
            self._cut(best, best_len, k * need)
            offsets = range(best, best + k * need, need)
            out += map(_new_tuple, repeat(SlotRef), zip(offsets, repeat(length)))
            self._open.update(zip(offsets, self._new_ids(offsets, length), strict=True))
            self._in_use += k
            self._used_bytes += k * need
        return out

    def _new_ids(self, offsets: Sequence[int], length: int) -> list[int]:
        """Ids for new slots at these offsets, of one length: freed ids first (the last freed first)."""
        spare, k = self._spare_ids, len(offsets)
        reused = spare[: -k - 1 : -1] if k <= len(spare) else spare[::-1]
        del spare[len(spare) - len(reused) :]
        deque(map(setitem, repeat(self.offsets), reused, offsets), maxlen=0)
        deque(map(setitem, repeat(self.lengths), reused, repeat(length)), maxlen=0)
        first = len(self.offsets)
        self.offsets.extend(offsets[len(reused) :])
        self.lengths.extend(repeat(length, k - len(reused)))
        return reused + list(range(first, len(self.offsets)))

    def is_allocated(self, slot: SlotRef) -> bool:
        """True when slot is exactly an open slot (allocated, not claimed)."""
        sid = self._open.get(slot.offset)
        return sid is not None and self.lengths[sid] == slot.length

    def slot_of(self, sid: int) -> SlotRef:
        """The slot that id names (open or claimed)."""
        return SlotRef(self.offsets[sid], self.lengths[sid])

    def free(self, slot: SlotRef) -> int:
        """Give an open slot back (returns its id, now free); neighbouring free extents merge.
        Freeing an unknown slot is a bug."""
        if not self.is_allocated(slot):
            raise SlotStateError(f"{slot} is not an allocated slot")
        sid = self._open.pop(slot.offset)
        self._release(sid)
        return sid

    def claim(self, slots: Sequence[SlotRef], length: int | None = None) -> list[int]:
        """The ids of these open slots, which are claimed (no longer open); raises, claiming none,
        when one is not open or is named twice. length: every slot's length, when the caller knows
        they have one."""
        offsets = list(map(_offset_of, slots))
        ids: list[Any] = list(map(self._open.pop, offsets, repeat(None)))  # a repeat pops None
        if None not in ids:
            if length is not None and self.one_length == length:
                ok = True  # every slot has this length
            elif length is not None and len(ids) > 1:
                ok = itemgetter(*ids)(self.lengths).count(length) == len(ids)
            else:
                ok = [self.lengths[sid] for sid in ids] == list(map(_length_of, slots))
            if ok:
                return ids
        self._open.update((off, sid) for off, sid in zip(offsets, ids, strict=True) if sid is not None)
        bad = next((s for s in slots if not self.is_allocated(s)), slots[0] if slots else None)
        raise SlotStateError(f"{bad} is not an open slot (or is named twice)")

    def reopen(self, ids: Sequence[int]) -> list[SlotRef]:
        """Claimed slots handed on as open ones (to be filled anew); returns them."""
        if len(ids) < 2:
            slots = [self.slot_of(sid) for sid in ids]
            self._open.update(zip(map(_offset_of, slots), ids, strict=True))
            return slots
        offsets = itemgetter(*ids)(self.offsets)
        self._open.update(zip(offsets, ids, strict=True))
        lengths = itemgetter(*ids)(self.lengths)
        return list(map(_new_tuple, repeat(SlotRef), zip(offsets, lengths, strict=True)))

    def release(self, ids: Iterable[int]) -> None:
        """Give claimed slots back by id."""
        for sid in ids:
            self._release(sid)

    def _release(self, sid: int) -> None:
        """Free a slot's extent and its id."""
        off, length = self.offsets[sid], self.extent(self.lengths[sid])
        self._spare_ids.append(sid)
        self._in_use -= 1
        self._used_bytes -= length
        idx = bisect.bisect_left(self._free_offsets, off)
        if idx < len(self._free_offsets) and self._free_offsets[idx] == off + length:
            length += self._free_len.pop(off + length)
            del self._free_offsets[idx]
        if idx > 0:
            prev = self._free_offsets[idx - 1]
            if prev + self._free_len[prev] == off:
                self._free_len[prev] += length
                return
        self._free_offsets.insert(idx, off)
        self._free_len[off] = length
