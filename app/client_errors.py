"""What a ServiceClient call fails with (re-exported by kvtier.app.client): one hierarchy, caught at
whichever level the caller can act on."""

from __future__ import annotations

from kvtier.app import protocol as p


class ServiceError(Exception):
    """Base of every error a client call can fail with."""


class ServiceUnavailable(ServiceError):
    """The service cannot be reached now (not connected, connection lost, reconnecting)."""


class ClientClosed(ServiceUnavailable):
    """The client was closed, or is used in a process it was not created in (after fork)."""


class CallTimeout(ServiceError, TimeoutError):
    """The service did not answer within the call's timeout."""


class RemoteError(ServiceError):
    """The service refused the call; ``code`` is one of protocol.ErrorCode."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class StaleInstance(RemoteError):
    """Slots named in the call belong to an earlier service instance (the service restarted)."""


class AuthFailed(RemoteError):
    """The service wants a different auth token (or a different protocol version)."""


def remote_error(reply: p.ErrorReply) -> RemoteError:
    """The typed exception for an ErrorReply."""
    if reply.code == p.ErrorCode.STALE_INSTANCE:
        return StaleInstance(reply.code, reply.message)
    if reply.code in (p.ErrorCode.AUTH, p.ErrorCode.VERSION):
        return AuthFailed(reply.code, reply.message)
    return RemoteError(reply.code, reply.message)
