"""pytest fixtures for real Redis servers.

Register from the root conftest with ``pytest_plugins = ["tests.support.redis_fixtures"]``.

Tests that need a server skip (not fail) when redis-server is not installed. Every fixture stops its
processes in a finally block, so a failing test leaves nothing running.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.support.redis_server import RedisClusterServers, RedisServer, have_redis_server

TEST_PASSWORD = "kvtier-test-secret"


def _need_redis() -> None:
    if have_redis_server():
        return
    # `make test` installs redis-server; in CI a missing one is a broken install, not a reason to skip.
    if os.environ.get("CI"):
        pytest.fail("redis-server is not installed (make test installs it through apt)")
    pytest.skip("redis-server is not installed")


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """A redis-server shared by the tests of one module (flush between tests if it matters)."""
    _need_redis()
    server = RedisServer()
    try:
        yield server.start()
    finally:
        server.cleanup()


@pytest.fixture
def redis_server_fn() -> Iterator[RedisServer]:
    """A redis-server of this test alone (kill/restart it freely)."""
    _need_redis()
    server = RedisServer()
    try:
        yield server.start()
    finally:
        server.cleanup()


@pytest.fixture(scope="module")
def redis_server_auth() -> Iterator[RedisServer]:
    """A redis-server that requires TEST_PASSWORD."""
    _need_redis()
    server = RedisServer(password=TEST_PASSWORD)
    try:
        yield server.start()
    finally:
        server.cleanup()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterServers]:
    """A 3-primary Redis Cluster shared by the session."""
    _need_redis()
    cluster = RedisClusterServers(3)
    try:
        yield cluster.start()
    finally:
        cluster.cleanup()
