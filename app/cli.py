"""The `kvtier` command line: serve, stats, config and bench.

Every command loads and validates the settings first, so an invalid configuration exits with status 2
and a message naming the key before anything is started.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.app.settings import KVTierSettings, SettingsError, describe, load_settings_with_sources

# Benchmarks: name -> (module, one-line help). Each module exposes `main(argv: list[str]) -> int`
# and is imported only when run. The connector's benchmark registers itself here under "connector".
BENCHES: dict[str, tuple[str, str]] = {
    "storage": ("kvtier.bench.storage", "tier throughput against memcpy, file I/O and redis-py"),
    "service": ("kvtier.bench.service", "service round trips against a bare unix-socket echo"),
    "connector": ("kvtier.bench.connector", "TTFT with kvtier hits against recompute"),
    "gpu": ("kvtier.bench.gpu_copy", "GPU <-> arena block copies against cudaMemcpy (CUDA only)"),
    "gpu-check": ("kvtier.bench.gpu_check", "correctness of the CUDA copy path (CPU part runs anywhere)"),
}


def _settings() -> KVTierSettings | None:
    try:
        return load_settings_with_sources()[0]
    except SettingsError as exc:
        print(f"kvtier: invalid configuration: {exc}", file=sys.stderr)
        return None


def _cmd_config(args: argparse.Namespace) -> int:
    try:
        settings, sources = load_settings_with_sources()
    except SettingsError as exc:
        print(f"kvtier: invalid configuration: {exc}", file=sys.stderr)
        return 2
    table = describe(settings, sources)
    if args.json:
        print(json.dumps(table, indent=2, sort_keys=True))
        return 0
    width = max(len(name) for name in table)
    for name, row in table.items():
        print(f"{name:<{width}}  {row['value']!s:<40}  ({row['source']})")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from kvtier.app.address import parse_url
    from kvtier.app.server import ServeError, check_bind, options_from_args, serve

    settings = _settings()
    if settings is None:
        return 2
    try:
        options = options_from_args(args, settings)
        check_bind(parse_url(options.url), settings)
    except (ValueError, OSError, ServeError) as exc:
        print(f"kvtier serve: {exc}", file=sys.stderr)
        return 2
    return serve(settings, options)


def _cmd_stats(args: argparse.Namespace) -> int:
    from kvtier.app.address import resolve_url
    from kvtier.app.client import ServiceClient, ServiceError

    settings = _settings()
    if settings is None:
        return 2
    try:
        url = resolve_url(settings.service_url, args.url)
        client = ServiceClient(url, settings.auth_token, timeout=args.timeout)
    except (ValueError, OSError) as exc:
        print(f"kvtier stats: {exc}", file=sys.stderr)
        return 2
    try:
        stats = client.stats().result(timeout=args.timeout + 1.0)
    except (ServiceError, TimeoutError) as exc:
        print(f"kvtier stats: {url}: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
    else:
        _print_stats(stats)
    return 0


def _print_stats(stats: dict[str, Any]) -> None:
    cols = ("chunks", "bytes", "hits", "stores", "evictions", "errors")
    print(f"{'tier':<8}" + "".join(f"{c:>14}" for c in cols) + "  state")
    for name, tier in stats.get("tiers", {}).items():
        state = "up" if tier.get("healthy", True) else "down"
        print(f"{name:<8}" + "".join(f"{tier.get(c, 0):>14}" for c in cols) + f"  {state}")
    for key in (
        "leases_active",
        "slots_in_use",
        "write_queue_depth",
        "writes_dropped",
        "connections",
    ):
        print(f"{key:<18} {stats.get(key, 0)}")
    _print_engines(stats.get("engines") or [])


def _print_engines(engines: list[dict[str, Any]]) -> None:
    """One line per connected connector: its engine, its role, and whether it serves (or why not)."""
    print(f"{'engines':<18} {len(engines)}")
    for engine in engines:
        state = "active" if engine.get("active") else f"idle: {engine.get('reason') or 'no reason given'}"
        print(f"  {engine.get('engine_id', '?')}  {engine.get('role', '?'):<9}  {state}")


def _cmd_bench(args: argparse.Namespace) -> int:
    return run_bench(args.name, list(args.args))


def run_bench(name: str, argv: list[str]) -> int:
    """Run benchmark name with its own arguments (after the settings are validated)."""
    if _settings() is None:
        return 2
    module_name = BENCHES[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        print(f"kvtier bench: {name}: not available ({module_name} is not installed)", file=sys.stderr)
        return 2
    result: int = module.main(argv)
    return result or 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser(
        "bench",
        help="run a benchmark (figures as ratios to a reference measured in the same run)",
        description="Run a benchmark; `kvtier bench NAME --help` shows its options.",
    )
    names = bench.add_subparsers(dest="name", required=True, metavar="NAME")
    for name, (_module, text) in BENCHES.items():
        one = names.add_parser(name, help=text, add_help=False)
        one.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        one.set_defaults(func=_cmd_bench)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    from kvtier.app.server import add_serve_arguments

    parser = argparse.ArgumentParser(
        prog="kvtier", description="KV-cache tiering service and tools for vLLM."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    config = sub.add_parser("config", help="print the effective settings and where each value came from")
    config.add_argument("--json", action="store_true", help="print one JSON object")
    config.set_defaults(func=_cmd_config)
    serve = sub.add_parser(
        "serve",
        help="run the kvtier service (until SIGTERM/SIGINT)",
        description="Run the kvtier service at service_url (or --url, or the default socket).",
    )
    add_serve_arguments(serve)
    serve.set_defaults(func=_cmd_serve)
    stats = sub.add_parser(
        "stats", help="print a running service's counters", description="Ask a service for stats."
    )
    stats.add_argument("--url", help="service address (default: service_url or the default socket)")
    stats.add_argument("--json", action="store_true", help="print one JSON object")
    stats.add_argument("--timeout", type=float, default=5.0, help="seconds to wait (default 5)")
    stats.set_defaults(func=_cmd_stats)
    _add_bench(sub)
    for register in EXTRA_COMMANDS:
        register(sub)
    return parser


# Other modules may add their subcommands here, each a function of the subparsers.
EXTRA_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = []


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kvtier` console script."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    # `kvtier bench NAME ...`: everything after NAME (--help included) belongs to the benchmark.
    if len(args_list) >= 2 and args_list[0] == "bench" and args_list[1] in BENCHES:
        return run_bench(args_list[1], args_list[2:])
    parser = build_parser()
    args = parser.parse_args(args_list)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
