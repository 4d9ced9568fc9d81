"""The errors wsync raises. Every message says what was expected and what was found."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "WsyncError",
    "StateError",
    "SchemaMismatchError",
    "WorkerTimeoutError",
    "WorkerDiedError",
    "TransportError",
    "UnknownTransportError",
]


class WsyncError(Exception):
    """Base of every error wsync raises on purpose."""


class StateError(WsyncError):
    """A call came out of order; the message names the call that was expected."""


class SchemaMismatchError(WsyncError):
    """Sender and receiver weights differ in keys, shapes or dtypes; the message names them."""


class WorkerTimeoutError(WsyncError):
    """Some workers did not answer in time; ``workers`` holds their indices, sorted."""

    def __init__(self, message: str, workers: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.workers: list[int] = sorted(workers)

    def __reduce__(self):  # keep .workers across pickling (e.g. from a worker process)
        return (type(self), (self.args[0], self.workers))


class WorkerDiedError(WorkerTimeoutError):
    """Some workers died before they answered; ``workers`` holds their indices, sorted, and the
    message says how each died. A WorkerTimeoutError, raised before the timeout."""


class TransportError(WsyncError):
    """The transport failed, or what it delivered is damaged or malformed."""


class UnknownTransportError(WsyncError, LookupError):
    """No installed transport has this name; the message lists the installed ones."""
