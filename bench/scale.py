"""`kvtier bench scale`: how kvtier's costs grow with the size of its tiers, with the engines
sharing one service and with the context, and what the KV events stream costs
(``bench/scale_tiers.py``, ``bench/scale_service.py``, ``bench/scale_context.py``,
``bench/scale_events.py``).

``kvtier bench scale`` runs every part; ``kvtier bench scale tiers``, ``... service``,
``... context`` or ``... events`` one of them.
``--quick`` runs each at small sizes (seconds, for a test); the figures go to ``--out`` (default
``kvtier-scale.json`` in the current directory) and a summary to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from kvtier.bench import scale_context, scale_events, scale_service, scale_tiers

PARTS = ("tiers", "service", "context", "events")


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be 1 or more")
    return values


def _names(text: str) -> tuple[str, ...]:
    names = tuple(text.split(","))
    unknown = sorted(set(names) - set(scale_tiers.TIERS))
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown tiers {unknown}: choose from {', '.join(scale_tiers.TIERS)}"
        )
    return names


def parser() -> argparse.ArgumentParser:
    """The command line of `kvtier bench scale`."""
    p = argparse.ArgumentParser(prog="kvtier bench scale", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "part", nargs="?", choices=(*PARTS, "all"), default="all", help="what to run (default: all)"
    )
    p.add_argument("--quick", action="store_true", help="small sizes, one run each (seconds, for tests)")
    p.add_argument(
        "--out", default="kvtier-scale.json", help="JSON file of the figures (default: %(default)s)"
    )
    p.add_argument(
        "--repeats", type=int, default=None, help="runs of each figure (default 3; 1 with --quick)"
    )
    p.add_argument("--sizes", type=_ints, default=None, help="chunks per tier (default 1000,100000,1000000)")
    p.add_argument(
        "--tiers", type=_names, default=None, help=f"tiers (default {','.join(scale_tiers.TIERS)})"
    )
    p.add_argument("--connections", type=_ints, default=None, help="connection counts (default 1,4,16,64)")
    p.add_argument(
        "--seconds", type=float, default=None, help="seconds per service phase or events run (default 3)"
    )
    p.add_argument("--rate", type=float, default=200.0, help="paced requests per second, all connections")
    p.add_argument(
        "--contexts", type=_ints, default=None, help="prompt tokens (default 1024,4096,16384,32768,65536)"
    )
    p.add_argument("--no-pin", action="store_true", help="do not pin the service and the clients to CPUs")
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The figures of the parts asked for."""
    quick = args.quick
    repeats = args.repeats or (1 if quick else 3)
    out: dict[str, Any] = {"quick": quick, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if args.part in ("tiers", "all"):
        sizes = args.sizes or (scale_tiers.QUICK_SIZES if quick else scale_tiers.SIZES)
        seconds = 0.02 if quick else scale_tiers.PHASE_S
        out["tiers"] = scale_tiers.measure(sizes, args.tiers or scale_tiers.TIERS, repeats, seconds)
    if args.part in ("service", "all"):
        connections = args.connections or (
            scale_service.QUICK_CONNECTIONS if quick else scale_service.CONNECTIONS
        )
        seconds = args.seconds or (0.3 if quick else 3.0)
        pin = False if args.no_pin else None
        out["service"] = scale_service.measure(connections, seconds, repeats, args.rate, pin)
    if args.part in ("context", "all"):
        contexts = args.contexts or (scale_context.QUICK_CONTEXTS if quick else scale_context.CONTEXTS)
        rounds = 1 if quick else scale_context.ROUNDS
        out["context"] = scale_context.measure(contexts, repeats, rounds)
    if args.part in ("events", "all"):
        out["events"] = scale_events.measure(quick, repeats, args.seconds or (0.3 if quick else 3.0))
    return out


def summary(fig: dict[str, Any]) -> list[str]:
    """Lines for stdout: each tier's per-chunk costs and memory, each connection count's figures."""
    lines = []
    for name, tier in fig.get("tiers", {}).get("tiers", {}).items():
        for n, f in tier["by_chunks"].items():
            if "skipped" in f:
                lines.append(f"{name:>12} {n:>9}: skipped ({f['skipped']})")
                continue
            costs = " ".join(
                f"{k.removesuffix('_us')} {f[k]['median']:.3f}"
                for k in ("lookup_us", "lookup_spread_us", "commit_us", "commit_evict_us")
            )
            memory = f.get("server_index_bytes", f["index_bytes"])
            lines.append(f"{name:>12} {n:>9} chunks: us/chunk {costs}; index {memory:.0f} B/chunk")
        lines.append(f"{name:>12} largest/smallest: {tier['largest_over_smallest']}")
    service = fig.get("service")
    if service:
        for load in ("saturated", "paced"):
            for count, f in service[load].items():
                lines.append(
                    f"{load:>9} {count:>3} conn: {f['ops_per_s']['median']:.0f} ops/s, lookup p50"
                    f" {f['lookup_p50_us']['median']:.0f} us p99 {f['lookup_p99_us']['median']:.0f} us,"
                    f" service {f['service_cpu_us_per_op']['median']:.1f} us CPU/op"
                    f" ({f['service_cores']['median']:.2f} cores)"
                )
        lines.append(f"paced lookup p99 / 1 connection: {service['paced_lookup_p99_over_one_connection']}")
    context = fig.get("context")
    if context:
        for name, by_tokens in context["tiers"].items():
            for n, f in by_tokens.items():
                low, high = f["ratio"]["spread"]
                lines.append(
                    f"context {name:>5} {n:>6} tokens: hit {f['hit_ms']['median']:.1f} ms, floor"
                    f" {f['floor_ms']['median']:.1f} ms, hit/floor {f['ratio']['median']:.3f}"
                    f" ({low:.3f}-{high:.3f})"
                )
        lines.append(f"context hit/floor longest / first: {context['longest_over_first']}")
        for name, fit in context["slopes"].items():
            lines.append(
                f"context {name:>5} slopes: hit/floor {fit['ratio_per_doubling']:+.3f} per doubling;"
                f" ms per 1k tokens hit {fit['hit_ms_per_1k_tokens']:.2f},"
                f" floor {fit['floor_ms_per_1k_tokens']:.2f}"
                f" (ratio {fit['hit_slope_over_floor_slope']})"
            )
    if "events" in fig:
        lines += scale_events.summary(fig["events"])
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Run, write the JSON, print the summary."""
    args = parser().parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        parser().error(f"--repeats must be 1 or more, not {args.repeats}")
    fig = run(args)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(fig, f, indent=1)
    print("\n".join(summary(fig)))
    print(f"figures written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
