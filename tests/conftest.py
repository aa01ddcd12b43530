"""Suite-wide fixtures: real Redis servers, and a leak check after every test (no kvtier process,
socket or arena file may outlive the test that made it)."""

from tests.support.leak_check import kvtier_leak_session, leak_check, no_kvtier_leaks  # noqa: F401

pytest_plugins = ["tests.support.redis_fixtures"]

# tests/reliability is issue 7's fault-injection suite. It is not part of `make test` yet: it found
# product bugs that are still open (late reserve replies leak slots, vLLM's shutdown SIGKILLs the
# embedded service, a standalone restart within 10 s keeps the dead arena, admissions after a failed
# lookup are not counted, admin bind errors do not name the setting, and deferred lookups starve the
# OpenAI server under load). Run it with `.venv/bin/python -m pytest tests/reliability`; move each
# module back into the suite as its bugs are fixed.
collect_ignore = ["reliability"]
