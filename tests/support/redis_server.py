"""Real redis-server processes for tests and benchmarks: single servers and a 3-node cluster.

Every process is started on a free loopback port with persistence off, waited for until it answers,
and stopped on every path: the objects are context managers, and an atexit hook kills any process a
crashed test left behind. Nothing here needs redis-py (readiness is checked with a raw PING).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
_LIVE: set[subprocess.Popen[bytes]] = set()


def have_redis_server() -> bool:
    """True when redis-server (and redis-cli, for clusters) are installed."""
    return REDIS_SERVER is not None and REDIS_CLI is not None


def free_port(bus_offset: int | None = None) -> int:
    """A loopback TCP port that is free now (and port+bus_offset too, for a cluster node's bus)."""
    for _ in range(100):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if bus_offset is None:
            return port
        if port + bus_offset < 65536 and _port_free(port + bus_offset):
            return port
    raise RuntimeError("no free loopback port found")


def _port_free(port: int, reuse: bool = False) -> bool:
    with socket.socket() as sock:
        if reuse:  # redis-server binds with SO_REUSEADDR, so TIME_WAIT leftovers do not block it
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass(frozen=True)
class TlsFiles:
    """A throwaway CA and a server certificate for 127.0.0.1 signed by it."""

    ca: str
    cert: str
    key: str


def make_tls_files(directory: str) -> TlsFiles:
    """Create a CA and a 127.0.0.1 server certificate with the openssl command (about 0.1 s)."""
    d = Path(directory)
    names = ("ca.crt", "ca.key", "srv.crt", "srv.key", "srv.csr")
    ca, ca_key, cert, key, csr = (str(d / n) for n in names)
    ext = d / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=kvtier-test-ca",
        "-keyout", ca_key, "-out", ca)  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", key, "-out", csr)
    run("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-days", "2",
        "-extfile", str(ext), "-out", cert)  # fmt: skip
    return TlsFiles(ca=ca, cert=cert, key=key)


def _connect(port: int, timeout: float, tls: TlsFiles | None) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    if tls is None:
        return sock
    context = ssl.create_default_context(cafile=tls.ca)
    return context.wrap_socket(sock, server_hostname="127.0.0.1")


def _command(
    port: int,
    *args: str,
    password: str | None = None,
    timeout: float = 1.0,
    tls: TlsFiles | None = None,
) -> bytes:
    """Send one command (after AUTH when password is set) and return the first reply's raw bytes."""
    parts = [("AUTH", password), args] if password else [args]
    with _connect(port, timeout, tls) as sock:
        payload = b""
        for cmd in parts:
            payload += b"*%d\r\n" % len(cmd) + b"".join(
                b"$%d\r\n%s\r\n" % (len(a.encode()), a.encode()) for a in cmd
            )
        sock.sendall(payload)
        data = b""
        deadline = time.monotonic() + timeout
        want = len(parts)
        while data.count(b"\r\n") < want and time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        return data.split(b"\r\n", want - 1)[-1] if want > 1 else data


def _kill_all() -> None:
    for proc in list(_LIVE):
        with contextlib.suppress(OSError):
            proc.kill()
        with contextlib.suppress(Exception):
            proc.wait(timeout=5)
        _LIVE.discard(proc)


atexit.register(_kill_all)


class RedisServer:
    """One redis-server on 127.0.0.1:port; restartable on the same port after stop() or kill()."""

    def __init__(
        self,
        port: int | None = None,
        *,
        password: str | None = None,
        extra_args: tuple[str, ...] = (),
        workdir: str | None = None,
        cluster: bool = False,
        tls: TlsFiles | None = None,
    ) -> None:
        if REDIS_SERVER is None:
            raise RuntimeError("redis-server is not installed")
        self.cluster = cluster
        self.tls = tls
        self.port = port or free_port(10000 if cluster else None)
        self.password = password
        self.extra_args = extra_args
        self._own_dir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix=f"kvtier-redis-{self.port}-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """redis:// (rediss:// with TLS) URL of this server, with the password when one is set."""
        auth = f":{self.password}@" if self.password else ""
        if self.tls is not None:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls.ca}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def _argv(self) -> list[str]:
        ports = ["--port", str(self.port)]
        if self.tls is not None:
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", self.tls.cert,
                     "--tls-key-file", self.tls.key, "--tls-ca-cert-file", self.tls.ca,
                     "--tls-auth-clients", "no"]  # fmt: skip
        argv = [
            str(REDIS_SERVER), *ports, "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--daemonize", "no",
            "--dir", self.workdir, "--logfile", os.path.join(self.workdir, "redis.log"),
            "--protected-mode", "no",
        ]  # fmt: skip
        if self.password:
            argv += ["--requirepass", self.password]
        if self.cluster:
            argv += [
                "--cluster-enabled", "yes",
                "--cluster-config-file", os.path.join(self.workdir, "nodes.conf"),
                "--cluster-node-timeout", "2000",
            ]  # fmt: skip
        return argv + list(self.extra_args)

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers PING."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.proc = subprocess.Popen(
            self._argv(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL
        )
        _LIVE.add(self.proc)
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.kill()
            raise
        return self

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Poll with PING until the server answers (a NOAUTH answer counts: it is up)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"redis-server on port {self.port} exited: {self.log_tail()}")
            try:
                reply = _command(self.port, "PING", timeout=0.5, tls=self.tls)
            except OSError:  # ssl.SSLError is an OSError too
                reply = b""
            if reply.startswith((b"+PONG", b"-NOAUTH")):
                return
            time.sleep(0.02)
        raise TimeoutError(f"redis-server on port {self.port} did not answer within {timeout}s")

    def command(self, *args: str, timeout: float = 2.0) -> bytes:
        """One command to the server (authenticated), raw reply bytes; for test set-up."""
        return _command(self.port, *args, password=self.password, timeout=timeout, tls=self.tls)

    def log_tail(self, lines: int = 20) -> str:
        """Last lines of the server's log, for error messages."""
        path = Path(self.workdir) / "redis.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL the server (a crash, for fault tests) and reap it."""
        self._end(signal.SIGKILL)

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM the server, SIGKILL after timeout; idempotent."""
        self._end(signal.SIGTERM, timeout)

    def _end(self, sig: int, timeout: float = 5.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            if proc.poll() is None:
                proc.send_signal(sig)
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=timeout)
        finally:
            _LIVE.discard(proc)

    def restart(self, timeout: float = 10.0) -> RedisServer:
        """Start again on the same port (after kill() or stop())."""
        self.stop()
        deadline = time.monotonic() + timeout
        while not _port_free(self.port, reuse=True) and time.monotonic() < deadline:
            time.sleep(0.05)  # the old socket may linger for a moment
        return self.start(timeout)

    def cleanup(self) -> None:
        """Stop the server and remove its work directory."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


class RedisClusterServers:
    """A Redis Cluster of ``nodes`` primaries (no replicas) on loopback ports."""

    def __init__(self, nodes: int = 3) -> None:
        if not have_redis_server():
            raise RuntimeError("redis-server and redis-cli are needed for a cluster")
        self.nodes: list[RedisServer] = []
        self.size = nodes

    @property
    def url(self) -> str:
        """Seed URL in kvtier's cluster form."""
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self, timeout: float = 30.0) -> RedisClusterServers:
        """Start the nodes, join them with redis-cli --cluster create, wait for cluster_state:ok."""
        try:
            for _ in range(self.size):
                self.nodes.append(RedisServer(cluster=True).start())
            addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
            subprocess.run(
                [str(REDIS_CLI), "--cluster", "create", *addrs, "--cluster-replicas", "0",
                 "--cluster-yes"],
                check=True, capture_output=True, timeout=timeout,
            )  # fmt: skip
            self.wait_ok(timeout)
        except BaseException:
            self.cleanup()
            raise
        return self

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Wait until every node reports cluster_state:ok."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(b"cluster_state:ok" in n.command("CLUSTER", "INFO") for n in self.nodes):
                return
            time.sleep(0.1)
        raise TimeoutError("cluster did not reach cluster_state:ok")

    def cleanup(self) -> None:
        """Stop every node and remove their directories."""
        for node in self.nodes:
            node.cleanup()
        self.nodes.clear()

    def __enter__(self) -> RedisClusterServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


@contextlib.contextmanager
def redis_server(password: str | None = None) -> Iterator[RedisServer]:
    """A started server, stopped and cleaned up when the block ends (however it ends)."""
    server = RedisServer(password=password)
    try:
        yield server.start()
    finally:
        server.cleanup()
