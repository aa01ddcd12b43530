"""The charts of `make demo` and `make bench` are drawn from their results dicts into PNG files; without
matplotlib each chart is skipped with one line saying how to get it, and the tables print as before."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench import all as bench_all
from kvtier.bench import demo
from kvtier.bench.chart import SKIP_LINE, Headline, demo_chart, served_by, targets_chart
from kvtier.bench.progress import note, step

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# A blank figure of the charts' size is a few KB; bars, labels and a legend make it several times that.
MIN_PNG_BYTES = 20_000


def demo_results(identical: bool = True) -> dict[str, Any]:
    """What demo.summary makes of a 3-round run: a miss, two CPU hits, a disk hit after the restart."""
    rounds = [
        demo.Round(ttft_off=0.400, ttft_on=0.410, hits={"cpu": 0, "disk": 0}, same=True),
        demo.Round(ttft_off=0.480, ttft_on=0.120, hits={"cpu": 1024, "disk": 0}, same=True),
        demo.Round(ttft_off=0.560, ttft_on=0.130, hits={"cpu": 1152, "disk": 0}, same=identical),
    ]
    restart = demo.Round(ttft_off=0.560, ttft_on=0.200, hits={"cpu": 0, "disk": 1152}, same=True)
    return demo.summary(rounds, restart)


def bench_results() -> dict[str, Any]:
    """A results.json with the keys of bench.all.HEADLINES: some met, some missed, one without target."""
    return {
        "measured_at": "2026-11-27T22:26:19Z",
        "storage": {"disk": {"put_ratio": 0.597, "get_ratio": 0.9}, "arena": {"stage_ratio": 0.276}},
        "service": {"lookup_p50_ratio": 2.58, "lookup_fresh_p50_ratio": 3.04, "rss_mb": 57.3},
        "connector": {
            "copy_ratio": 0.777,
            "ttft_miss_ratio": 1.015,
            "ttft": {"ttft_miss_ratio_low95": 0.989},
        },
        "gpu": {"available": False, "reason": "no CUDA device"},
    }


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) of a PNG file, from its IHDR chunk; fails unless the file is a PNG."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG: starts {data[:8]!r}"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


@pytest.fixture
def no_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    """matplotlib cannot be imported (None in sys.modules), as where the `plot` extra is not installed."""
    for name in ("matplotlib", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)


# ------------------------------------------------------------------------------------------- demo
def test_demo_chart_draws_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The demo's chart is a PNG of real size at the path asked for (folders made), and says where."""
    path = tmp_path / "charts" / "demo.png"
    assert demo_chart(demo_results(), path) == path
    width, height = png_size(path)
    assert width > 600 and height > 300
    assert path.stat().st_size > MIN_PNG_BYTES
    assert capsys.readouterr().out == f"chart: {path}\n"


def test_demo_chart_without_matplotlib_is_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_matplotlib: None
) -> None:
    """Without matplotlib: None, the one skip line, and no file."""
    path = tmp_path / "demo.png"
    assert demo_chart(demo_results(), path) is None
    assert capsys.readouterr().out == SKIP_LINE + "\n"
    assert not path.exists()
    assert 'pip install "kvtier[plot]"' in SKIP_LINE


def test_demo_chart_refuses_no_rounds(tmp_path: Path) -> None:
    """An empty run is named as such, not drawn as an empty chart."""
    with pytest.raises(ValueError, match=r"results\['rounds'\] is empty"):
        demo_chart({"rounds": []}, tmp_path / "demo.png")


def test_demo_summary_and_report(capsys: pytest.CaptureFixture[str]) -> None:
    """summary() keeps each round's figures in ms; report() prints them and returns 0 when identical."""
    results = demo_results()
    assert results["rounds"][1] == {
        "name": "round 2",
        "ttft_off_ms": 480.0,
        "ttft_on_ms": 120.0,
        "hit_tokens": {"cpu": 1024, "disk": 0},
        "identical": True,
    }
    assert results["rounds"][-1]["name"] == "round 3 after restart"
    assert demo.report(results) == 0
    lines = capsys.readouterr().out.splitlines()
    header = "round TTFT off (ms) TTFT on (ms) speed-up cpu hits disk hits identical"
    assert lines[1].split() == header.split()
    assert lines[3].split() == ["round", "2", "480.0", "120.0", "4.00x", "1024", "0", "yes"]
    assert lines[5].split() == [
        "round",
        "3",
        "after",
        "restart",
        "560.0",
        "200.0",
        "2.80x",
        "0",
        "1152",
        "yes",
    ]
    assert lines[-1] == "every output identical to vLLM without kvtier"


def test_demo_report_fails_on_a_different_output(capsys: pytest.CaptureFixture[str]) -> None:
    """One differing output makes the exit status 1 and says so."""
    assert demo.report(demo_results(identical=False)) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "OUTPUTS DIFFER: this is a bug"
    assert out.splitlines()[4].split()[-1] == "NO"


@pytest.mark.parametrize(
    ("argv", "chart"),
    [([], demo.CHART), (["--chart", "out/x.png"], Path("out/x.png")), (["--no-chart"], None)],
)
def test_demo_main_chart_options(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], chart: Path | None
) -> None:
    """The chart goes to ./kvtier-demo.png by default, where --chart says, or nowhere with --no-chart."""
    got: list[tuple[int, int, Path | None]] = []

    def run(rounds: int, max_tokens: int, chart: Path | None) -> int:
        got.append((rounds, max_tokens, chart))
        return 0

    monkeypatch.setattr(demo, "run", run)
    assert demo.main(argv) == 0
    assert got == [(5, 24, chart)]
    assert Path("kvtier-demo.png") == demo.CHART


def test_served_by() -> None:
    """A round is a miss, a hit of one tier, or mixed."""
    assert served_by({"cpu": 0, "disk": 0}) == "miss"
    assert served_by({}) == "miss"
    assert served_by({"cpu": 0, "disk": 128}) == "disk"
    assert served_by({"cpu": 128, "disk": 128}) == "mixed"


# ------------------------------------------------------------------------------------------ bench
def test_bench_chart_draws_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The bench chart is a PNG of real size, one bar per figure with a target."""
    path = tmp_path / "results.png"
    assert bench_all.write_chart(bench_results(), path) == path
    width, height = png_size(path)
    assert width > 600 and height > 200
    assert path.stat().st_size > MIN_PNG_BYTES
    assert capsys.readouterr().out == f"chart: {path}\n"


def test_bench_chart_without_matplotlib_is_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_matplotlib: None
) -> None:
    """Without matplotlib: None, the one skip line, and no file; the table still prints."""
    path = tmp_path / "results.png"
    assert bench_all.write_chart(bench_results(), path) is None
    assert capsys.readouterr().out == SKIP_LINE + "\n"
    assert not path.exists()
    assert "storage.disk.put_ratio" in bench_all.table(bench_results())


def test_bench_chart_refuses_results_without_targets(tmp_path: Path) -> None:
    """Results with no judged figure are named as such."""
    with pytest.raises(ValueError, match="no figure with a target"):
        bench_all.write_chart({"storage": {"arena": {"stage_ratio": 0.3}}}, tmp_path / "r.png")


def test_bench_table() -> None:
    """The table lists the figures present, in HEADLINES' order, with target and verdict."""
    lines = bench_all.table(bench_results()).splitlines()
    assert lines[0].split() == ["figure", "value", "target", "met"]
    rows = [line.split() for line in lines[1:]]
    assert rows == [
        ["storage.disk.put_ratio", "0.597", ">=", "0.8", "NO"],
        ["storage.arena.stage_ratio", "0.276"],
        ["service.lookup_p50_ratio", "2.58", "<=", "3", "yes"],
        ["service.lookup_fresh_p50_ratio", "3.04", "<=", "3", "NO"],
        ["service.rss_mb", "57.3", "<=", "200", "yes"],
        ["connector.copy_ratio", "0.777", ">=", "0.7", "yes"],
        ["connector.ttft_miss_ratio", "1.015", "<=", "1.02", "yes"],
        ["connector.ttft.ttft_miss_ratio_low95", "0.989"],
    ]


def test_headline_margin() -> None:
    """A figure's margin is value / target, turned so that above 1 is met either way."""
    assert Headline("a", 1.6, 0.8, True).margin == pytest.approx(2.0)
    assert Headline("a", 2.5, 5.0, False).margin == pytest.approx(2.0)
    assert Headline("a", 10.0, 5.0, False).margin == pytest.approx(0.5)
    assert Headline("a", 10.0, 5.0, False).met is False
    assert Headline("a", 0.3, None, True).margin is None
    assert Headline("a", 0.3, None, True).met is None


def test_targets_chart_labels_every_judged_figure(tmp_path: Path) -> None:
    """A figure whose value is 0 (lower is better) is drawn too, not divided by zero."""
    heads = [Headline("x.zero", 0.0, 0.1, False), Headline("x.high", 3.0, 1.0, True)]
    path = targets_chart(heads, tmp_path / "t.png", "title")
    assert path is not None
    assert png_size(path)[0] > 600


def test_bench_main_writes_json_and_chart_next_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`make bench` writes the JSON where --out says and, by default, the chart next to it."""
    monkeypatch.setattr(bench_all, "run_all", lambda skip_ttft: bench_results())
    out = tmp_path / "results.json"
    assert bench_all.main(["--out", str(out)]) == 0
    assert json.loads(out.read_text()) == bench_results()
    png_size(tmp_path / "results.png")
    printed = capsys.readouterr().out
    assert f"wrote {out}\n" in printed and printed.endswith(f"chart: {tmp_path / 'results.png'}\n")
    assert bench_all.main(["--out", str(out), "--chart", str(tmp_path / "c" / "b.png")]) == 0
    png_size(tmp_path / "c" / "b.png")
    assert bench_all.main(["--out", str(tmp_path / "n.json"), "--no-chart"]) == 0
    assert not (tmp_path / "n.png").exists()


# --------------------------------------------------------------------------------------- progress
def test_progress_step_says_start_end_and_failure(capsys: pytest.CaptureFixture[str]) -> None:
    """A step prints a line when it starts and one with its time when it ends or fails, on stderr."""
    with step("building"):
        note("inside")
    with pytest.raises(RuntimeError, match="boom"), step("starting"):
        raise RuntimeError("boom")
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = [line.split("] ", 1)[1] for line in captured.err.splitlines()]
    assert lines[:3] == ["building ...", "inside", lines[2]]
    assert lines[2].startswith("building: done in ") and lines[2].endswith(" s")
    assert lines[3] == "starting ..."
    assert lines[4].startswith("starting: failed after ") and lines[4].endswith(" s")
    assert all(line.startswith("[") and line[9] == "]" for line in captured.err.splitlines())
