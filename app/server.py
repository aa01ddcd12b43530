"""The kvtier service process: `kvtier serve` and `python -m kvtier.app.server` (the embedded child).

Who owns what: ``run_service`` owns the store, the listening socket (and its file), the admin server
and the state file, and releases each of them on every path: SIGTERM/SIGINT, a parent that went away
(embedded mode), or a failure while starting. Request handling lives in ``kvtier.app.service``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import stat
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from kvtier.app.address import Address, bind_private, parse_url, resolve_url
from kvtier.app.connection import Connection
from kvtier.app.daemon import PARENT_SIGNAL, ParentWatch, detach, report_ready
from kvtier.app.file_channel import FileServer, channel_path
from kvtier.app.logs import LogStream, resolve_format, secrets_of, setup_logging
from kvtier.app.service import Service
from kvtier.app.settings import KVTierSettings, SettingsError, load_settings, log_ignored_env
from kvtier.runtime.affinity import parse_cpus, run_on
from kvtier.runtime.event_loop import new_event_loop
from kvtier.storage.base import StorageError, StoreAPI, TierListener
from kvtier.storage.keys import disk_relpath

if TYPE_CHECKING:
    from kvtier.app.admin import AdminServer
    from kvtier.app.events import EventRecorder
    from kvtier.app.events_publisher import EventPublisher

log = logging.getLogger("kvtier.server")

WATCHDOG_PERIOD_S = 0.5


class StoreFactory(Protocol):
    """Builds the service's store; listener (KV events) is passed only when events are on."""

    async def __call__(self, settings: KVTierSettings, listener: TierListener | None = None) -> StoreAPI:
        """The store for these settings."""


class ServeError(Exception):
    """The service cannot start: address in use, refused configuration, store failure."""


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """How one service process runs, beyond KVTierSettings."""

    url: str
    drain_timeout: float = 5.0
    grace: float = 2.0
    parent_pid: int = 0  # embedded: exit once this parent is gone and no client is connected
    parent: ParentWatch | None = None  # embedded: watches parent_pid (made before detaching)
    ready_fd: int = -1  # detached: where to report that the service serves
    state_file: str = ""  # embedded: where to record pid, url and arena for the next spawner
    log_stream: LogStream = "stderr"  # embedded: the stream vLLM logs to, so the lines interleave


async def _default_store(settings: KVTierSettings, listener: TierListener | None = None) -> StoreAPI:
    from kvtier.app.settings import storage_config
    from kvtier.storage.store import build_store  # imported late: storage pulls in the tier clients

    return await build_store(storage_config(settings), listener=listener)


def _start_events(settings: KVTierSettings) -> tuple[EventPublisher, EventRecorder] | None:
    """The KV-event publisher, bound, and its recorder, which has announced a fresh start
    (AllBlocksCleared); None when events_url is empty (no socket at all)."""
    if not settings.events_url:
        return None
    import zmq  # imported late: no zmq in a service without events

    from kvtier.app.events import EventRecorder
    from kvtier.app.events_publisher import EventPublisher

    publisher = EventPublisher(
        settings.events_url,
        settings.events_replay_url,
        topic=settings.events_topic,
        connect=settings.events_connect,
    )
    try:
        publisher.start()
    except zmq.ZMQError as exc:
        raise ServeError(
            f"cannot bind KV events on events_url={settings.events_url} "
            f"events_replay_url={settings.events_replay_url} (KVTIER_EVENTS_URL, "
            f"KVTIER_EVENTS_REPLAY_URL): {exc}"
        ) from exc
    recorder = EventRecorder(publisher.publish, settings.events_hash_format)
    recorder.cleared_all()  # what this node announced before its restart is void
    return publisher, recorder


def check_bind(address: Address, settings: KVTierSettings) -> None:
    """Refuse a non-loopback TCP bind without an auth token."""
    if address.scheme == "tcp" and not address.is_loopback and not settings.auth_token:
        raise ServeError(
            f"refusing to listen on {address.url}: a non-loopback TCP address needs "
            "KVTIER_AUTH_TOKEN (auth_token) so clients must authenticate"
        )


def _owns_file(path: str, inode: int) -> bool:
    try:
        return os.lstat(path).st_ino == inode
    except OSError:
        return False


def _unix_socket(path: str) -> socket.socket:
    """A bound unix socket at path, mode 0600, after removing a stale socket file there."""
    existing = Path(path)
    if existing.exists() or existing.is_symlink():
        info = existing.lstat()
        if not stat.S_ISSOCK(info.st_mode):
            raise ServeError(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            existing.unlink(missing_ok=True)  # nobody accepts there: a dead service's socket
        else:
            raise ServeError(f"another service is already listening on unix://{path}")
        finally:
            probe.close()
    existing.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        bind_private(sock, path)  # no other thread runs yet
        os.chmod(path, 0o600)
        sock.listen(512)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


async def listen(service: Service, address: Address) -> tuple[asyncio.Server, int]:
    """Start accepting connections at address; also returns the socket file's inode (0 for TCP)."""
    loop = asyncio.get_running_loop()
    if address.scheme == "unix":
        sock = _unix_socket(address.path)
        inode = os.lstat(address.path).st_ino
        try:
            server = await loop.create_unix_server(lambda: Connection(service), sock=sock)
        except BaseException:
            sock.close()
            if _owns_file(address.path, inode):
                os.unlink(address.path)
            raise
        return server, inode
    server = await loop.create_server(
        lambda: Connection(service), address.host, address.port, reuse_address=True, backlog=512
    )
    for sock in server.sockets:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return server, 0


async def _watchdog(service: Service, parent: ParentWatch, stop: asyncio.Event, poke: asyncio.Event) -> None:
    """Embedded mode: stop once the parent is gone and no client is connected."""
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(poke.wait(), WATCHDOG_PERIOD_S)
        poke.clear()
        if parent.gone() and service.connection_count == 0:
            log.info("parent %d is gone and no client is connected: stopping", parent.pid)
            stop.set()


def _write_state(path: str, data: dict[str, object]) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _remove_state(path: str) -> None:
    """Remove the state file if it is still ours (a successor may have written its own)."""
    try:
        with open(path, encoding="utf-8") as f:
            pid = json.load(f).get("pid")
    except (OSError, ValueError, AttributeError):
        return
    if pid == os.getpid():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


async def run_service(
    settings: KVTierSettings,
    options: ServeOptions,
    *,
    store_factory: StoreFactory = _default_store,
    stop: asyncio.Event | None = None,
    ready: Callable[[Service], None] | None = None,
) -> None:
    """Run one service until stop is set (SIGTERM/SIGINT set it when run as a process)."""
    address = parse_url(options.url)
    check_bind(address, settings)
    stop = stop or asyncio.Event()
    events = _start_events(settings)
    try:
        store = await (store_factory(settings) if events is None else store_factory(settings, events[1]))
    except BaseException:
        await _close_events(events)
        raise
    service: Service | None = None
    server: asyncio.Server | None = None
    inode = 0
    admin: AdminServer | None = None
    files = _start_files(settings, address)
    try:
        service = Service(
            store,
            auth_token=settings.auth_token,
            prestage_bytes=settings.prestage_limit,
            files=files is not None,
        )
        _attach_events(service, events)
        arena = store.arena_info()
        if options.state_file:  # before listening: whoever sees the socket may read it at once
            _write_state(options.state_file, {"pid": os.getpid(), "url": options.url, "arena": arena.path})
        server, inode = await listen(service, address)
        report_ready(options.ready_fd)
        if settings.admin_port:
            admin = await _start_admin(service, settings, embedded=bool(options.parent_pid))
        log.info(
            "serving",
            extra={
                "url": options.url,
                "instance_id": service.instance_id,
                "arena": arena.path,
                "arena_bytes": arena.size,
                "pid": os.getpid(),
                "admin": f"{settings.admin_host}:{admin.port}" if admin else "",
            },
        )
        if ready is not None:
            ready(service)
        await _serve_until(service, options, stop)
    finally:
        try:
            if files is not None:
                await asyncio.to_thread(files.close)
            await _shutdown(service, server, admin, store, (address, inode), options)
        finally:
            await _close_events(events)


def _start_files(settings: KVTierSettings, address: Address) -> FileServer | None:
    """The file channel beside a unix socket, when the disk tier is on and engines may read it."""
    if address.scheme != "unix" or not settings.disk_path or not settings.disk_direct_reads:
        return None
    root = os.path.join(settings.disk_path, "")
    try:
        return FileServer(
            channel_path(address.path), lambda key: root + disk_relpath(key), settings.auth_token
        )
    except OSError as exc:
        log.warning("disk files are not served to engines (%s): the service reads disk hits", exc)
        return None


def _attach_events(service: Service, events: tuple[EventPublisher, EventRecorder] | None) -> None:
    """Let the events name the namespaces the service registers, and its stats show their counts."""
    if events is not None:
        events[1].namespaces = service.specs
        service.event_stats = partial(_event_stats, *events)


def _event_stats(publisher: EventPublisher, recorder: EventRecorder) -> dict[str, int]:
    """The KV events' counts in the service's stats."""
    return {"dropped": publisher.dropped, "undescribed": recorder.undescribed}


async def _close_events(events: tuple[EventPublisher, EventRecorder] | None) -> None:
    """Send what the store's close announced, then close the sockets."""
    if events is not None:
        events[1].flush()
        await events[0].close()


async def _start_admin(service: Service, settings: KVTierSettings, embedded: bool) -> AdminServer | None:
    """The admin HTTP server; in embedded mode a taken port only costs the admin endpoints, since
    every engine on the node would want the same configured port."""
    from kvtier.app.admin import AdminServer

    admin = AdminServer(service, settings.admin_host, settings.admin_port)
    try:
        await admin.start()
    except OSError as exc:
        if not embedded:
            raise ServeError(
                f"cannot serve admin HTTP on admin_host={settings.admin_host} "
                f"admin_port={settings.admin_port} (KVTIER_ADMIN_HOST, KVTIER_ADMIN_PORT): {exc}; "
                "pick a free port, or admin_port=0 for none"
            ) from exc
        log.error(
            "admin HTTP disabled: cannot bind %s:%d (%s)", settings.admin_host, settings.admin_port, exc
        )
        return None
    return admin


def watch_exit(loop: asyncio.AbstractEventLoop, pidfd: int, exited: Callable[[], None]) -> None:
    """Call exited() once, when the process of pidfd exits.

    A pidfd stays readable after the exit: a reader left registered would run on every turn of the
    loop for as long as clients keep the service up."""

    def once() -> None:
        loop.remove_reader(pidfd)
        exited()

    loop.add_reader(pidfd, once)


async def _serve_until(service: Service, options: ServeOptions, stop: asyncio.Event) -> None:
    poke = asyncio.Event()
    watchdog = None
    parent = options.parent
    if parent is not None:
        watchdog = asyncio.get_running_loop().create_task(_watchdog(service, parent, stop, poke))
        if parent.fd >= 0:
            watch_exit(asyncio.get_running_loop(), parent.fd, poke.set)
        else:
            _install(PARENT_SIGNAL, poke.set)
    try:
        await stop.wait()
    finally:
        if watchdog is not None:
            watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watchdog
        if parent is not None and parent.fd >= 0:
            asyncio.get_running_loop().remove_reader(parent.fd)


async def _shutdown(
    service: Service | None,
    server: asyncio.Server | None,
    admin: AdminServer | None,
    store: StoreAPI,
    bound: tuple[Address, int],
    options: ServeOptions,
) -> None:
    """Stop accepting, drain calls, close clients, drain writes, remove socket, arena and state."""
    arena_path = ""
    with contextlib.suppress(Exception):
        arena_path = store.arena_info().path
    try:
        if server is not None:
            server.close()
        address, inode = bound
        # Only our own socket file: a successor may already listen at the same path.
        if address.scheme == "unix" and _owns_file(address.path, inode):
            os.unlink(address.path)  # new clients now fail fast instead of queueing
        if service is not None:
            await service.drain(options.grace)
        if admin is not None:
            await admin.close()
    finally:
        try:
            await store.close(options.drain_timeout)
        finally:
            if arena_path:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(arena_path)
            if options.state_file:
                _remove_state(options.state_file)
            log.info("stopped", extra={"url": options.url})


def _install(sig: int, callback: Callable[[], None]) -> None:
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        asyncio.get_running_loop().add_signal_handler(sig, callback)


async def _main_async(settings: KVTierSettings, options: ServeOptions, early: list[int]) -> None:
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        _install(sig, stop.set)
    if early:  # a signal came while starting up: start, then stop right away so cleanup runs
        stop.set()
    await run_service(settings, options, stop=stop)


def serve(settings: KVTierSettings, options: ServeOptions) -> int:
    """Run the service in this process until a signal; returns the exit status."""
    early: list[int] = []
    # Until the loop's handlers are in place, remember TERM/INT/parent-death instead of dying
    # with an arena file and no cleanup.
    for sig in (signal.SIGTERM, signal.SIGINT, PARENT_SIGNAL):
        signal.signal(sig, lambda signum, _frame: early.append(signum))
    if options.parent_pid and options.parent is None:
        options = dataclasses.replace(options, parent=ParentWatch(options.parent_pid))
    if options.parent is not None and options.parent.gone():
        log.info("parent %d exited before the service started", options.parent.pid)
        return 0
    _setup_logging(settings, options)
    try:
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            runner.run(_main_async(settings, options, [s for s in early if s != PARENT_SIGNAL]))
    except (ServeError, StorageError, OSError, ValueError) as exc:
        log.error("cannot serve: %s", exc)
        print(f"kvtier serve: {exc}", file=sys.stderr)
        return 1
    return 0


def _setup_logging(settings: KVTierSettings, options: ServeOptions) -> None:
    """The process's log lines: JSON for `kvtier serve`, text into vLLM's log stream for the embedded
    service (unless log_format says otherwise); then say which environment variables were ignored."""
    embedded = bool(options.parent_pid)
    setup_logging(
        settings.log_level,
        secrets_of(settings.auth_token, settings.redis_url),
        stream=sys.stdout if options.log_stream == "stdout" else sys.stderr,
        fmt=resolve_format(settings.log_format, embedded),
    )
    log_ignored_env(os.environ)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The options shared by `kvtier serve` and `python -m kvtier.app.server`."""
    parser.add_argument("--url", help="listen here instead of service_url (unix:///path, tcp://h:p)")
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=5.0,
        help="seconds to flush queued disk/Redis writes at shutdown (default 5)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=2.0,
        help="seconds in-flight calls may finish at shutdown (default 2)",
    )


def options_from_args(args: argparse.Namespace, settings: KVTierSettings) -> ServeOptions:
    """ServeOptions from parsed arguments."""
    return ServeOptions(
        url=resolve_url(settings.service_url, args.url),
        drain_timeout=args.drain_timeout,
        grace=args.grace,
        parent_pid=getattr(args, "parent_pid", 0) or 0,
        state_file=getattr(args, "state_file", "") or "",
        log_stream="stdout" if getattr(args, "log_stream", "") == "stdout" else "stderr",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m kvtier.app.server`: the process embedded mode spawns (settings come from KVTIER_*)."""
    parser = argparse.ArgumentParser(prog="python -m kvtier.app.server", description="Run a kvtier service.")
    add_serve_arguments(parser)
    parser.add_argument("--parent-pid", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--state-file", default="", help=argparse.SUPPRESS)
    parser.add_argument("--cpus", default="", help=argparse.SUPPRESS)
    parser.add_argument("--detach", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--log-stream", choices=("stdout", "stderr"), default="stderr", help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    # First, before any thread exists: the watch must see the spawner as this process's parent,
    # and the fork of detach() and the CPU set must come before threads.
    try:
        cpus = parse_cpus(args.cpus)
    except ValueError as exc:
        print(f"kvtier: invalid configuration: {exc}", file=sys.stderr)
        return 2
    run_on(cpus)  # before the fork of detach(), so both processes leave the core vLLM computes on
    parent = ParentWatch(args.parent_pid) if args.parent_pid else None
    ready_fd = detach() if args.detach and parent is not None and parent.can_detach else -1
    try:
        settings = load_settings()
        options = options_from_args(args, settings)
        options = dataclasses.replace(options, parent=parent, ready_fd=ready_fd)
        parse_url(options.url)
    except (SettingsError, ValueError, OSError) as exc:
        print(f"kvtier: invalid configuration: {exc}", file=sys.stderr)
        return 2
    return serve(settings, options)


if __name__ == "__main__":
    sys.exit(main())
