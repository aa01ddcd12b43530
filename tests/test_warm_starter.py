"""The warm starter of the tests' engine processes (tests/support/warm.py): each job is a process of its
own with the environment, folder, arguments and streams it was given, and its exit status is its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.processes import exits
from tests.support.warm import REPO, WarmProcess, WarmStarter

JOB = """
import os, sys, time
print("argv", sys.argv[1:], "cwd", os.getcwd(), "env", os.environ.get("WARM_TEST"), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if sys.argv[1] == "fail":
    raise RuntimeError("the job failed")
if sys.argv[1] == "sleep":
    print("sid", os.getsid(0) == os.getpid(), flush=True)
    time.sleep(600)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def starter() -> Iterator[WarmStarter]:
    warm = WarmStarter(preload=("json",), sys_path=[str(REPO)])
    try:
        yield warm
    finally:
        warm.close()


def _run(
    starter: WarmStarter, folder: Path, *args: str, new_session: bool = False
) -> tuple[WarmProcess, Path, Path]:
    (folder / "warm_job.py").write_text(JOB)
    out, err = folder / "out", folder / "err"
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = starter.start(
            "warm_job", args, env={**os.environ, "WARM_TEST": "given"}, cwd=folder,
            stdout=o.fileno(), stderr=e.fileno(), new_session=new_session,
        )  # fmt: skip
    return proc, out, err


def test_a_job_gets_its_arguments_folder_environment_and_streams_and_its_exit_status(
    starter: WarmStarter, tmp_path: Path
) -> None:
    proc, out, err = _run(starter, tmp_path, "3")
    assert proc.wait(60) == 3 and proc.poll() == 3 and proc.returncode == 3
    assert out.read_text() == f"argv ['3'] cwd {tmp_path} env given\n"
    assert err.read_text() == "to stderr\n"
    assert proc.pid != os.getpid() and os.getppid() != proc.pid


def test_a_job_that_raises_exits_1_with_its_traceback_and_the_starter_serves_on(
    starter: WarmStarter, tmp_path: Path
) -> None:
    proc, _out, err = _run(starter, tmp_path, "fail")
    assert proc.wait(60) == 1
    assert "RuntimeError: the job failed" in err.read_text()
    again, _out, _err = _run(starter, tmp_path, "0")
    assert again.wait(60) == 0


def test_a_killed_job_reports_its_signal_and_a_session_of_its_own(
    starter: WarmStarter, tmp_path: Path
) -> None:
    (tmp_path / "warm_job.py").write_text(JOB)
    read_end, write_end = os.pipe()
    try:
        proc = starter.start(
            "warm_job", ["sleep"], env=dict(os.environ), cwd=tmp_path,
            stdout=write_end, stderr=write_end, new_session=True,
        )  # fmt: skip
    finally:
        os.close(write_end)
    with open(read_end, "rb") as out:
        lines = [out.readline(), out.readline(), out.readline()]  # it has printed, and now sleeps
        assert lines[2] == b"sid True\n", lines
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0)
        assert proc.poll() is None
        os.killpg(proc.pid, signal.SIGKILL)  # its own group, as the OpenAI server tests stop theirs
        assert proc.wait(60) == -signal.SIGKILL


def test_the_starter_exits_when_its_owner_is_gone(tmp_path: Path) -> None:
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from tests.support.warm import WarmStarter;"
        "w = WarmStarter(preload=('json',), sys_path=[sys.argv[1]]); w.wait_ready(); print(w.pid, flush=True)"
    )
    with tempfile.TemporaryFile() as out:
        subprocess.run([sys.executable, "-c", code, str(REPO)], stdout=out, check=True, timeout=60)
        out.seek(0)
        pid = int(out.read())
    assert exits(pid, 30), "the starter outlived the process that started it"
