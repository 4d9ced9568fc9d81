"""The ``mp`` wire: fixed-size frame prefixes, the HMAC handshake, and sealed memfd slots.

Every message is a 24-byte prefix (magic, kind, flags, arg, body size, value) and a body of
at most a few bytes, a header or an ack; each kind has its own size limit, checked before
anything is allocated. Payload bytes never cross the socket: they live in sealed, anonymous
memfd *slots* whose descriptors travel once per receiver (SCM_RIGHTS) and that receivers map
read-only. Nothing here is ever unpickled.
"""

from __future__ import annotations

import enum
import fcntl
import hashlib
import hmac
import mmap
import os
import socket
import struct
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from wsync_core import TransportError
from wsync_core.protocol import MAX_ACK_BYTES, MAX_HEADER_BYTES

__all__ = [
    "Kind", "Frame", "FrameReader", "encode", "PREFIX", "NONCE_BYTES", "MAX_FDS",
    "mac", "make_socket", "sockaddr", "Slot", "map_slot",
]

MAGIC = b"WSMP"
PREFIX = struct.Struct("<4sBBxxIIQ")  # magic, kind, flags, arg, body size, value
NONCE_BYTES = 32
#: descriptors a receiver accepts in one read (one per new slot in a notify)
MAX_FDS = 4
#: at most this many slots per sender (a receiver refuses higher indices)
MAX_SLOTS = 1024
FLAG_FD = 1
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class Kind(enum.IntEnum):
    CHALLENGE = 1  # sender -> receiver: nonce
    RESPONSE = 2   # receiver -> sender: mac of the sender's nonce, then the receiver's nonce
    PROOF = 3      # sender -> receiver: mac of the receiver's nonce
    HELLO = 4      # receiver -> sender: arg = worker index
    NOTIFY = 5     # sender -> receiver: arg = slot, value = payload bytes, body = header, maybe an fd
    RELEASE = 6    # receiver -> sender: arg = slot, done reading it
    ACK = 7        # receiver -> sender: body = ack bytes
    CLOSE = 8      # sender -> receiver: body = reason (empty: a clean shutdown)
    SEEN = 9       # receiver -> sender: arg = slot, its notification was read (the next may follow)


#: the largest body each kind may carry
_LIMITS = {
    Kind.CHALLENGE: NONCE_BYTES, Kind.RESPONSE: 2 * NONCE_BYTES, Kind.PROOF: NONCE_BYTES, Kind.HELLO: 0,
    Kind.NOTIFY: MAX_HEADER_BYTES, Kind.RELEASE: 0, Kind.ACK: MAX_ACK_BYTES, Kind.CLOSE: 4096,
    Kind.SEEN: 0,
}


@dataclass(frozen=True)
class Frame:
    kind: Kind
    flags: int
    arg: int
    value: int
    body: bytes


def encode(kind: Kind, body: bytes = b"", *, arg: int = 0, value: int = 0, flags: int = 0) -> bytes:
    """One frame's bytes."""
    return PREFIX.pack(MAGIC, kind, flags, arg, len(body), value) + body


class FrameReader:
    """Splits a byte stream into frames, refusing unknown kinds and oversized bodies before buffering them.

    ``accept`` and ``peer`` may change between frames (``feed`` parses lazily).
    """

    def __init__(self, accept: frozenset[Kind], peer: str) -> None:
        self.accept = accept
        self.peer = peer
        self._buf = bytearray()
        self._need: tuple[int, int, int, int, int] | None = None  # kind, flags, arg, size, value

    def feed(self, data: bytes) -> Iterator[Frame]:
        """The frames completed by ``data``, one at a time; raises TransportError on a malformed stream."""
        self._buf += data
        while True:
            if self._need is None:
                if len(self._buf) < PREFIX.size:
                    return
                magic, kind, flags, arg, size, value = PREFIX.unpack_from(self._buf)
                if magic != MAGIC:
                    raise TransportError(f"{self.peer} sent a frame starting {bytes(self._buf[:4])!r}, "
                                         f"expected the wsync-mp magic {MAGIC!r}")
                if kind not in self.accept:
                    raise TransportError(f"{self.peer} sent a frame of kind {kind}, expected one of "
                                         f"{sorted(k.name for k in self.accept)}")
                if size > _LIMITS[Kind(kind)]:
                    raise TransportError(f"{self.peer} sent a {Kind(kind).name} frame of {size} bytes, "
                                         f"the limit is {_LIMITS[Kind(kind)]}")
                del self._buf[:PREFIX.size]
                self._need = (kind, flags, arg, size, value)
            kind, flags, arg, size, value = self._need
            if len(self._buf) < size:
                return
            body = bytes(self._buf[:size])
            del self._buf[:size]
            self._need = None
            yield Frame(Kind(kind), flags, arg, value, body)


def mac(authkey: bytes, role: bytes, nonce: bytes) -> bytes:
    """HMAC-SHA256 proving knowledge of ``authkey`` for ``nonce`` (``role`` keeps the two directions apart)."""
    return hmac.new(authkey, b"wsync-mp " + role + b" " + nonce, hashlib.sha256).digest()


def sockaddr(address: str) -> str | bytes:
    """The socket address for an option value: ``@name`` is Linux's abstract namespace, else a path."""
    return b"\0" + address[1:].encode() if address.startswith("@") else address


def make_socket() -> socket.socket:
    """A new AF_UNIX stream socket (close-on-exec, so spawned children do not inherit it)."""
    return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)


class Slot:
    """A sender's payload buffer: a sealed anonymous memfd of ``size`` bytes, mapped read-write."""

    def __init__(self, index: int, nbytes: int) -> None:
        self.index = index
        self.nbytes = nbytes
        size = max(nbytes, 1)  # an empty file cannot be mapped
        self.fd = os.memfd_create(f"wsync-mp-slot{index}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
            self._map = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED | _POPULATE)
        except BaseException:
            os.close(self.fd)
            raise
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)[:nbytes]

    def close(self) -> None:
        """Close the descriptor and unmap (the mapping outlives this while the core still holds the tensor)."""
        if self.fd < 0:
            return
        os.close(self.fd)
        self.fd = -1
        self.tensor = None
        try:
            self._map.close()
        except BufferError:  # the core still holds a view; the mapping goes with the last one
            pass


def map_slot(fd: int, nbytes: int, peer: str) -> tuple[mmap.mmap, torch.Tensor] | None:
    """Map a received slot read-only; None if its size is not this receiver's ``nbytes``.

    Raises TransportError if ``fd`` is not a sealed memory file (a hostile sender could
    otherwise shrink it under the reader).
    """
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        size = os.fstat(fd).st_size
    except OSError as exc:
        raise TransportError(f"{peer} passed a descriptor that is not a sealed memfd: {exc}") from None
    if seals & _SEALS != _SEALS:
        raise TransportError(f"{peer} passed a memfd without shrink/grow seals (seals {seals:#x})")
    if size != max(nbytes, 1):
        return None
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ)
    with warnings.catch_warnings():  # read-only on purpose: a receiver cannot write the sender's slot
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.frombuffer(mm, dtype=torch.uint8)[:nbytes]
    return mm, tensor


def map_private(fd: int, nbytes: int) -> torch.Tensor:
    """A new copy-on-write map of a slot checked by ``map_slot``: reads see the slot, writes stay here."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)  # keeps ``mm`` alive
