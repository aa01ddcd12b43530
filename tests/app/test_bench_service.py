"""kvtier.bench.service's clients call the service as the connector does: a new lease per lookup, which
either ends the previous one in the same call or is followed by its release with no answer asked for
(of a lease on another prompt)."""

from __future__ import annotations

import inspect
import queue
import threading
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

import kvtier.app.client
from kvtier.bench import service as bench
from tests.app import thread_service
from tests.support.leak_check import kvtier_leak_session, leak_check, no_kvtier_leaks  # noqa: F401

REAL = kvtier.app.client.ServiceClient
LOOKUP, RELEASE = inspect.signature(REAL.lookup), inspect.signature(REAL.release)


class _Recorder(REAL):
    """A real ServiceClient whose lookup and release record the leases they name, then run.

    The recording wrappers are autospecced from ServiceClient's own methods and read the arguments
    through their signatures: a call the real method would refuse fails here too, and a renamed or
    removed parameter fails the test instead of being copied along.
    """

    calls: list[tuple[Any, ...]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        lookup, release = super().lookup, super().release

        def recorded_lookup(*a: Any, **kw: Any) -> Any:
            got = LOOKUP.bind(self, *a, **kw)
            got.apply_defaults()
            args = got.arguments
            self.calls.append(("lookup", args["lease_id"], args["replaces"], args["hashes"][0]))
            return lookup(*a, **kw)

        def recorded_release(*a: Any, **kw: Any) -> None:
            self.calls.append(("release", RELEASE.bind(self, *a, **kw).arguments["lease_id"]))
            release(*a, **kw)

        self.lookup = mock.create_autospec(lookup, side_effect=recorded_lookup)  # type: ignore[method-assign]
        self.release = mock.create_autospec(release, side_effect=recorded_release)  # type: ignore[method-assign]


def test_each_measured_lookup_takes_a_new_lease_and_ends_the_last_without_an_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kvtier.app.client, "ServiceClient", _Recorder)
    _Recorder.calls = []
    out: queue.Queue[Any] = queue.Queue()
    with thread_service(tmp_path, cpu_size="64MiB") as svc:
        plan = bench.Plan(url=svc.url, rounds=1, ops=4, warmup=2, timeout=10.0)
        bench._service_run(plan, threading.Barrier(1), out)
        assert svc.wait_for(lambda: svc.service.stats()["leases_active"] == 0)
    (rounds,) = out.get(timeout=1)
    assert len(rounds["lookup"]) == 4 and len(rounds["lookup_fresh"]) == 4
    calls = _Recorder.calls
    lookups = [c for c in calls if c[0] == "lookup"]
    leases = [c[1] for c in lookups]
    assert len(set(leases[1:])) == len(leases) - 1  # after the first, every lookup takes a new lease
    # Warmup and the lookup phase: each ends the lease before it in the same call.
    replacing = [i for i, c in enumerate(calls) if c[0] == "lookup" and c[2]]
    assert len(replacing) == 2 + 4
    for i in replacing:
        assert calls[i][2] == [c for c in calls[:i] if c[0] == "lookup"][-1][1]
    # The fresh phase: a lookup of its own, then the lease before it released unanswered.
    *fresh, last = [i for i, c in enumerate(calls) if c[0] == "release"]
    assert len(fresh) == 4
    for i in fresh:
        kind, new, replaces, prompt = calls[i - 1]
        assert kind == "lookup" and not replaces and calls[i][1] != new
        # ... of another prompt than the released lease holds: no pins move over between them.
        (released,) = [c for c in calls[:i] if c[0] == "lookup" and c[1] == calls[i][1]][-1:]
        assert released[3] != prompt
    assert last == len(calls) - 1  # the last lease, released before the client closes


@pytest.mark.parametrize("alternations", [0, -1])
def test_measure_refuses_fewer_than_one_turn_of_service_clients(alternations: int) -> None:
    with pytest.raises(ValueError, match="alternations must be at least 1"):
        bench.measure(alternations=alternations)


def test_the_command_refuses_fewer_than_one_turn_of_service_clients(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--alternations", "0"])
    assert exit_info.value.code == 2
    assert "--alternations must be at least 1, not 0" in capsys.readouterr().err
