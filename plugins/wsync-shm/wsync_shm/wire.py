"""The control channel: length-prefixed frames over a Unix stream socket. Nothing is pickled.

Receiver -> sender: HELLO(worker), ACK(generation taken, ack bytes).
Sender -> receiver: WELCOME(token), DELIVER(slot, generation, header bytes), REFUSE(reason).
Payloads never cross the socket; they stay in the slot files.
"""

from __future__ import annotations

import os
import socket
import struct

from wsync_core import TransportError

__all__ = [
    "HELLO", "ACK", "WELCOME", "DELIVER", "REFUSE",
    "frame", "FrameReader", "address", "peer_pid", "check_peer", "send_some",
]

HELLO, ACK, WELCOME, DELIVER, REFUSE = b"H"[0], b"A"[0], b"W"[0], b"D"[0], b"R"[0]
_PREFIX = struct.Struct("<IB")  # body length, kind
_CRED = struct.Struct("3i")  # pid, uid, gid


def frame(kind: int, body: bytes = b"") -> bytes:
    """One frame: 4-byte little-endian body length, 1 kind byte, body."""
    return _PREFIX.pack(len(body), kind) + body


class FrameReader:
    """Reassembles frames from a byte stream; refuses any frame whose body exceeds ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """Add received bytes; return the frames now complete. Raises TransportError on an oversized frame."""
        self._buf += data
        frames = []
        pos = 0
        buf = self._buf
        while len(buf) - pos >= _PREFIX.size:
            length, kind = _PREFIX.unpack_from(buf, pos)
            if length > self.limit:
                raise TransportError(f"peer sent a frame of {length} bytes; the limit is {self.limit}")
            end = pos + _PREFIX.size + length
            if len(buf) < end:
                break
            frames.append((kind, bytes(buf[pos + _PREFIX.size:end])))
            pos = end
        if pos:
            del buf[:pos]
        return frames


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
