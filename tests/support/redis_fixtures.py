"""pytest fixtures for real Redis servers.

Register from the root conftest with ``pytest_plugins = ["tests.support.redis_fixtures"]``.

Tests that need a server skip when redis-server is not installed, and fail instead when CI=true (there
a missing server is a broken install): the suite's one skip policy, tests.support.skips. Every
fixture stops its processes in a finally block, so a failing test leaves nothing running.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from tests.support.redis_server import RedisClusterServers, RedisServer, have_redis_server
from tests.support.skips import missing

TEST_PASSWORD = "kvtier-test-secret"


def need_redis() -> None:
    """Skip the test when redis-server is missing; fail it instead under CI (tests.support.skips)."""
    if not have_redis_server():
        missing("redis-server is not installed (make test installs it through apt)")


@pytest.fixture
def redis_installed() -> None:
    """need_redis() as a fixture, for tests that start their own servers."""
    need_redis()


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """A redis-server shared by the tests of one module (flush between tests if it matters)."""
    need_redis()
    server = RedisServer()
    try:
        yield server.start()
    finally:
        server.cleanup()


@pytest.fixture
def redis_server_fn() -> Iterator[RedisServer]:
    """A redis-server of this test alone (kill/restart it freely)."""
    need_redis()
    server = RedisServer()
    try:
        yield server.start()
    finally:
        server.cleanup()


@pytest.fixture(scope="module")
def redis_server_auth() -> Iterator[RedisServer]:
    """A redis-server that requires TEST_PASSWORD."""
    need_redis()
    server = RedisServer(password=TEST_PASSWORD)
    try:
        yield server.start()
    finally:
        server.cleanup()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterServers]:
    """A 3-primary Redis Cluster shared by the session."""
    need_redis()
    cluster = RedisClusterServers(3)
    try:
        yield cluster.start()
    finally:
        cluster.cleanup()


# Failure detection time of the replicated cluster: a killed primary's replica serves its slots about
# two node timeouts later. Short, so failover tests stay quick; long enough that a node busy for a
# moment on a loaded machine is not taken for dead.
FAILOVER_NODE_TIMEOUT_MS = 1000


@contextlib.contextmanager
def replicated_cluster(full_coverage: bool = True) -> Iterator[RedisClusterServers]:
    """A started cluster of 3 primaries with one replica each, cleaned up however the block ends."""
    need_redis()
    cluster = RedisClusterServers(
        3, replicas=1, node_timeout_ms=FAILOVER_NODE_TIMEOUT_MS, full_coverage=full_coverage
    )
    try:
        yield cluster.start()
    finally:
        cluster.cleanup()


@pytest.fixture
def redis_cluster_replicated() -> Iterator[RedisClusterServers]:
    """A Redis Cluster of 3 primaries with one replica each, of this test alone (kill nodes freely)."""
    with replicated_cluster() as cluster:
        yield cluster
