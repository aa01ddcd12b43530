"""Pass/fail bookkeeping of the compose check, and the small parsers its checks share (pure logic)."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

PREFIX = "compose-check"
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?")
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass
class Tally:
    """Every check's outcome, printed as it is recorded; the closing line counts them."""

    passed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        """Record one check; returns ok so callers may branch on it."""
        (self.passed if ok else self.failed).append(name)
        mark = "PASS" if ok else "FAIL"
        print(f"{PREFIX}: {mark} {name}" + (f": {detail}" if detail else ""), flush=True)
        return ok

    def note(self, text: str) -> None:
        """Something the reader should know that is neither a pass nor a failure."""
        self.notes.append(text)
        print(f"{PREFIX}: NOTE {text}", flush=True)

    def closing_line(self) -> str:
        """The one line CI reads: `compose-check: N passed, N failed`."""
        return f"{PREFIX}: {len(self.passed)} passed, {len(self.failed)} failed"

    def exit_code(self) -> int:
        """0 only when something passed and nothing failed."""
        return 0 if self.passed and not self.failed else 1

    def finish(self) -> int:
        """Print the failures again, then the closing line; return the exit code."""
        for name in self.failed:
            print(f"{PREFIX}: failed: {name}", flush=True)
        print(self.closing_line(), flush=True)
        sys.stdout.flush()
        return self.exit_code()


def size_bytes(text: str) -> int:
    """Bytes of a size as Docker, tmpfs and Redis write it (`1m`, `512m`, `8g`, `4gb`: powers of 1024)."""
    match = _SIZE.fullmatch(text.strip().lower())
    if not match:
        raise ValueError(f"not a size: {text!r}")
    return int(float(match[1]) * 1024 ** " kmgt".index(match[2] or " "))


def parse_env(text: str) -> dict[str, str]:
    """NAME=value lines of a dotenv file, comments and blank lines left out."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            name, _, value = line.partition("=")
            values[name.strip()] = value.strip()
    return values


def render_env(base: str, overrides: dict[str, str]) -> str:
    """A dotenv file: base with each overridden variable's value replaced, new ones appended."""
    lines, seen = [], set()
    for line in base.splitlines():
        name = line.partition("=")[0].strip()
        if not line.lstrip().startswith("#") and "=" in line and name in overrides:
            lines.append(f"{name}={overrides[name]}")
            seen.add(name)
        else:
            lines.append(line)
    lines += [f"{name}={value}" for name, value in overrides.items() if name not in seen]
    return "\n".join(lines) + "\n"


def metric_samples(text: str) -> Iterable[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample in a Prometheus text exposition."""
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match:
            try:
                value = float(match["value"])
            except ValueError:
                continue
            yield match["name"], dict(_LABEL.findall(match["labels"] or "")), value


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include the given ones (0 when absent)."""
    return sum(
        value
        for sample, have, value in metric_samples(text)
        if sample == name and all(have.get(k) == v for k, v in labels.items())
    )


def compose_duration(text: str) -> float:
    """Seconds of a compose duration (`1m30s`, `15s`, `500ms`, `20m`)."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", text)
    if not parts or "".join(a + b for a, b in parts) != text.strip():
        raise ValueError(f"not a duration: {text!r}")
    return sum(float(amount) * units[unit] for amount, unit in parts)
