"""How much GPU memory the CUDA copier's staging buffers take.

They come out of the headroom vLLM leaves, so they are sized from the memory free when the copier is
built; a copier refuses to start where not even one layer of a chunk per buffer fits.
Design: docs/internals.md#cuda-copies-copy_cudapy-stagingpy-pinningpy
"""

from __future__ import annotations

# Staging bytes per piece, and buffers in a lane's ring (one filling while the other is in the DMA).
# 16 MiB pieces reach the plain cudaMemcpy's speed (docs/performance.md) and still split a large
# model's chunk into layer pieces, so the forward's first layers start while later ones load.
PIECE_BYTES = 16 << 20
RING = 2
LANES = 2  # saves and loads
STAGING_SHARE = 8  # staging takes at most 1/STAGING_SHARE of the memory free at registration


class StagingError(ValueError):
    """The device has not the memory for one staging piece of one layer per buffer."""


def layers_per_piece(layer_chunk_bytes: int, num_layers: int, free_bytes: int) -> int:
    """Layers of a chunk one staging piece holds: up to PIECE_BYTES, within the headroom's share."""
    buffers = LANES * RING
    wanted = max(1, min(num_layers, PIECE_BYTES // layer_chunk_bytes))
    fitting = free_bytes // STAGING_SHARE // (buffers * layer_chunk_bytes)
    layers = max(1, min(wanted, fitting))
    if buffers * layers * layer_chunk_bytes > free_bytes:
        raise StagingError(
            f"the GPU has {free_bytes} bytes free after vLLM's KV cache; kvtier's staging needs "
            f"{buffers * layer_chunk_bytes} (one layer of a chunk per buffer): lower "
            "gpu_memory_utilization or chunk_size"
        )
    return layers
