"""`kvtier bench gpu` (or `python -m bench.gpu_copy`): GPU <-> arena block copies on CUDA.

The KV cache has Llama-3.1-8B's shape in vLLM's FlashAttention layout (32 layers of
``[2, num_blocks, 16, 8, 128]`` bf16, 64 KiB pages), chunks are 256 tokens (32 MiB), and the
arena is a tmpfs file mapped and registered as pinned memory, as the worker maps it. The copier
runs the worker's paths: ``save_batch`` for saves, ``load_layers`` for loads, 16 chunks (a
4096-token prompt) per batch, with block ids stepping up (a fresh engine), stepping down (vLLM's
order once its prefix cache recycles blocks) and scattered (a fragmented cache). The reference is
one ``cudaMemcpyAsync`` per chunk of the same bytes between the same pinned arena and a contiguous
device buffer, measured in the same run, rounds interleaved, best of each. Every copy is checked
byte for byte once before it is timed.

Imports torch and connector.copy only (no vLLM), so it runs where vLLM cannot be installed.
Without a CUDA device it reports ``{"available": false}``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

LAYERS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, CHUNK_TOKENS = 32, 8, 128, 16, 256


def _timed(fn: Callable[[], object]) -> float:
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(chunks: int = 16, rounds: int = 7) -> dict[str, Any]:
    """Save and load throughput of the copier against cudaMemcpy of the same bytes."""
    import torch

    if not torch.cuda.is_available():
        return {"available": False, "reason": "no CUDA device"}
    from connector.copy import BlockCopier, pin_host_buffer, unpin_host_buffer

    dev = torch.device("cuda")
    bpc = CHUNK_TOKENS // BLOCK_SIZE
    num_blocks = 4 * chunks * bpc
    gen = torch.Generator(device=dev).manual_seed(0)
    kv = [
        torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, device=dev, generator=gen).to(
            torch.bfloat16
        )
        for _ in range(LAYERS)
    ]
    copier = BlockCopier(kv, num_blocks, bpc)
    nbytes = chunks * copier.chunk_bytes
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix="kvtier-bench-", suffix=".arena", dir=shm)
    mapping = None
    pinned = False
    try:
        os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes)
        view = memoryview(mapping)
        host = torch.frombuffer(view, dtype=torch.uint8)
        host.fill_(1)  # touched, as the arena's pages are
        pinned = pin_host_buffer(view)
        result = _run(copier, kv, host, chunks, rounds, num_blocks)
        result["arena_pinned"] = pinned
        return result
    finally:
        copier.close()
        if mapping is not None:
            host = view = None  # type: ignore[assignment]
            if pinned:
                unpin_host_buffer(memoryview(mapping))
            mapping.close()
        os.close(fd)
        os.unlink(path)


def _run(copier: Any, kv: list[Any], host: Any, chunks: int, rounds: int, num_blocks: int) -> dict[str, Any]:
    import torch

    dev = kv[0].device
    chunk_bytes = copier.chunk_bytes
    bpc = CHUNK_TOKENS // BLOCK_SIZE
    shape = (copier.num_layers, bpc, copier.layout.page_bytes)
    slots = [host[c * chunk_bytes : (c + 1) * chunk_bytes].view(shape) for c in range(chunks)]
    device_buf = torch.empty(chunks * chunk_bytes, dtype=torch.uint8, device=dev)
    stream = torch.cuda.Stream()
    loader = type(copier)([torch.zeros_like(t) for t in kv], num_blocks, bpc)

    def ref(to_host: bool) -> None:
        with torch.cuda.stream(stream):
            for c in range(chunks):
                at = slice(c * chunk_bytes, (c + 1) * chunk_bytes)
                if to_host:
                    host[at].copy_(device_buf[at], non_blocking=True)
                else:
                    device_buf[at].copy_(host[at], non_blocking=True)
        stream.synchronize()

    top = num_blocks - 1
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
    cases = {
        "consecutive": [list(range(7 + c * bpc, 7 + (c + 1) * bpc)) for c in range(chunks)],
        # vLLM's order once its prefix cache recycles blocks: each chunk's ids step down
        "descending": [list(range(top - c * bpc, top - (c + 1) * bpc, -1)) for c in range(chunks)],
        "scattered": [perm[c * bpc : (c + 1) * bpc] for c in range(chunks)],
    }
    out: dict[str, Any] = {
        "available": True,
        "device": torch.cuda.get_device_name(dev),
        "chunks": chunks,
        "chunk_bytes": chunk_bytes,
        "model": "Llama-3.1-8B KV, bf16, block 16, 256-token chunks",
    }
    ratios = []
    for name, id_lists in cases.items():
        batch = list(zip(slots, id_lists, strict=True))
        errors: list[BaseException | None] = []

        def save(batch: list[Any] = batch, errors: list[BaseException | None] = errors) -> None:
            copier.save_batch(batch, errors.append)
            copier.wait()

        def load(id_lists: list[list[int]] = id_lists) -> None:
            loads = loader.load_layers([(slot, 0, ids) for slot, ids in zip(slots, id_lists, strict=True)])
            if loads.finish() is not None:
                raise RuntimeError("load failed")

        host.fill_(0)
        save()
        if errors != [None]:
            raise RuntimeError(f"save failed: {errors}")
        for slot, ids in zip(slots, id_lists, strict=True):
            index = torch.tensor(ids, device=dev)
            # a slot row of a layer: the block's row in every plane, side by side
            want = torch.stack([torch.cat([p[index] for p in planes], dim=1) for planes in copier.layers])
            if not torch.equal(slot.to(dev), want):
                raise RuntimeError(f"{name}: a saved chunk differs from its blocks")
        load()
        for ids in id_lists:
            index = torch.tensor(ids, device=dev)
            for saved, restored in zip(copier.layers, loader.layers, strict=True):
                if not all(torch.equal(a[index], b[index]) for a, b in zip(saved, restored, strict=True)):
                    raise RuntimeError(f"{name}: a loaded block differs from the saved one")
        best = {"save": float("inf"), "load": float("inf"), "d2h": float("inf"), "h2d": float("inf")}
        for _ in range(rounds):
            for key, fn in (
                ("d2h", lambda: ref(True)),
                ("save", save),
                ("h2d", lambda: ref(False)),
                ("load", load),
            ):
                best[key] = min(best[key], _timed(fn))
        gb = chunks * chunk_bytes / 1e9
        case = {f"{k}_gbps": round(gb / v, 2) for k, v in best.items()}
        case["save_ratio"] = round(best["d2h"] / best["save"], 3)
        case["load_ratio"] = round(best["h2d"] / best["load"], 3)
        ratios += [case["save_ratio"], case["load_ratio"]]
        out[name] = case
    loader.close()
    out["copy_ratio"] = min(ratios)
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point of `kvtier bench gpu` / `python -m bench.gpu_copy`."""
    parser = argparse.ArgumentParser(
        prog="kvtier bench gpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--chunks", type=int, default=16, help="chunks per batch (default 16)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds, best of each")
    args = parser.parse_args(argv)
    if args.chunks < 1 or args.rounds < 1:
        parser.error("--chunks and --rounds must be at least 1")
    result = measure(args.chunks, args.rounds)
    if args.json:
        print(json.dumps(result))
    elif not result["available"]:
        print(f"kvtier bench gpu: {result['reason']}; nothing measured")
    else:
        print(f"{result['device']}: {result['model']}, {result['chunks']} chunks per batch")
        for name in ("consecutive", "descending", "scattered"):
            c = result[name]
            print(
                f"  {name:<12} save {c['save_gbps']:6.2f} GB/s ({c['save_ratio']:.3f}x of {c['d2h_gbps']})"
                f"  load {c['load_gbps']:6.2f} GB/s ({c['load_ratio']:.3f}x of {c['h2d_gbps']})"
            )
        print(f"copy_ratio (worst) {result['copy_ratio']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
