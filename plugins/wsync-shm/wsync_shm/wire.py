"""The control channel: frames (``wsync_core.framing``) over a Unix stream socket. Nothing is pickled.

Receiver -> sender: HELLO(arg: worker, body: its scheme's origin), ACK(value: generation taken, body: ack bytes).
Sender -> receiver: WELCOME(body: token), DELIVER(arg: slot, value: generation, body: header),
REFUSE(body: reason). Payloads never cross the socket; they stay in the slot files.
"""

from __future__ import annotations

import enum
import os
import socket
import struct

from wsync_core import TransportError
from wsync_core.framing import Framing
from wsync_core.protocol import MAX_ACK_BYTES, MAX_HEADER_BYTES
from wsync_core.transport import MAX_ORIGIN_BYTES

__all__ = ["Kind", "FRAMING", "REASON_BYTES", "address", "peer_pid", "check_peer", "send_some"]

#: the longest reason a REFUSE frame carries
REASON_BYTES = 4096
_CRED = struct.Struct("3i")  # pid, uid, gid


class Kind(enum.IntEnum):
    HELLO = 1    # receiver -> sender: arg = worker, body = its scheme's origin
    ACK = 2      # receiver -> sender
    WELCOME = 3  # sender -> receiver
    DELIVER = 4  # sender -> receiver
    REFUSE = 5   # sender -> receiver
    BYE = 6      # sender -> receiver: it shuts down (a clean end: the worker says nothing of it)


FRAMING = Framing(b"WSHM", {Kind.HELLO: MAX_ORIGIN_BYTES, Kind.ACK: MAX_ACK_BYTES, Kind.WELCOME: 12,
                            Kind.DELIVER: MAX_HEADER_BYTES, Kind.REFUSE: REASON_BYTES, Kind.BYE: 0})


def address(name: str) -> bytes:
    """The abstract-namespace Unix socket address of the channel called ``name``."""
    return b"\0wsync-shm-" + name.encode()


def peer_pid(sock: socket.socket) -> int:
    """The pid of the process at the other end of a connected Unix socket."""
    return _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))[0]


def check_peer(sock: socket.socket) -> None:
    """Raise TransportError unless the peer runs as this process's user (abstract sockets have no file modes)."""
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    if uid != os.getuid():
        raise TransportError(f"peer process {pid} runs as uid {uid}, expected uid {os.getuid()}")


def send_some(sock: socket.socket, out: bytearray) -> None:
    """Send what the non-blocking ``sock`` takes now from the front of ``out``; raises OSError if it is closed."""
    while out:
        try:
            sent = sock.send(out)
        except BlockingIOError:
            return
        del out[:sent]
