"""Suite-wide fixtures: real Redis servers, and a leak check after every test (no kvtier process,
socket or arena file may outlive the test that made it)."""

from tests.support.leak_check import kvtier_leak_session, leak_check, no_kvtier_leaks  # noqa: F401

pytest_plugins = ["tests.support.redis_fixtures"]
