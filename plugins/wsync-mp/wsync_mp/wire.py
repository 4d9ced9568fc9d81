"""The ``mp`` wire: its frames, the HMAC handshake, and sealed memfd slots.

Every message is a frame of ``wsync_core.framing`` (a 24-byte prefix: magic, kind, flags, arg,
body size, value) and a body of at most a few bytes, a header or an ack; each kind has its own
size limit, checked before anything is allocated. Payload bytes never cross the socket: they live in sealed, anonymous
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

import torch
from wsync_core import TransportError
from wsync_core.framing import Framing
from wsync_core.memory import SEALS, map_shared
from wsync_core.protocol import MAX_ACK_BYTES, MAX_HEADER_BYTES
from wsync_core.transport import MAX_ORIGIN_BYTES

__all__ = [
    "Kind", "FRAMING", "NONCE_BYTES", "MAX_FDS",
    "mac", "make_socket", "sockaddr", "slot_fits", "map_slot", "map_board",
]

MAGIC = b"WSMP"
NONCE_BYTES = 32
#: descriptors a receiver accepts in one read (one per new slot in a notify)
MAX_FDS = 4
#: at most this many slots per sender (a receiver refuses higher indices)
MAX_SLOTS = 1024
FLAG_FD = 1


class Kind(enum.IntEnum):
    CHALLENGE = 1  # sender -> receiver: nonce
    RESPONSE = 2   # receiver -> sender: mac of the sender's nonce, then the receiver's nonce
    PROOF = 3      # sender -> receiver: mac of the receiver's nonce
    HELLO = 4      # receiver -> sender: arg = worker index, value = its layout's nbytes, body = its scheme's origin
    NOTIFY = 5     # sender -> receiver: arg = slot, value = publish number, body = header, maybe an fd
    RELEASE = 6    # receiver -> sender: arg = slot, done reading it
    ACK = 7        # receiver -> sender: body = ack bytes
    CLOSE = 8      # sender -> receiver: body = reason (empty: a clean shutdown)
    SEEN = 9       # receiver -> sender: arg = slot, receive() took its notification (the next may follow)
    PROBE = 10     # receiver -> sender: arg = probe number; answer once the newest version is notified
    ANSWER = 11    # sender -> receiver: arg = probe number; every version published before the probe is ahead of it
    BOARD = 12     # sender -> receiver, once after hello: the board's fd (FLAG_FD)


#: the largest body each kind may carry
_LIMITS: dict[int, int] = {
    Kind.CHALLENGE: NONCE_BYTES, Kind.RESPONSE: 2 * NONCE_BYTES, Kind.PROOF: NONCE_BYTES, Kind.HELLO: MAX_ORIGIN_BYTES,
    Kind.NOTIFY: MAX_HEADER_BYTES, Kind.RELEASE: 0, Kind.ACK: MAX_ACK_BYTES, Kind.CLOSE: 4096,
    Kind.SEEN: 0, Kind.PROBE: 0, Kind.ANSWER: 0, Kind.BOARD: 0,
}


FRAMING = Framing(MAGIC, _LIMITS)


def mac(authkey: bytes, role: bytes, nonce: bytes) -> bytes:
    """HMAC-SHA256 proving knowledge of ``authkey`` for ``nonce`` (``role`` keeps the two directions apart)."""
    return hmac.new(authkey, b"wsync-mp " + role + b" " + nonce, hashlib.sha256).digest()


def sockaddr(address: str) -> str | bytes:
    """The socket address for an option value: ``@name`` is Linux's abstract namespace, else a path."""
    return b"\0" + address[1:].encode() if address.startswith("@") else address


def make_socket() -> socket.socket:
    """A new AF_UNIX stream socket (close-on-exec, so spawned children do not inherit it)."""
    return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)


def _sealed_size(fd: int, peer: str) -> int:
    """The size of the received memory file ``fd``. Raises TransportError if it is not a memfd
    sealed against shrinking and growing (a hostile sender could otherwise shrink it under the reader)."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        size = os.fstat(fd).st_size
    except OSError as exc:
        raise TransportError(f"{peer} passed a descriptor that is not a sealed memfd: {exc}") from None
    if seals & SEALS != SEALS:
        raise TransportError(f"{peer} passed a memfd without shrink/grow seals (seals {seals:#x})")
    return size


def slot_fits(fd: int, nbytes: int, peer: str) -> bool:
    """Whether the received slot ``fd`` holds this receiver's ``nbytes`` (a sealed memfd of that
    size). Raises TransportError as ``_sealed_size``."""
    return _sealed_size(fd, peer) == max(nbytes, 1)


def map_board(fd: int, worker: int, peer: str) -> tuple[mmap.mmap, memoryview]:
    """Map the sender's board read-only: the map and its 8-byte words, of which ``worker``'s is the
    number of the last publish to it. Raises TransportError if ``fd`` is not a sealed memfd of
    whole words that has one for ``worker``."""
    size = _sealed_size(fd, peer)
    if size % 8 or size < 8 * (worker + 1):
        raise TransportError(f"{peer} passed a board of {size} bytes, which has no 8-byte word for worker {worker}")
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    return mm, memoryview(mm).cast("q")


def map_slot(fd: int, nbytes: int, peer: str) -> tuple[mmap.mmap, torch.Tensor] | None:
    """Map a received slot read-only; None if its size is not this receiver's ``nbytes``. Raises
    TransportError as ``slot_fits``."""
    if not slot_fits(fd, nbytes, peer):
        return None
    return map_shared(fd, max(nbytes, 1), nbytes=nbytes)
