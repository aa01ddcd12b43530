"""The `kvtier` command line: serve, stats, clear, config, bench and --version.

Every command loads and validates the settings first, so an invalid configuration exits with status 2
and a message naming the key before anything is started. Tables show sizes in binary units
(`2.0 GiB`); `--json` prints the raw numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import ByteSize

from kvtier.app.settings import (
    KVTierSettings,
    SettingsError,
    describe,
    ignored_env,
    load_settings_with_sources,
)
from kvtier.storage.base import Tier

if TYPE_CHECKING:
    from kvtier.app.client import ServiceClient

# Benchmarks: name -> (module, one-line help). Each module exposes `main(argv: list[str]) -> int`
# and is imported only when run. The connector's benchmark registers itself here under "connector".
BENCHES: dict[str, tuple[str, str]] = {
    "storage": ("kvtier.bench.storage", "tier throughput against memcpy, file I/O, redis-py and obstore"),
    "service": ("kvtier.bench.service", "service round trips against a bare unix-socket echo"),
    "connector": ("kvtier.bench.connector", "TTFT with kvtier hits against recompute"),
    "gpu": ("kvtier.bench.gpu_copy", "GPU <-> arena block copies against cudaMemcpy (CUDA only)"),
    "serve": ("kvtier.bench.serve", "vllm bench serve: prefix cache alone, with kvtier, and its ceiling"),
    "kill": ("kvtier.bench.serve_kill", "vllm bench serve with the embedded service killed mid-run"),
    "signing": ("kvtier.bench.signing", "a shared tier's MAC against the checksum (--ttft: on a hit's TTFT)"),
    "scale": ("kvtier.bench.scale", "costs against tier size (1k-1M chunks) and connections (1-64)"),
}


TIER_NAMES = tuple(t.label for t in Tier)
_BINARY_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")
# `kvtier stats` tier table: stats key, column title, shown as a size.
_TIER_COLUMNS = (
    ("chunks", "chunks", False),
    ("bytes", "bytes", True),
    ("capacity", "capacity", True),
    ("hits", "hits", False),
    ("stores", "stores", False),
    ("evictions", "evictions", False),
    ("errors", "errors", False),
    ("bytes_read", "read", True),
    ("bytes_written", "written", True),
)
_SUMMARY_KEYS = (
    ("leases_active", False),
    ("slots_in_use", False),
    ("slots_total_bytes", True),
    ("write_queue_depth", False),
    ("writes_dropped", False),
    ("writes_yielded", False),
    ("connections", False),
)


class CommandFailed(Exception):
    """A command's error, phrased for the operator (empty: already printed); code is the exit status."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code

    def report(self) -> int:
        """Print the message on stderr and return the exit status."""
        if str(self):
            print(str(self), file=sys.stderr)
        return self.code


def format_bytes(n: float) -> str:
    """A byte count in binary units with one decimal (`512.0 MiB`, `2.0 GiB`); below 1 KiB, `N B`."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    value = float(n)
    for unit in _BINARY_UNITS:
        value /= 1024
        if abs(round(value, 1)) < 1024 or unit == _BINARY_UNITS[-1]:
            break
    return f"{value:.1f} {unit}"


def _cell(value: Any, size: bool) -> str:
    return format_bytes(value) if size and isinstance(value, int | float) else str(value)


def version_text() -> str:
    """What `kvtier --version` prints: kvtier's version, the wire protocol's and Python's."""
    from kvtier.app.metrics import CHECKOUT_ROOT, CHECKOUT_SUFFIX, UNKNOWN_VERSION, kvtier_version
    from kvtier.app.protocol import PROTOCOL_VERSION

    version = kvtier_version()
    about = f"protocol {PROTOCOL_VERSION}, Python {platform.python_version()}"
    if version.endswith(CHECKOUT_SUFFIX):
        about += f"; not installed: version read from {CHECKOUT_ROOT / 'pyproject.toml'}"
    elif version == UNKNOWN_VERSION:
        about += "; not installed and no pyproject.toml beside it: version unknown"
    return f"kvtier {version} ({about})"


class _VersionAction(argparse.Action):
    """--version: version_text() as is (argparse's own action rewraps it), read only when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(version_text())
        parser.exit(0)


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
    ignored = ignored_env(os.environ)
    if ignored:  # on stderr: --json stays one object
        names = ", ".join(ignored)
        print(
            f"kvtier config: ignored Kubernetes service-link variables (not settings): {names}",
            file=sys.stderr,
        )
    table = describe(settings, sources)
    if args.json:
        print(json.dumps(table, indent=2, sort_keys=True))
        return 0
    sizes = {name for name, field in KVTierSettings.model_fields.items() if field.annotation is ByteSize}
    width = max(len(name) for name in table)
    for name, row in table.items():
        value = _cell(row["value"], name in sizes)
        print(f"{name:<{width}}  {value:<40}  ({row['source']})")
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


@contextlib.contextmanager
def _service(command: str, args: argparse.Namespace) -> Iterator[ServiceClient]:
    """A client of the service at --url (or service_url); a failed call becomes CommandFailed
    with exit status 1, bad settings or a bad address with 2."""
    from kvtier.app.address import resolve_url
    from kvtier.app.client import ServiceClient, ServiceError

    settings = _settings()
    if settings is None:
        raise CommandFailed("", 2)
    try:
        url = resolve_url(settings.service_url, args.url)
        client = ServiceClient(url, settings.auth_token, timeout=args.timeout)
    except (ValueError, OSError) as exc:
        raise CommandFailed(f"kvtier {command}: {exc}", 2) from None
    try:
        yield client
    except (ServiceError, TimeoutError) as exc:
        where = "" if url in str(exc) else f"{url}: "
        raise CommandFailed(f"kvtier {command}: {where}{exc}", 1) from None
    finally:
        client.close()


def _cmd_stats(args: argparse.Namespace) -> int:
    try:
        with _service("stats", args) as client:
            stats = client.stats().result(timeout=args.timeout + 1.0)
    except CommandFailed as exc:
        return exc.report()
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
    else:
        _print_stats(stats)
    return 0


def _print_stats(stats: dict[str, Any]) -> None:
    print(f"{'tier':<8}" + "".join(f"{title:>11}" for _, title, _ in _TIER_COLUMNS) + "  state")
    for name, tier in stats.get("tiers", {}).items():
        state = "up" if tier.get("healthy", True) else "down"
        cells = "".join(f"{_cell(tier.get(key, 0), size):>11}" for key, _, size in _TIER_COLUMNS)
        print(f"{name:<8}{cells}  {state}")
    for key, size in _SUMMARY_KEYS:
        print(f"{key:<18} {_cell(stats.get(key, 0), size)}")
    _print_engines(stats.get("engines") or [])
    _print_namespaces(stats.get("namespace_specs") or {})


def _print_namespaces(specs: dict[str, dict[str, Any]]) -> None:
    """One line per registered namespace: what a router names in POST /lookup, and whose KV it is."""
    print(f"{'namespaces':<18} {len(specs)}")
    for ns, spec in specs.items():
        rank = spec.get("tp_rank", "?")
        # tp_rank -1: KV alike on every tensor-parallel rank (MLA), one namespace all ranks load.
        rank_text = "all" if rank == -1 else str(rank)
        print(
            f"  {ns}  tp {rank_text}/{spec.get('tp_size', '?')}  block {spec.get('block_size', '?')}"
            f"  chunk {spec.get('chunk_size', '?')}  {spec.get('model', '?')}"
        )


def _print_engines(engines: list[dict[str, Any]]) -> None:
    """One line per connected connector: its engine, its role, and whether it serves (or why not)."""
    print(f"{'engines':<18} {len(engines)}")
    for engine in engines:
        state = "active" if engine.get("active") else f"idle: {engine.get('reason') or 'no reason given'}"
        print(f"  {engine.get('engine_id', '?')}  {engine.get('role', '?'):<9}  {state}")


def tier_list(text: str) -> list[str]:
    """The argparse type of `clear --tier`: one tier name or a comma list of them."""
    names = [part.strip().lower() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in TIER_NAMES]
    if unknown or not names:
        what = f"unknown tier {unknown[0]!r}" if unknown else "no tier named"
        raise argparse.ArgumentTypeError(f"{what}; allowed: {', '.join(TIER_NAMES)}")
    return names


def _cmd_clear(args: argparse.Namespace) -> int:
    asked = {name for group in args.tier or [] for name in group}
    tiers = [tier for tier in Tier if tier.label in asked] if asked else list(Tier)
    wait = args.timeout + 1.0
    try:
        with _service("clear", args) as client:
            held = set(client.stats().result(timeout=wait).get("tiers", {}))
            dropped = client.clear(tiers).result(timeout=wait)
    except CommandFailed as exc:
        return exc.report()
    cleared = [t.label for t in tiers if t.label in held]
    absent = [t.label for t in tiers if t.label not in held]
    if args.json:
        print(json.dumps({"dropped": dropped, "tiers": cleared, "absent": absent}, sort_keys=True))
        return 0
    print(f"dropped {dropped} chunks from {', '.join(cleared) or 'no tier'}")
    if absent:
        print(f"kvtier clear: the service has no {' or '.join(absent)} tier", file=sys.stderr)
    return 0


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


def _add_clear(sub: argparse._SubParsersAction) -> None:
    clear = sub.add_parser(
        "clear",
        help="drop the chunks a running service holds (all tiers, or those named)",
        description=(
            "Drop every chunk of the named tiers (default: all) from a running service and print how"
            " many were dropped. Chunks leased by a lookup whose load is pending are kept. A Redis"
            " tier or an object tier's bucket prefix shared by other services is cleared for them too."
        ),
    )
    clear.add_argument(
        "--tier",
        action="append",
        type=tier_list,
        metavar="TIER",
        help=f"a tier to clear, {', '.join(TIER_NAMES)}: repeat it or give a comma list (default: all)",
    )
    clear.add_argument("--url", help="service address (default: service_url or the default socket)")
    clear.add_argument("--json", action="store_true", help="print one JSON object")
    # Clearing Redis scans its keys, clearing the object tier LISTs its prefix: allow more than a
    # stats call needs.
    clear.add_argument("--timeout", type=float, default=30.0, help="seconds to wait (default 30)")
    clear.set_defaults(func=_cmd_clear)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser(
        "bench",
        help="run a benchmark (figures as ratios to a reference measured in the same run)",
        description="Run a benchmark; `kvtier bench NAME --help` shows its options.",
        epilog="The CUDA copy path's device check is a developer's tool: from a checkout of kvtier, "
        '`python -m tools.gpu_check` (README.md, "On a GPU").',
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
    parser.add_argument("--version", action=_VersionAction, help="print kvtier's version and exit")
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
    _add_clear(sub)
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
