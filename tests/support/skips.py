"""The one skip policy of the suite: a test that needs infrastructure this machine may lack
(redis-server, a private mount namespace, a tool) skips, saying what is missing, except under CI=true,
where `make test` provides all of it and a missing piece is a broken install: there the test fails.

A case that cannot run in CI at all would say why in the README and skip there too; none does today.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def in_ci() -> bool:
    """Whether this run is CI's (CI=true, 1 or yes)."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def missing(what: str) -> NoReturn:
    """Skip the running test because `what` is missing here; fail it instead under CI."""
    if in_ci():
        pytest.fail(f"{what}: CI provides it, so this is a broken install, not a reason to skip")
    pytest.skip(what)
