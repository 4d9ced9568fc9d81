"""Direct acks: each receiver's acks go to its sender over one TCP connection, not through Ray.

Through the mailbox an ack is two Ray calls (the receiver's ``ack`` to the mailbox, the
mailbox's answer to the sender's events long-poll), 2.5-7 ms each on a busy node; over a socket
it is one ``send`` and one ``recv``. Everything else (headers, object references, joins, deaths)
still rides the mailbox, and a receiver that cannot connect acks through the mailbox as before.

The sender listens on the address Ray uses for its node (receivers on other nodes reach it
there, as they reach Ray's own ports) on a port the kernel picks, and hands the address with a
random 16-byte secret to receivers through the mailbox (Ray's channel, which a ``ray`` channel
trusts already). A connection that does not open with that secret within ``HELLO_S`` seconds
is closed; an authenticated one carries length-prefixed acks of at most ``MAX_ACK_BYTES``, and
anything else closes it. Nothing received is unpickled: an ack is wsync's own bytes.

Wire format (big-endian): hello ``b"WSRA" secret(16) worker(u32) token(16)``, then frames
``length(u32) bytes``.
"""

from __future__ import annotations

import hmac
import os
import queue
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from wsync_core import TransportError, forked
from wsync_core.forked import close_inherited
from wsync_core.protocol import MAX_ACK_BYTES

__all__ = ["AckServer", "AckLink", "Hello", "AckFrame", "Closed", "HELLO_S", "MAX_CONNECTIONS"]

_MAGIC = b"WSRA"
_HELLO = struct.Struct("!4s16sI16s")
_LEN = struct.Struct("!I")
#: seconds a connection has to authenticate before it is closed
HELLO_S = 10.0
#: connections the sender keeps at once (authenticated or not); the oldest unauthenticated one
#: is closed to make room
MAX_CONNECTIONS = 4096


@dataclass(frozen=True)
class Hello:
    """A receiver authenticated: ``token`` (hex) serves ``worker`` on this connection."""

    worker: int
    token: str


@dataclass(frozen=True)
class AckFrame:
    """An ack from the receiver ``token`` serving ``worker``."""

    worker: int
    token: str
    data: bytes


@dataclass(frozen=True)
class Closed:
    """The connection of receiver ``token`` ended (it closed it, or its process died)."""

    token: str


@dataclass
class _Conn:
    sock: socket.socket
    opened: float
    buf: bytearray = field(default_factory=bytearray)
    hello: Hello | None = None


class AckServer:
    """The sender's side: a listening socket and a thread that reads every receiver's acks into
    ``inbox`` as ``Hello``, ``AckFrame`` and ``Closed`` items, in each connection's order."""

    def __init__(self, host: str, inbox: queue.SimpleQueue) -> None:
        """Listen on ``host`` (an IP address) at a port the kernel picks. Raises OSError if it cannot."""
        self.secret = os.urandom(16)
        self.inbox = inbox
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.bind((host, 0))
            self._listener.listen(128)
            self._listener.setblocking(False)
        except OSError:
            self._listener.close()
            raise
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._conns: dict[socket.socket, _Conn] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="wsync-ray-acks", daemon=True)
        self._thread.start()
        forked.watch(self)

    def forget_in_child(self) -> None:
        """A forked child lets go of its copies of the listening socket and the connections it
        accepted, so the parent's port is free once it closes."""
        close_inherited(ports=[self.address[1]])

    def close(self) -> None:
        """Stop the thread and close every socket (idempotent)."""
        if self._stop:
            return
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        for sock in [self._listener, self._wake_r, self._wake_w, *self._conns]:
            sock.close()
        self._conns.clear()
        self._sel.close()
        forked.unwatch(self)  # last: a child forked while it closed lets go of what was still open

    def _run(self) -> None:
        while not self._stop:
            for key, _ in self._sel.select(timeout=1.0):
                sock = key.fileobj
                if sock is self._listener:
                    self._accept()
                elif sock is self._wake_r:
                    return
                else:
                    assert isinstance(sock, socket.socket)  # (a connection: registered as its socket)
                    self._read(self._conns[sock])
            self._expire()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors, a connection reset before accept: try the next one
                return
            if len(self._conns) >= MAX_CONNECTIONS:
                waiting = [c for c in self._conns.values() if c.hello is None]
                if not waiting:
                    sock.close()
                    continue
                self._drop(min(waiting, key=lambda c: c.opened))
            sock.setblocking(False)
            self._conns[sock] = _Conn(sock, time.monotonic())
            self._sel.register(sock, selectors.EVENT_READ)

    def _expire(self) -> None:
        late = time.monotonic() - HELLO_S
        for conn in [c for c in self._conns.values() if c.hello is None and c.opened < late]:
            self._drop(conn)

    def _drop(self, conn: _Conn) -> None:
        self._sel.unregister(conn.sock)
        del self._conns[conn.sock]
        conn.sock.close()
        if conn.hello is not None:
            self.inbox.put(Closed(conn.hello.token))

    def _read(self, conn: _Conn) -> None:
        try:
            chunk = conn.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(conn)
            return
        conn.buf += chunk
        if conn.hello is None:
            if len(conn.buf) < _HELLO.size:
                return
            magic, secret, worker, token = _HELLO.unpack_from(conn.buf)
            if magic != _MAGIC or not hmac.compare_digest(secret, self.secret):
                self._drop(conn)
                return
            del conn.buf[:_HELLO.size]
            conn.hello = Hello(worker, token.hex())
            self.inbox.put(conn.hello)
        while len(conn.buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(conn.buf)
            if n > MAX_ACK_BYTES:
                self._drop(conn)
                return
            if len(conn.buf) < _LEN.size + n:
                return
            data = bytes(conn.buf[_LEN.size:_LEN.size + n])
            del conn.buf[:_LEN.size + n]
            self.inbox.put(AckFrame(conn.hello.worker, conn.hello.token, data))


class AckLink:
    """The receiver's side: one authenticated connection to its sender's ``AckServer``."""

    def __init__(self, address: Any, worker: int, token: str, timeout: float) -> None:
        """Connect to ``address`` (``[host, port, secret]`` as the mailbox hands it on) and say
        hello. Raises TransportError for a malformed address, OSError if the sender cannot be reached."""
        if not (isinstance(address, list) and len(address) == 3 and isinstance(address[0], str)
                and type(address[1]) is int and isinstance(address[2], bytes) and len(address[2]) == 16):
            raise TransportError(f"malformed ack address from the mailbox: {address!r:.100}")
        host, port, secret = address
        self.sock = socket.create_connection((host, port), timeout=timeout)
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock.sendall(_HELLO.pack(_MAGIC, secret, worker, bytes.fromhex(token)))
        except OSError:
            self.sock.close()
            raise
        self.sock.settimeout(timeout)
        self.port: int = self.sock.getsockname()[1]  # this end's, for a forked child to let go of
        forked.watch(self)

    def forget_in_child(self) -> None:
        """A forked child lets go of its copy of the connection, so the sender sees its end when
        the parent closes it."""
        close_inherited(ports=[self.port])

    def send(self, data: bytes) -> None:
        """Send one ack. Raises OSError if the connection is gone (the caller acks another way)."""
        self.sock.sendall(_LEN.pack(len(data)) + data)

    def close(self) -> None:
        """End the connection after the acks sent (the sender reads them, then its end)."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self.sock.close()
        forked.unwatch(self)  # last: a child forked while it closed lets go of what was still open
