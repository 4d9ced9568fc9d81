"""wsync-tcp: weights over TCP. A transport is the moving of bytes: this file says how to listen,
accept and connect; ``wsync_core.stream`` frames, authenticates, queues and watches the peers."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from wsync_core import (Capabilities, ReceiverContext, SenderContext, Transport, TransportError, free_port,
                        hookimpl)
from wsync_core.stream import Listener, StreamReceiver, StreamSender
from wsync_core.transport import flag, number

__all__ = ["TcpTransport", "__version__"]
__version__ = "0.1.0"

_WILDCARDS = {"", "0.0.0.0", "::", "*"}


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _fast(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # acks go out at once
    return sock


class _Sender(StreamSender):
    def __init__(self, options: dict[str, Any], ctx: SenderContext) -> None:
        self.address = (options["host"], options["port"])
        super().__init__(f"tcp sender on {options['host']}:{options['port']}", ctx,
                         authkey=_key(options), heartbeat=options["heartbeat"])

    def listen(self) -> socket.socket:
        try:
            return socket.create_server(self.address, family=_family(self.address[0]), backlog=128)
        except OSError as exc:
            raise TransportError(f"{self.what}: cannot listen: {exc} (is another sender using this port? "
                                 f"pass port=<a free port>)") from None

    def accept(self, listener: Listener) -> socket.socket:
        sock = listener.accept()[0]
        assert isinstance(sock, socket.socket)  # listener is the socket listen() made
        return _fast(sock)


class _Receiver(StreamReceiver):
    def __init__(self, options: dict[str, Any], ctx: ReceiverContext) -> None:
        self.address = (options["advertise"], options["port"])
        super().__init__(f"tcp worker {ctx.worker_idx} of {options['advertise']}:{options['port']}", ctx,
                         authkey=_key(options), heartbeat=options["heartbeat"])

    def connect(self, timeout: float) -> socket.socket:
        return _fast(socket.create_connection(self.address, timeout=timeout))


def _key(options: dict[str, Any]) -> bytes | None:
    return None if options["authkey"] is None else options["authkey"].encode()


class TcpTransport(Transport):
    """Weights over TCP: the sender listens, each worker connects (from any host that reaches it).

    Options: ``host`` (where the sender listens; default 127.0.0.1, loopback only), ``port``
    (default: a port free on ``host`` now, so pickled copies meet there; a worker started on its
    own needs it explicitly), ``advertise`` (the address workers connect to; default ``host``),
    ``authkey`` (a shared secret: every peer must prove it holds it), ``heartbeat`` (seconds of
    silence before a peer counts as gone; default 10), ``checksum`` (XXH3-64 checksums of every payload,
    default True).
    """

    name = "tcp"
    interface = 2
    capabilities = Capabilities(processes=True, multi_host=True, async_send=True, subset_send=True,
                                late_join=True, auth=True, sender_restart=True)
    secret_options = ("authkey",)

    @staticmethod
    def auth_options(good: bool) -> dict[str, Any]:
        """The conformance suite's hook (``wsync conformance tcp`` runs it): with ``good``, the
        authkey the sender and its workers share; else one a stranger guessed."""
        return {"authkey": "the-shared-secret-of-the-suite" if good else "a-guess-at-the-secret"}

    @staticmethod
    def multi_host_options(host_address: str) -> dict[str, Any]:
        """The conformance suite's hook: options for a sender that listens on ``host_address`` (its
        address on a bridge to another network namespace)."""
        return {"host": host_address, "heartbeat": 2.0}  # a cut link, longer than it: dropped, then reconnected

    def __init__(self, *, host: str = "127.0.0.1", port: int | None = None, advertise: str | None = None,
                 authkey: str | None = None, heartbeat: float = 10.0, checksum: bool = True) -> None:
        advertise = host if advertise is None else advertise
        if not isinstance(host, str) or not isinstance(advertise, str):
            raise TypeError(f"tcp options host and advertise must be strings, got {host!r} and {advertise!r}")
        if advertise in _WILDCARDS:
            raise ValueError(f"tcp: workers cannot connect to {advertise!r}; pass advertise=<this host's address> "
                             f"(host={host!r} is where the sender listens)")
        port = free_port(host) if port is None else number("tcp option port", port, 1, 65535, integer=True)
        if authkey is not None and (not isinstance(authkey, str) or not authkey):
            raise ValueError("tcp option authkey must be a non-empty string")
        super().__init__(host=host, port=port, advertise=advertise, authkey=authkey,
                         heartbeat=number("tcp option heartbeat (seconds)", heartbeat, 0.5, 3600),
                         checksum=flag("tcp option checksum", checksum))

    def sender(self, ctx: SenderContext) -> _Sender:
        return _Sender(self.options, ctx)

    def receiver(self, ctx: ReceiverContext) -> _Receiver:
        return _Receiver(self.options, ctx)


@hookimpl
def wsync_register_transports(register: Callable[[type], None]) -> None:
    register(TcpTransport)
