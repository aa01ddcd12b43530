"""The product's modules stay readable: no file over 600 lines and no function over 60 lines in every
package that ships (the service, the connector, the benchmarks and their harness) and in the
developer tools of tools/ (the style guide's limits)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("app", "storage", "connector", "runtime", "bench", "tools")
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 60


def _modules() -> list[Path]:
    missing = [package for package in PACKAGES if not (REPO / package / "__init__.py").is_file()]
    assert not missing, f"no package at {missing}: PACKAGES names the folders to check"
    return sorted(path for package in PACKAGES for path in (REPO / package).rglob("*.py"))


def test_no_module_is_over_600_lines() -> None:
    long = {
        str(p.relative_to(REPO)): n
        for p in _modules()
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert long == {}


def test_no_function_is_over_60_lines() -> None:
    long: dict[str, int] = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(REPO)}:{node.lineno} {node.name}"] = lines
    assert long == {}
