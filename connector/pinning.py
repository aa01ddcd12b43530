"""Registering the arena mapping as pinned host memory, so CUDA copies to and from it run as DMA.

A registration is split into pieces of at most ``PIN_PIECE_BYTES``, as vLLM's own offloading does
for its host region (drivers refuse or stall on very large single registrations). A slot that
straddles two pieces still copies correctly, as pageable memory. Every failed call's error is
cleared at once: the CUDA runtime keeps it for the next launch check, where one of vLLM's kernels
would raise it.
"""

from __future__ import annotations

import contextlib
import logging

import torch

log = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: its handler, format and level

PIN_PIECE_BYTES = 64 << 30
_PAGE = 4096


def pin_host_buffer(buf: memoryview, piece_bytes: int = PIN_PIECE_BYTES) -> list[int]:
    """Register a host buffer for DMA in pieces; the addresses registered (none without CUDA, or
    when CUDA refuses: the copies then run from pageable memory, correct and slower)."""
    if not torch.cuda.is_available() or len(buf) == 0:
        return []
    cudart = torch.cuda.cudart()
    base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    piece = max(_PAGE, piece_bytes - piece_bytes % _PAGE)
    pinned: list[int] = []
    for offset in range(0, len(buf), piece):
        size = min(piece, len(buf) - offset)
        result = int(cudart.cudaHostRegister(base + offset, size, 0))
        if result == 0:
            pinned.append(base + offset)
            continue
        clear_cuda_error()
        log.warning(
            "kvtier: cannot pin the arena for DMA (CUDA error %d at %d of %d bytes; a file outside "
            "tmpfs cannot be pinned, keep shm_dir on tmpfs such as /dev/shm); copies run from "
            "pageable memory, slower",
            result, offset, len(buf),
        )  # fmt: skip
        unpin_host_buffer(pinned)
        return []
    return pinned


def unpin_host_buffer(addresses: list[int]) -> None:
    """Undo pin_host_buffer (nothing to do for an empty list)."""
    if not addresses:
        return
    cudart = torch.cuda.cudart()
    for address in reversed(addresses):
        result = int(cudart.cudaHostUnregister(address))
        if result != 0:
            clear_cuda_error()
            log.warning("kvtier: cudaHostUnregister failed (CUDA error %d)", result)


def clear_cuda_error() -> None:
    """Take the error a failed runtime call left behind, so no later launch check raises it."""
    cudart = torch.cuda.cudart()
    get_last_error = getattr(cudart, "cudaGetLastError", None)
    if get_last_error is not None:
        get_last_error()
        return
    # torch's launch check calls cudaGetLastError: a launch here takes the error instead.
    with contextlib.suppress(RuntimeError):
        torch.zeros(1, device="cuda")
