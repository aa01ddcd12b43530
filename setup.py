"""Package discovery for the one import name, kvtier, over the repository's top-level folders.

pyproject.toml maps each top-level folder to `kvtier.<folder>` (`package-dir`); this finds every
subpackage beneath them, so a new one ships without editing a list (docs/architecture.md, "Packages").
"""

import tomllib
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent


def kvtier_packages() -> list[str]:
    """Every package under the folders pyproject.toml maps, named as it imports (kvtier.<folder>...)."""
    mapped = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    names = []
    for name, folder in mapped.items():
        names.append(name)
        names.extend(f"{name}.{sub}" for sub in find_packages(str(ROOT / folder)))
    return sorted(names)


setup(packages=kvtier_packages())
