"""`make bench`: every benchmark, one JSON (kvtier-bench.json in the working directory, unless --out
says where), a short table of the ratios and a chart of each figure against its target (next to the
JSON, kvtier-bench.png, unless --chart says where)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvtier.bench.chart import Headline, targets_chart
from kvtier.bench.floors import HIT_FLOOR_TARGETS
from kvtier.bench.progress import step

# In the working directory, never beside the installed package; `kvtier bench serve` and `kvtier bench
# kill` write their sections into the same file.
RESULTS = Path("kvtier-bench.json")

# (section, key, target, higher is better); the targets are the strictest an issue set.
HEADLINES = [
    # The storage benchmark's 2 MiB disk get (against a plain read) is a diagnostic in the JSON:
    # what a user feels is the hit's TTFT, which connector.hit_floor_ratio.disk measures.
    ("storage", "disk.put_ratio", 0.8, True),
    ("storage", "redis.put_ratio", 1.0, True),
    ("storage", "redis.get_ratio", 2.0, True),
    ("storage", "redis.get_ratio_parallel", 1.5, True),
    ("storage", "arena.stage_ratio", None, True),
    ("service", "lookup_p50_ratio", 3.0, False),
    ("service", "lookup_p99_ratio", 5.0, False),
    ("service", "lookup_fresh_p50_ratio", 3.0, False),
    ("service", "lookup_fresh_p99_ratio", 5.0, False),
    ("service", "commit_p50_ratio", None, False),
    ("service", "rss_mb", 200.0, False),
    ("connector", "copy_ratio", 0.7, True),
    ("connector", "scheduler_overhead_fraction", 0.10, False),
    ("connector", "ttft_miss_ratio", 1.02, False),
    # Where the miss ratio could have landed with other engines (a 95% bootstrap over engine pairs).
    ("connector", "ttft.ttft_miss_ratio_low95", None, False),
    ("connector", "ttft.ttft_miss_ratio_high95", None, False),
    # What of a miss's gap is the forward (no kvtier code runs there) and what is kvtier's hooks.
    ("connector", "ttft.ttft_miss_forward_ratio", None, False),
    ("connector", "ttft.ttft_miss_kvtier_fraction", None, False),
    # Each tier's hit against its floor: vLLM's own prefix-cache hit plus one plain move of the bytes.
    *[("connector", f"hit_floor_ratio.{tier}", target, False) for tier, target in HIT_FLOOR_TARGETS.items()],
    ("gpu", "copy_ratio", 0.9, True),  # only where a CUDA device is
    ("storage", "disk_index.first_answer_s", 1.0, False),
    ("storage", "disk_index.index_bytes_per_chunk", 200.0, False),
    # Written by `kvtier bench serve` (not part of make bench), kept in the same file.
    ("serve", "throughput_ratio_vs_prefix_cache", 2.0, True),
    ("serve", "throughput_ratio_vs_ceiling", 0.95, True),
]


def _get(data: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def _quiet(fn: Any, *args: Any) -> Any:
    """fn's result; what it prints on stdout is dropped (the figures land in the JSON)."""
    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*args)


def run_all(skip_ttft: bool = False) -> dict[str, Any]:
    """Run the storage, service, connector and GPU copy benchmarks; return {section: figures}.

    Each section says on stderr when it starts and how long it took (the connector's, with its
    engines, takes the longest)."""
    from kvtier.bench import connector, gpu_copy, service, storage

    results: dict[str, Any] = {"measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    sections = "storage, service, connector" + ("" if skip_ttft else " (with TTFT)") + ", gpu"
    with step(f"make bench: 4 sections ({sections})"):
        with step("[1/4] storage: disk, Redis and arena against plain I/O"):
            results["storage"] = _quiet(storage.run, [])
        with step("[2/4] service: lookup and commit latency against an echo server"):
            results["service"] = service.measure(8, 625, 2, "256MiB")
        what = "copy and scheduler" + ("" if skip_ttft else " and TTFT, many vLLM engines")
        with step(f"[3/4] connector: {what}"):
            results["connector"] = _quiet(connector.run, ["--skip-ttft"] if skip_ttft else [])
        with step("[4/4] gpu: block copies (where a CUDA device is)"):
            results["gpu"] = gpu_copy.measure()
    return results


def headlines(results: dict[str, Any]) -> list[Headline]:
    """The headline figures present in results, in HEADLINES' order, with their targets."""
    found = []
    for section, key, target, higher in HEADLINES:
        value = _get(results.get(section, {}), key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            found.append(Headline(f"{section}.{key}", value, target, higher))
    return found


def table(results: dict[str, Any]) -> str:
    """The headline ratios with their targets."""
    lines = [f"{'figure':<44}{'value':>10}{'target':>10}  met"]
    for h in headlines(results):
        met = {None: "", True: "yes", False: "NO"}[h.met]
        lines.append(f"{h.name:<44}{h.value:>10}{h.target_text:>10}  {met}")
    return "\n".join(lines)


def write_chart(results: dict[str, Any], path: Path) -> Path | None:
    """Chart each headline figure against its target into path; None where matplotlib is missing."""
    when = results.get("measured_at", "")
    title = "make bench: each figure against its target" + (f" (measured {when})" if when else "")
    return targets_chart(headlines(results), path, title)


def merge_results(previous: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    """results over the sections of an earlier file: `kvtier bench serve`, `kill` and others write
    their own sections into the same file, and a run keeps every section it did not measure."""
    return {**{key: value for key, value in previous.items() if key not in results}, **results}


def main(argv: list[str] | None = None) -> int:
    """Entry point of `make bench` / `python -m kvtier.bench.all`."""
    parser = argparse.ArgumentParser(prog="python -m kvtier.bench.all", description=__doc__)
    parser.add_argument("--skip-ttft", action="store_true", help="skip the TTFT part (slow)")
    parser.add_argument("--out", default=str(RESULTS), help=f"where to write the JSON (default: ./{RESULTS})")
    parser.add_argument(
        "--chart",
        default=None,
        help="where to draw the chart (PNG; default: the JSON's path with .png, ./kvtier-bench.png)",
    )
    parser.add_argument("--no-chart", action="store_true", help="print the table only")
    args = parser.parse_args(argv)
    results = run_all(args.skip_ttft)
    out = Path(args.out)
    previous = json.loads(out.read_text()) if out.exists() else {}
    merged = merge_results(previous, results)
    out.write_text(json.dumps(merged, indent=2) + "\n")
    print(table(merged))
    print(f"\nwrote {out}")
    if not args.no_chart:
        write_chart(merged, Path(args.chart) if args.chart else out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
