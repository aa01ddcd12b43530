"""The package's layers point one way and no modules of a package import each other in a circle:
the import contracts in pyproject.toml ([tool.importlinter]), checked by import-linter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_import_contracts_are_kept() -> None:
    lint_imports = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run(
        [str(lint_imports), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "6 kept, 0 broken" in done.stdout


def test_storage_imports_nothing_of_app_connector_or_the_settings_model() -> None:
    for path in (REPO / "storage").rglob("*.py"):
        text = path.read_text()
        for name in ("kvtier.app", "kvtier.connector", "pydantic", "vllm", "torch"):
            assert f"import {name}" not in text and f"from {name}" not in text, (path, name)


def test_the_tools_run_from_a_bare_checkout() -> None:
    """On a machine where kvtier is not installed (a device machine), importing tools maps
    kvtier.<folder> to the checkout's folders under the names the editable install gives them."""
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); import tools, kvtier.runtime.mounts as m; "
        "print(m.__name__, m.__file__)"
    )
    # -S: no site-packages, so no editable install of kvtier (nor anything else) is found.
    done = subprocess.run(
        [sys.executable, "-S", "-c", probe, str(REPO)], cwd="/", capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["kvtier.runtime.mounts", str(REPO / "runtime" / "mounts.py")]
