"""The `kvtier` command line: serve, stats, config and bench."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from app.settings import SettingsError, describe, load_settings_with_sources


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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="kvtier", description="KV-cache tiering service and tools for vLLM."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    config = sub.add_parser(
        "config", help="print the effective settings and where each value came from"
    )
    config.add_argument("--json", action="store_true", help="print one JSON object")
    config.set_defaults(func=_cmd_config)
    for register in EXTRA_COMMANDS:
        register(sub)
    return parser


# Other modules add their subcommands here (serve, stats, bench), each a function of the subparsers.
EXTRA_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = []


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kvtier` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
