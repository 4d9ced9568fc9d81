"""wsync-unix: weights over a Unix stream socket in Linux's abstract namespace (this host only).

The same byte-stream base as wsync-tcp (``wsync_core.stream``), another socket family: this file
says how to listen, accept and connect; the base does everything else.
"""

from __future__ import annotations

import re
import secrets
import socket
from collections.abc import Callable
from typing import Any

from wsync_core import Capabilities, ReceiverContext, SenderContext, Transport, TransportError, hookimpl
from wsync_core.stream import StreamReceiver, StreamSender
from wsync_core.transport import flag, number

__all__ = ["UnixTransport", "__version__"]
__version__ = "0.1.0"

_NAME = re.compile(r"^[A-Za-z0-9._:-]{1,80}$")


def _address(options: dict[str, Any]) -> bytes:
    return b"\0wsync-unix:" + options["name"].encode()  # abstract: no file, gone with the socket


def _key(options: dict[str, Any]) -> bytes | None:
    return None if options["authkey"] is None else options["authkey"].encode()


class _Sender(StreamSender):
    def __init__(self, options: dict[str, Any], ctx: SenderContext) -> None:
        self.address = _address(options)
        super().__init__(f"unix sender @{options['name']}", ctx, authkey=_key(options),
                         heartbeat=options["heartbeat"])

    def listen(self) -> socket.socket:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(self.address)
            listener.listen(128)
        except OSError as exc:
            listener.close()
            raise TransportError(f"{self.what}: cannot listen: {exc} (is another sender using this name?)") from None
        return listener


class _Receiver(StreamReceiver):
    def __init__(self, options: dict[str, Any], ctx: ReceiverContext) -> None:
        self.address = _address(options)
        super().__init__(f"unix worker {ctx.worker_idx} of @{options['name']}", ctx, authkey=_key(options),
                         heartbeat=options["heartbeat"])

    def connect(self, timeout: float) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.address)
        except OSError:
            sock.close()
            raise
        return sock


class UnixTransport(Transport):
    """Weights between processes of one host over a Unix socket in the abstract namespace.

    Options: ``name`` (where sender and workers meet; default a new unique one, with a new random
    ``authkey``), ``authkey`` (a shared secret every peer must prove it holds; any process of this
    host's network namespace can reach an abstract socket), ``heartbeat`` (seconds of silence
    before a peer counts as gone; default 10), ``checksum`` (default False: nothing on the way
    damages bytes).
    """

    name = "unix"
    interface = 2
    capabilities = Capabilities(processes=True, async_send=True, subset_send=True, late_join=True, auth=True,
                                sender_restart=True)
    secret_options = ("authkey",)

    @staticmethod
    def auth_options(good: bool) -> dict[str, Any]:
        """The conformance suite's hook (``wsync conformance unix`` runs it): with ``good``, the
        authkey the sender and its workers share; else one a stranger guessed."""
        return {"authkey": "the-shared-secret-of-the-suite" if good else "a-guess-at-the-secret"}

    def __init__(self, *, name: str | None = None, authkey: str | None = None, heartbeat: float = 10.0,
                 checksum: bool = False) -> None:
        if name is None:
            name, authkey = f"wsync-{secrets.token_hex(8)}", secrets.token_hex(16) if authkey is None else authkey
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"unix option name must be 1-80 characters of A-Z a-z 0-9 . _ : -, got {name!r}")
        if authkey is not None and (not isinstance(authkey, str) or not authkey):
            raise ValueError("unix option authkey must be a non-empty string")
        super().__init__(name=name, authkey=authkey, heartbeat=number("unix option heartbeat (seconds)", heartbeat,
                                                                       0.5, 3600),
                         checksum=flag("unix option checksum", checksum))

    def sender(self, ctx: SenderContext) -> _Sender:
        return _Sender(self.options, ctx)

    def receiver(self, ctx: ReceiverContext) -> _Receiver:
        return _Receiver(self.options, ctx)


@hookimpl
def wsync_register_transports(register: Callable[[type], None]) -> None:
    register(UnixTransport)
