"""The protocol and blob decoders under atheris: only their typed errors, whatever the bytes."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris", reason="atheris has no wheel for this platform; hypothesis covers it")

ROOT = Path(__file__).resolve().parents[2]
RUNS = 30_000
MEMORY_LIMIT = 2 << 30  # address space of the fuzzing process: a decoder that asks for more fails


def _limit_memory() -> None:
    """In the fuzzing process, before it runs: libFuzzer's own RSS limit cannot work here, because a
    child inherits its parent's peak RSS on Linux (pytest's, gigabytes once an engine ran in it),
    so the limit is on the address space instead."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


@pytest.mark.parametrize("target", ["protocol", "blob"])
def test_decoder_survives_coverage_guided_fuzzing(target: str, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "tests.fuzz.targets", target, f"-runs={RUNS}", "-max_len=4096", "-seed=1",
         "-rss_limit_mb=0", f"-artifact_prefix={tmp_path}/",
         str(corpus)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, preexec_fn=_limit_memory,
    )  # fmt: skip
    report = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, f"atheris found an input the {target} decoder fails on:\n{report}"
    assert f"Done {RUNS} runs" in report, report
    assert any(corpus.iterdir()), "atheris kept no input: it never reached new code"
