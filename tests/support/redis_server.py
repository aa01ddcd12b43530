"""Real redis-server processes for tests and benchmarks: single servers and Redis Clusters.

Every process is started on a free loopback port with persistence off, waited for until it answers,
and stopped on every path: the objects are context managers, and an atexit hook kills any process a
crashed test left behind. Nothing here needs redis-py (readiness is checked with a raw PING).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvtier.bench.children import track, untrack
from kvtier.bench.ports import free_port as any_free_port

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")


def have_redis_server() -> bool:
    """True when redis-server (and redis-cli, for clusters) are installed."""
    return REDIS_SERVER is not None and REDIS_CLI is not None


def free_port(bus_offset: int | None = None) -> int:
    """A loopback TCP port that is free now (and port+bus_offset too, for a cluster node's bus)."""
    for _ in range(100):
        port = any_free_port()
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


def _reply_end(data: bytes, start: int = 0) -> int | None:
    """Index just past the one complete RESP2 reply that starts at ``start``, or None if incomplete."""
    line_end = data.find(b"\r\n", start)
    if line_end < 0:
        return None
    kind, head = data[start : start + 1], data[start + 1 : line_end]
    pos = line_end + 2
    if kind in (b"+", b"-", b":"):
        return pos
    if kind == b"$":
        size = int(head)
        end = pos + size + 2
        return pos if size < 0 else (end if len(data) >= end else None)
    if kind == b"*":
        for _ in range(max(0, int(head))):
            next_pos = _reply_end(data, pos)
            if next_pos is None:
                return None
            pos = next_pos
        return pos
    raise ValueError(f"not a RESP2 reply: {data[start : start + 20]!r}")


def _command(
    port: int,
    *args: str,
    password: str | None = None,
    timeout: float = 1.0,
    tls: TlsFiles | None = None,
) -> bytes:
    """Send one command (after AUTH when password is set) and return its whole reply's raw bytes.

    Returns what arrived by the deadline if the reply is still incomplete then."""
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
        while time.monotonic() < deadline:
            starts = [0]
            for _ in parts:
                end = _reply_end(data, starts[-1])
                if end is None:
                    break
                starts.append(end)
            if len(starts) == len(parts) + 1:
                return data[starts[-2] :]
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        return data[_reply_end(data) or 0 :] if len(parts) > 1 else data


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
        node_timeout_ms: int = 2000,
        tls: TlsFiles | None = None,
    ) -> None:
        if REDIS_SERVER is None:
            raise RuntimeError("redis-server is not installed")
        self.cluster = cluster
        self.node_timeout_ms = node_timeout_ms
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
                "--cluster-node-timeout", str(self.node_timeout_ms),
            ]  # fmt: skip
        return argv + list(self.extra_args)

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers PING."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.proc = subprocess.Popen(
            self._argv(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL
        )
        track(self.proc)
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

    def text(self, *args: str, timeout: float = 2.0) -> str:
        """One command whose reply is a bulk string (INFO, CLUSTER NODES), decoded."""
        reply = self.command(*args, timeout=timeout)
        if not reply.startswith(b"$"):
            raise RuntimeError(f"{' '.join(args)} on port {self.port} answered {reply[:200]!r}")
        return reply.split(b"\r\n", 1)[1][:-2].decode()

    def info(self, section: str) -> dict[str, str]:
        """INFO <section> as a dict (or CLUSTER INFO, with section 'cluster-state')."""
        args = ("CLUSTER", "INFO") if section == "cluster-state" else ("INFO", section)
        lines = self.text(*args).splitlines()
        return dict(line.split(":", 1) for line in lines if ":" in line and not line.startswith("#"))

    @property
    def alive(self) -> bool:
        """True while the process runs."""
        return self.proc is not None and self.proc.poll() is None

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
            untrack(proc)

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


@dataclass(frozen=True)
class ClusterNodeView:
    """One line of CLUSTER NODES: a node's id, port, role, its primary's id, failure flag and slots."""

    node_id: str
    port: int
    primary: bool
    primary_id: str | None
    failed: bool
    slots: tuple[tuple[int, int], ...]


def parse_cluster_nodes(text: str) -> list[ClusterNodeView]:
    """Parse CLUSTER NODES output (importing/migrating slot entries are left out)."""
    views = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 8:
            continue
        flags = fields[2].split(",")
        ranges = []
        for item in fields[8:]:
            if item.startswith("["):
                continue
            first, _, last = item.partition("-")
            ranges.append((int(first), int(last or first)))
        views.append(
            ClusterNodeView(
                node_id=fields[0],
                port=int(fields[1].split("@")[0].rsplit(":", 1)[1]),
                primary="master" in flags,
                primary_id=None if fields[3] == "-" else fields[3],
                failed="fail" in flags,  # "fail?" (suspected by one node) does not count
                slots=tuple(ranges),
            )
        )
    return views


def _wait(check: Callable[[], bool], timeout: float, what: str, detail: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout}s: {detail()}")
        time.sleep(0.05)


class RedisClusterServers:
    """A Redis Cluster on loopback ports: ``primaries`` primaries with ``replicas`` replicas each.

    ``node_timeout_ms`` is the cluster's failure-detection time: a killed primary's replica is
    promoted about one to two node timeouts after the kill. With ``full_coverage`` off, the other
    shards keep serving while some slots have no live primary (Redis's default: every node answers
    CLUSTERDOWN until they have one again).
    """

    def __init__(
        self, primaries: int = 3, replicas: int = 0, node_timeout_ms: int = 2000, full_coverage: bool = True
    ) -> None:
        if not have_redis_server():
            raise RuntimeError("redis-server and redis-cli are needed for a cluster")
        self.nodes: list[RedisServer] = []
        self.primaries = primaries
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.full_coverage = full_coverage
        self._replicas_at_kill: dict[int, list[int]] = {}
        self._hung: set[int] = set()

    @property
    def url(self) -> str:
        """Seed URL in kvtier's cluster form."""
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self, timeout: float = 30.0) -> RedisClusterServers:
        """Start the nodes, join them with redis-cli --cluster create, wait until every node says
        cluster_state:ok and every replica has copied its primary."""
        # Replicas sync at once (no 5 s wait for more replicas to share a diskless transfer), and
        # one may take over however long its primary has been gone (tests hold failovers back).
        args = ("--repl-diskless-sync-delay", "0", "--cluster-replica-validity-factor", "0",
                "--cluster-require-full-coverage", "yes" if self.full_coverage else "no")  # fmt: skip
        try:
            for _ in range(self.primaries * (1 + self.replicas)):
                node = RedisServer(cluster=True, node_timeout_ms=self.node_timeout_ms, extra_args=args)
                self.nodes.append(node.start())
            addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
            subprocess.run(
                [str(REDIS_CLI), "--cluster", "create", *addrs, "--cluster-replicas",
                 str(self.replicas), "--cluster-yes"],
                check=True, capture_output=True, timeout=timeout,
            )  # fmt: skip
            self.wait_ok(timeout)
            self.wait_synced(timeout)
        except BaseException:
            self.cleanup()
            raise
        return self

    @property
    def live_nodes(self) -> list[RedisServer]:
        """The nodes whose process runs and answers (neither killed nor hung)."""
        return [n for n in self.nodes if n.alive and n.port not in self._hung]

    def node(self, port: int) -> RedisServer:
        """The node listening on port."""
        return next(n for n in self.nodes if n.port == port)

    def topology(self) -> list[ClusterNodeView]:
        """The cluster as the first live node sees it."""
        return parse_cluster_nodes(self.live_nodes[0].text("CLUSTER", "NODES"))

    def primary_nodes(self) -> list[RedisServer]:
        """The live nodes that serve slots now, as the first live node sees it."""
        return [self.node(v.port) for v in self.topology() if v.primary and v.slots and not v.failed]

    def replicas_of(self, primary: RedisServer) -> list[RedisServer]:
        """The nodes that replicate primary now."""
        views = self.topology()
        pid = next(v.node_id for v in views if v.port == primary.port)
        return [self.node(v.port) for v in views if v.primary_id == pid]

    def primary_for_key(self, key: str) -> RedisServer:
        """The node that serves key's slot now."""
        reply = self.live_nodes[0].command("CLUSTER", "KEYSLOT", key)
        slot = int(reply.strip(b":\r\n"))
        for view in self.topology():
            if view.primary and not view.failed and any(a <= slot <= b for a, b in view.slots):
                return self.node(view.port)
        raise LookupError(f"no live primary serves slot {slot} of {key!r}")

    def move_slot(self, key: str, to: RedisServer) -> None:
        """Move key's slot, and every key in it, to primary ``to`` (as a resharding does): clients
        that still send the slot's keys to the old primary get MOVED replies."""
        source = self.primary_for_key(key)
        slot = self.live_nodes[0].command("CLUSTER", "KEYSLOT", key).strip(b":\r\n").decode()
        ids = {v.port: v.node_id for v in self.topology()}
        steps = [
            (to, ("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source.port])),
            (source, ("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[to.port])),
        ]
        for node, args in steps:
            if node.command(*args) != b"+OK\r\n":
                raise RuntimeError(f"{' '.join(args)} on port {node.port} failed")
        reply = source.command("CLUSTER", "GETKEYSINSLOT", slot, "1000")
        keys = [k.decode() for k in reply.split(b"\r\n")[2::2]]  # *N, then $len / name pairs
        if keys:
            migrate = ("MIGRATE", "127.0.0.1", str(to.port), "", "0", "5000", "KEYS", *keys)
            if source.command(*migrate, timeout=10) != b"+OK\r\n":
                raise RuntimeError(f"MIGRATE of slot {slot} to port {to.port} failed")
        for node in [to, source, *(n for n in self.live_nodes if n not in (to, source))]:
            node.command("CLUSTER", "SETSLOT", slot, "NODE", ids[to.port])
        _wait(lambda: self.primary_for_key(key) is to, 10, f"slot {slot} did not move", self._describe)

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Wait until every live node reports cluster_state:ok and knows every node."""

        def ok() -> bool:
            infos = [n.info("cluster-state") for n in self.live_nodes]
            return all(
                i.get("cluster_state") == "ok" and i.get("cluster_known_nodes") == str(len(self.nodes))
                for i in infos
            )

        _wait(ok, timeout, "cluster did not reach cluster_state:ok", self._describe)

    def wait_synced(self, timeout: float = 30.0) -> None:
        """Wait until every replica is online and at its primary's replication offset."""

        def synced() -> bool:
            views = self.topology()
            for view in views:
                if not view.primary or view.failed or not view.slots:
                    continue
                want = sum(1 for v in views if v.primary_id == view.node_id and not v.failed)
                info = self.node(view.port).info("replication")
                links = [info.get(f"slave{i}", "") for i in range(want)]
                offset = f"offset={info.get('master_repl_offset')},"
                if info.get("connected_slaves") != str(want):
                    return False
                if not all("state=online" in link and offset in link for link in links):
                    return False
            return True

        _wait(synced, timeout, "replicas did not catch up", self._describe)

    def kill(self, node: RedisServer) -> None:
        """SIGKILL a node (remembering its replicas, for wait_failover)."""
        self._replicas_at_kill[node.port] = [r.port for r in self.replicas_of(node)]
        node.kill()

    def hang(self, node: RedisServer) -> None:
        """SIGSTOP a node: its connections accept and never answer (cleanup kills it)."""
        self._replicas_at_kill[node.port] = [r.port for r in self.replicas_of(node)]
        assert node.proc is not None
        self._hung.add(node.port)
        node.proc.send_signal(signal.SIGSTOP)

    def allow_failover(self, replica: RedisServer, allowed: bool) -> None:
        """Let a replica take over its failed primary, or hold it back (cluster-replica-no-failover)."""
        reply = replica.command("CONFIG", "SET", "cluster-replica-no-failover", "no" if allowed else "yes")
        if reply != b"+OK\r\n":
            raise RuntimeError(f"CONFIG SET on port {replica.port} answered {reply!r}")

    def wait_failed(self, dead: RedisServer, cluster_state: str, timeout: float = 30.0) -> None:
        """Wait until every live node flags the dead one as failed and reports cluster_state."""

        def failed() -> bool:
            for node in self.live_nodes:
                views = {v.port: v for v in parse_cluster_nodes(node.text("CLUSTER", "NODES"))}
                if not views[dead.port].failed:
                    return False
                if node.info("cluster-state")["cluster_state"] != cluster_state:
                    return False
            return True

        _wait(failed, timeout, f"port {dead.port} was not flagged failed", self._describe)

    def wait_failover(self, dead: RedisServer, timeout: float = 30.0) -> RedisServer:
        """Wait until a replica of the killed primary serves its slots, every live node sees the
        dead one as failed and slotless, and says cluster_state:ok; returns the promoted node."""
        candidates = self._replicas_at_kill[dead.port]

        def promoted() -> bool:
            for node in self.live_nodes:
                views = {v.port: v for v in parse_cluster_nodes(node.text("CLUSTER", "NODES"))}
                gone = views[dead.port]
                if not gone.failed or gone.slots or node.info("cluster-state")["cluster_state"] != "ok":
                    return False
                if not any(views[p].primary and views[p].slots for p in candidates):
                    return False
            return True

        _wait(promoted, timeout, f"no replica of port {dead.port} was promoted", self._describe)
        views = self.topology()
        return next(self.node(v.port) for v in views if v.port in candidates and v.primary and v.slots)

    def _describe(self) -> str:
        try:
            return self.live_nodes[0].text("CLUSTER", "NODES")
        except (OSError, RuntimeError, IndexError) as exc:
            return f"(no topology: {exc!r})"

    def cleanup(self) -> None:
        """Stop every node and remove their directories."""
        for node in self.nodes:
            if node.port in self._hung:
                node.kill()  # a stopped process would sit on SIGTERM until the grace period ends
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
