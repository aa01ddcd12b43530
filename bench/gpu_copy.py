"""`kvtier bench gpu` (or `python -m kvtier.bench.gpu_copy`): GPU <-> arena block copies on CUDA.

The KV cache has Llama-3.1-8B's shape (32 layers, 8 KV heads of 128, bf16, block 16: 64 KiB pages)
in the views vLLM 0.32 hands a connector (``bench.kv_views``: LBNHC, vLLM's default, or
``--layout``), chunks are 256 tokens (32 MiB), and the arena is a tmpfs file mapped and registered
as pinned memory, as the worker maps it. The copier runs the worker's paths: ``save_batch`` for
saves, ``load_layers`` for loads, 16 chunks (a 4096-token prompt) per batch, with block ids stepping
up (a fresh engine), stepping down (vLLM's order once its prefix cache recycles blocks) and
scattered (a fragmented cache). The reference is one ``cudaMemcpyAsync`` per chunk of the same bytes
between the same pinned arena and a contiguous device buffer, measured in the same run, rounds
interleaved, best of each. Every copy is checked byte for byte once before it is timed, against the
pages the views' strides place each block at, and every timed batch's outcome is checked: a save
whose callback or a load whose ``finish()`` reports an error fails the run.

Imports torch and kvtier's copier only (no vLLM), so it runs where vLLM cannot be installed.
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
DEFAULT_LAYOUT = "LBNHC"


class CopyFailed(RuntimeError):
    """A copy reported an error or moved other bytes than the blocks hold."""


def _timed(fn: Callable[[], object]) -> float:
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _kv(num_blocks: int, layout: str, seed: int) -> tuple[Any, list[Any]]:
    """vLLM's raw KV buffer of random bytes and its per-layer views, on the GPU."""
    import torch

    from kvtier.bench.kv_views import kv_cache_views

    raw, views = kv_cache_views(
        LAYERS, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, torch.bfloat16, layout, "cuda"
    )
    gen = torch.Generator(device=raw.device).manual_seed(seed)
    raw.view(torch.uint8).random_(0, 256, generator=gen)
    return raw, views


def measure(chunks: int = 16, rounds: int = 7, layout: str = DEFAULT_LAYOUT) -> dict[str, Any]:
    """Save and load throughput of the copier against cudaMemcpy of the same bytes."""
    import torch

    if not torch.cuda.is_available():
        return {"available": False, "reason": "no CUDA device"}
    from kvtier.connector.copy import BlockCopier
    from kvtier.connector.pinning import pin_host_buffer, unpin_host_buffer

    bpc = CHUNK_TOKENS // BLOCK_SIZE
    num_blocks = 4 * chunks * bpc
    saved = _kv(num_blocks, layout, seed=0)
    loaded = _kv(num_blocks, layout, seed=1)
    copier = BlockCopier(saved[1], num_blocks, bpc)
    loader = BlockCopier(loaded[1], num_blocks, bpc)
    nbytes = chunks * copier.chunk_bytes
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix="kvtier-bench-", suffix=".arena", dir=shm)
    mapping = None
    pinned: list[int] = []
    try:
        os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes)
        view = memoryview(mapping)
        host = torch.frombuffer(view, dtype=torch.uint8)
        host.fill_(1)  # touched, as the arena's pages are
        pinned = pin_host_buffer(view, copier.device, copier.chunk_bytes)
        result = _run(copier, loader, saved, loaded, host, chunks, rounds)
        result["arena_pinned"] = bool(pinned)
        result["layout"] = layout
        return result
    finally:
        copier.close()
        loader.close()
        unpin_host_buffer(pinned, copier.device)
        if mapping is not None:
            host = view = None  # type: ignore[assignment]
            mapping.close()
        os.close(fd)
        os.unlink(path)


def _pages(raw: Any, view: Any, num_blocks: int, ids: list[int]) -> Any:
    """uint8 ``[len(ids), page]``: each block's page of one layer, its bytes in address order."""
    import torch

    from kvtier.bench.kv_views import page_addresses

    return torch.stack([raw[page_addresses(view, num_blocks, b)] for b in ids]).view(torch.uint8)


def _check_bytes(what: str, kv: tuple[Any, list[Any]], slots: list[Any], id_lists: list[list[int]]) -> None:
    """Every slot row holds its block's page, in every layer (after a save, and after a load)."""
    import torch

    raw, views = kv
    num_blocks = views[0].shape[0]  # no kernel-block split here
    for slot, ids in zip(slots, id_lists, strict=True):
        for layer, view in enumerate(views):
            want = _pages(raw, view, num_blocks, ids)
            if not torch.equal(slot[layer, : len(ids)].to(want.device), want):
                raise CopyFailed(f"{what}: layer {layer} of a chunk differs from its blocks")


def _cases(num_blocks: int, chunks: int, bpc: int) -> dict[str, list[list[int]]]:
    """Each batch's chunks of block ids: ascending, descending, scattered."""
    import torch

    top = num_blocks - 1
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
    return {
        "consecutive": [list(range(7 + c * bpc, 7 + (c + 1) * bpc)) for c in range(chunks)],
        # vLLM's order once its prefix cache recycles blocks: each chunk's ids step down
        "descending": [list(range(top - c * bpc, top - (c + 1) * bpc, -1)) for c in range(chunks)],
        "scattered": [perm[c * bpc : (c + 1) * bpc] for c in range(chunks)],
    }


def _run(
    copier: Any, loader: Any, saved: Any, loaded: Any, host: Any, chunks: int, rounds: int
) -> dict[str, Any]:
    import torch

    bpc = copier.blocks_per_chunk
    chunk_bytes = copier.chunk_bytes
    shape = (copier.num_layers, bpc, copier.layout.page_bytes)
    slots = [host[c * chunk_bytes : (c + 1) * chunk_bytes].view(shape) for c in range(chunks)]
    out: dict[str, Any] = {
        "available": True,
        "device": torch.cuda.get_device_name(saved[0].device),
        "chunks": chunks,
        "chunk_bytes": chunk_bytes,
        "model": "Llama-3.1-8B KV, bf16, block 16, 256-token chunks",
    }
    ratios = []
    for name, id_lists in _cases(copier.num_blocks, chunks, bpc).items():
        case = _case(name, copier, loader, saved, loaded, host, slots, id_lists, rounds)
        ratios += [case["save_ratio"], case["load_ratio"]]
        out[name] = case
    out["copy_ratio"] = min(ratios)
    return out


def _case(
    name: str,
    copier: Any,
    loader: Any,
    saved: Any,
    loaded: Any,
    host: Any,
    slots: list[Any],
    id_lists: list[list[int]],
    rounds: int,
) -> dict[str, Any]:
    """Check one batch's bytes both ways, then time it against cudaMemcpy, best of ``rounds``."""
    import torch

    chunk_bytes = copier.chunk_bytes
    device_buf = torch.empty(len(slots) * chunk_bytes, dtype=torch.uint8, device=saved[0].device)
    stream = torch.cuda.Stream()

    def ref(to_host: bool) -> None:
        _memcpy(host, device_buf, stream, chunk_bytes, to_host)

    def save() -> None:
        outcomes: list[BaseException | None] = []
        copier.save_batch(list(zip(slots, id_lists, strict=True)), outcomes.append)
        copier.wait()
        if outcomes != [None]:
            raise CopyFailed(f"{name}: a save batch reported {outcomes}")

    def load() -> None:
        error = loader.load_layers(
            [(slot, 0, ids) for slot, ids in zip(slots, id_lists, strict=True)]
        ).finish()
        if error is not None:
            raise CopyFailed(f"{name}: a load batch reported {error!r}") from error

    host.fill_(0)
    save()
    _check_bytes(f"{name} save", saved, slots, id_lists)
    load()
    _check_bytes(f"{name} load", loaded, slots, id_lists)
    best = {"save": float("inf"), "load": float("inf"), "d2h": float("inf"), "h2d": float("inf")}
    for _ in range(rounds):
        for key, fn in (
            ("d2h", lambda: ref(True)),
            ("save", save),
            ("h2d", lambda: ref(False)),
            ("load", load),
        ):
            best[key] = min(best[key], _timed(fn))
    gb = len(slots) * chunk_bytes / 1e9
    case: dict[str, Any] = {f"{k}_gbps": round(gb / v, 2) for k, v in best.items()}
    case["save_ratio"] = round(best["d2h"] / best["save"], 3)
    case["load_ratio"] = round(best["h2d"] / best["load"], 3)
    return case


def _memcpy(host: Any, device_buf: Any, stream: Any, chunk_bytes: int, to_host: bool) -> None:
    """The reference: one cudaMemcpyAsync per chunk between the pinned arena and a device buffer."""
    import torch

    with torch.cuda.stream(stream):
        for at in range(0, host.numel(), chunk_bytes):
            if to_host:
                host[at : at + chunk_bytes].copy_(device_buf[at : at + chunk_bytes], non_blocking=True)
            else:
                device_buf[at : at + chunk_bytes].copy_(host[at : at + chunk_bytes], non_blocking=True)
    stream.synchronize()


def main(argv: list[str] | None = None) -> int:
    """Entry point of `kvtier bench gpu` / `python -m kvtier.bench.gpu_copy`."""
    from kvtier.bench.kv_views import LAYOUTS

    parser = argparse.ArgumentParser(
        prog="kvtier bench gpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--chunks", type=int, default=16, help="chunks per batch (default 16)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds, best of each")
    parser.add_argument(
        "--layout",
        choices=sorted(LAYOUTS),
        default=DEFAULT_LAYOUT,
        help=f"vLLM's KV layout ({DEFAULT_LAYOUT})",
    )
    args = parser.parse_args(argv)
    if args.chunks < 1 or args.rounds < 1:
        parser.error("--chunks and --rounds must be at least 1")
    result = measure(args.chunks, args.rounds, args.layout)
    if args.json:
        print(json.dumps(result))
    elif not result["available"]:
        print(f"kvtier bench gpu: {result['reason']}; nothing measured")
    else:
        print(
            f"{result['device']}: {result['model']}, {result['layout']}, {result['chunks']} chunks per batch"
        )
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
