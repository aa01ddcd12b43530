"""`make bench` (kvtier.bench.all) keeps the sections other benchmarks wrote into the same file."""

from __future__ import annotations

from kvtier.bench.all import merge_results


def test_a_run_replaces_what_it_measured_and_keeps_every_other_section() -> None:
    previous = {"storage": {"old": 1}, "serve": {"ratio": 2.1}, "serve_kill": {"ratio": 0.8}}
    results = {"storage": {"new": 2}, "connector": {"hit": 1.2}}
    assert merge_results(previous, results) == {
        "serve": {"ratio": 2.1},
        "serve_kill": {"ratio": 0.8},
        "storage": {"new": 2},
        "connector": {"hit": 1.2},
    }
    assert merge_results({}, results) == results
