"""Suite-wide fixtures: real Redis servers (tests/support/redis_fixtures.py)."""

pytest_plugins = ["tests.support.redis_fixtures"]
