"""Registering the arena mapping as pinned host memory, so CUDA copies to and from it run as DMA, and
binding kvtier's own threads to the KV cache's device.

Every function here takes the device explicitly and makes it the calling thread's device first.
Design: docs/internals.md#cuda-copies-copy_cudapy-stagingpy-pinningpy
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: its handler, format and level

PIN_PIECE_BYTES = 64 << 30
_PAGE = 4096


def bind_device(device: torch.device) -> None:
    """Make ``device`` (a CUDA device with its index) the calling thread's device; nothing for
    another device type."""
    if device.type != "cuda":
        return
    if device.index is None:
        raise ValueError(f"{device} names no device index; kvtier binds threads to the KV cache's device")
    torch.cuda.set_device(device)


def pin_pieces(size: int, slot_bytes: int, piece_bytes: int = PIN_PIECE_BYTES) -> list[tuple[int, int]]:
    """(offset, length) of the registrations of ``size`` bytes: at most ``piece_bytes`` each (one
    slot at least), every inner boundary on a slot boundary and a page boundary (slots lie at
    offsets that are multiples of their page-aligned extent)."""
    extent = -(-max(slot_bytes, 1) // _PAGE) * _PAGE
    piece = max(extent, piece_bytes - piece_bytes % extent)
    return [(offset, min(piece, size - offset)) for offset in range(0, size, piece)]


def pin_host_buffer(
    buf: memoryview, device: torch.device, slot_bytes: int, piece_bytes: int = PIN_PIECE_BYTES
) -> list[int]:
    """Register a host buffer for DMA with ``device``'s context, in pieces that end on slot
    boundaries; the addresses registered (none without CUDA, or when CUDA refuses: the copies then
    run from pageable memory, correct and slower)."""
    if not torch.cuda.is_available() or len(buf) == 0:
        return []
    bind_device(device)
    cudart = torch.cuda.cudart()
    base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    pinned: list[int] = []
    for offset, size in pin_pieces(len(buf), slot_bytes, piece_bytes):
        result = int(cudart.cudaHostRegister(base + offset, size, 0))
        if result == 0:
            pinned.append(base + offset)
            continue
        clear_cuda_error(device)
        log.warning(
            "kvtier: cannot pin the arena for DMA (CUDA error %d at %d of %d bytes; a file outside "
            "tmpfs cannot be pinned, keep shm_dir on tmpfs such as /dev/shm); copies run from "
            "pageable memory, slower",
            result, offset, len(buf),
        )  # fmt: skip
        unpin_host_buffer(pinned, device)
        return []
    return pinned


def unpin_host_buffer(addresses: list[int], device: torch.device) -> None:
    """Undo pin_host_buffer, with the context it registered with (nothing to do for an empty list)."""
    if not addresses:
        return
    bind_device(device)
    cudart = torch.cuda.cudart()
    for address in reversed(addresses):
        result = int(cudart.cudaHostUnregister(address))
        if result != 0:
            clear_cuda_error(device)
            log.warning("kvtier: cudaHostUnregister failed (CUDA error %d)", result)


def clear_cuda_error(device: torch.device) -> None:
    """Take the error a failed runtime call left behind on ``device``, so no later launch check
    raises it."""
    bind_device(device)
    cudart = torch.cuda.cudart()
    get_last_error = getattr(cudart, "cudaGetLastError", None)
    if get_last_error is not None:
        get_last_error()
        return
    # torch's launch check calls cudaGetLastError: a launch here takes the error instead.
    try:
        torch.zeros(1, device=device)
    except RuntimeError:
        return
