"""Developers' tools, run from a checkout and never shipped: the GPU device check (``python -m
tools.gpu_check``), research benchmarks, the unit tests' stand-in worker client. docs/architecture.md,
"Packages and layers", says what goes here rather than in ``bench/``.

Where kvtier is not installed (a bare machine lent a GPU, which reaches no package index), importing
this package maps ``kvtier.<folder>`` to the checkout's folders as the editable install does, with the
same module names, so each tool still runs with one command from the repository root.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds ``kvtier`` (a namespace package) and ``kvtier.<folder>`` in the checkout; Python's own
    finders find the modules below them through each package's path."""

    def __init__(self, folders: dict[str, Path]) -> None:
        self.folders = folders

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        """The spec of kvtier or of one of its top-level packages; None for any other name."""
        if fullname == "kvtier":
            spec = importlib.machinery.ModuleSpec("kvtier", None, is_package=True)
            spec.submodule_search_locations = []
            return spec
        folder = self.folders.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


def _map_checkout() -> None:
    """Map kvtier's packages to this checkout's folders unless kvtier is importable already."""
    if importlib.util.find_spec("kvtier") is not None:
        return
    mapped = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    sys.meta_path.append(_CheckoutFinder({name: ROOT / folder for name, folder in mapped.items()}))


_map_checkout()
