"""`kvtier bench signing`: what a shared tier's MAC costs against the checksum every load pays.

For payloads of 8 and 32 MiB (a chunk of Llama-3.1-8B's KV is 32 MiB), the best of --repeats
timings of: the xxh3 checksum (the reference), HMAC-SHA256 through hashlib, and BLAKE3 in keyed
mode (the construction storage/signing.py uses), on one thread and on two. The ratios to the
checksum say what signing adds to a Redis or object-tier load on this machine. ``--ttft`` measures
what it adds to a user's time to first token instead (bench/signing_ttft.py).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import sys
import time
from collections.abc import Callable

import blake3

from kvtier.storage import codec

SIZES_MIB = (8, 32)


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The shortest of repeats timings of fn()."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(size_mib: int, repeats: int) -> dict[str, float]:
    """Milliseconds of each construction over size_mib MiB of random bytes."""
    key = os.urandom(32)
    view = memoryview(bytearray(os.urandom(size_mib << 20)))
    runs: dict[str, Callable[[], object]] = {
        "xxh3_checksum": lambda: codec.checksum(view),
        "hmac_sha256": lambda: hmac.new(key, view, hashlib.sha256).digest(),
        "blake3_keyed": lambda: blake3.blake3(view, key=key).digest(),
        "blake3_keyed_2_threads": lambda: blake3.blake3(view, key=key, max_threads=2).digest(),
    }
    return {name: round(best_seconds(fn, repeats) * 1e3, 3) for name, fn in runs.items()}


def main(argv: list[str] | None = None) -> int:
    """Entry point of `kvtier bench signing`."""
    parser = argparse.ArgumentParser(prog="kvtier bench signing", description=__doc__)
    parser.add_argument("--repeats", type=int, default=7, help="timings per figure (default 7)")
    parser.add_argument(
        "--ttft",
        action="store_true",
        help="instead: a Redis and an object hit's TTFT with tier_key set against without it, two "
        "engines side by side taking turns (bench/signing_ttft.py; minutes)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="--ttft: rounds over the prompts (default 3)")
    parser.add_argument(
        "--quick", action="store_true", help="--ttft: one prompt, one round, no warm-up (a smoke test)"
    )
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.rounds < 1:
        parser.error(f"--repeats and --rounds must be at least 1, got {args.repeats} and {args.rounds}")
    if args.ttft:
        from kvtier.bench import signing_ttft

        if args.quick:
            figures = signing_ttft.measure(rounds=1, prompts_each=1, warm=False)
        else:
            figures = signing_ttft.measure(rounds=args.rounds)
        print(json.dumps(figures, indent=2))
        return 0
    out = {}
    for size in SIZES_MIB:
        ms = measure(size, args.repeats)
        ref = ms["xxh3_checksum"]
        out[f"{size}MiB"] = {"ms": ms, "ratio_to_checksum": {k: round(v / ref, 1) for k, v in ms.items()}}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
