"""Service addresses: parsing ``unix:///path`` and ``tcp://host:port``; default locations."""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

# sun_path is 108 bytes on Linux including the terminating NUL.
MAX_UNIX_PATH = 107
DEFAULT_SOCKET_NAME = "kvtier.sock"


@dataclass(frozen=True, slots=True)
class Address:
    """Where a service listens: a unix socket path, or a TCP host and port."""

    scheme: str  # "unix" or "tcp"
    path: str = ""
    host: str = ""
    port: int = 0

    @property
    def url(self) -> str:
        """The address as a service URL."""
        if self.scheme == "unix":
            return f"unix://{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        """True for unix sockets and TCP on a loopback address."""
        if self.scheme == "unix":
            return True
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


def parse_url(url: str) -> Address:
    """Parse a service URL; ValueError names what is wrong."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        path = parts.path or parts.netloc
        if not path:
            raise ValueError(f"{url!r}: unix:// needs a socket path")
        if len(os.fsencode(path)) > MAX_UNIX_PATH:
            raise ValueError(f"{url!r}: socket path longer than {MAX_UNIX_PATH} bytes")
        return Address("unix", path=path)
    if parts.scheme == "tcp":
        try:
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"{url!r}: bad port ({exc})") from None
        if not parts.hostname or port is None:
            raise ValueError(f"{url!r}: tcp:// needs host and port")
        return Address("tcp", host=parts.hostname, port=port)
    raise ValueError(f"{url!r}: scheme must be unix or tcp")


def runtime_dir() -> Path:
    """kvtier's private dir for sockets and locks: $XDG_RUNTIME_DIR/kvtier or /tmp/kvtier-<uid>.

    Created mode 0700 when missing; a /tmp fallback owned by someone else is refused, since anyone
    who can write there could plant a socket that impersonates the service.
    """
    base = os.environ.get("XDG_RUNTIME_DIR", "")
    candidates = []
    if base and os.path.isdir(base):
        candidates.append(Path(base) / "kvtier")
    candidates.append(Path(f"/tmp/kvtier-{os.getuid()}"))
    for path in candidates:
        # Leave room for "<name>.sock" of embedded services (about 25 bytes).
        if len(os.fsencode(str(path))) > MAX_UNIX_PATH - 32:
            continue
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.stat()
        if info.st_uid != os.getuid():
            raise PermissionError(f"{path} is owned by uid {info.st_uid}, not by this user")
        if info.st_mode & 0o077:
            os.chmod(path, 0o700)
        return path
    raise OSError("no runtime directory short enough for a unix socket path")


def default_url() -> str:
    """The socket a service listens on when service_url is empty and no --url is given."""
    return f"unix://{runtime_dir() / DEFAULT_SOCKET_NAME}"


def resolve_url(configured: str, override: str | None = None) -> str:
    """--url, else the configured service_url, else the default socket."""
    return override or configured or default_url()


def bind_private(sock: socket.socket, path: str) -> None:
    """Bind a unix socket at path with mode 0600: the umask decides the file's mode at bind (callers
    bind before their process starts threads that create files)."""
    old = os.umask(0o177)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
