"""Suite-wide fixtures: real Redis servers, a leak check after every test (no kvtier process,
socket or arena file may outlive the test that made it), and for every end-to-end test, the check
that the connector's degraded mode caught no error of kvtier's own."""

from collections.abc import Iterator

import pytest

from kvtier.connector import faults
from tests.support.leak_check import kvtier_leak_session, leak_check, no_kvtier_leaks  # noqa: F401

pytest_plugins = ["tests.support.redis_fixtures", "tests.support.object_fixtures"]


@pytest.fixture(autouse=True)
def degraded_mode_caught_no_bug(request: pytest.FixtureRequest) -> Iterator[None]:
    """An e2e test fails when the connector, in this process, turned a kvtier bug into a miss."""
    faults.forget()
    yield
    if request.node.get_closest_marker("e2e") is not None:
        assert faults.unexpected_errors() == [], "the connector caught errors of kvtier's own"
