"""Frames for a transport's control channel: a fixed prefix and a small body, bounded by kind.

Every frame is a 24-byte prefix (magic, kind, flags, a 32-bit ``arg``, body size, a 64-bit
``value``) and a body. Each transport names its kinds and the largest body each may carry
(``Framing``); a reader checks the magic, the kind and the size before it buffers a body, so a
peer cannot make it allocate more than the limit or accept a kind it does not expect. Binary,
with ``struct``: nothing is unpickled. Used by the shared-memory transports (shm, mp), whose
payloads never cross the channel.
"""

from __future__ import annotations

import struct
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass

from .errors import TransportError

__all__ = ["Framing", "Frame", "FrameReader", "PREFIX"]

#: magic, kind, flags, arg, body size, value
PREFIX = struct.Struct("<4sBBxxIIQ")


@dataclass(frozen=True)
class Frame:
    """One received frame."""

    kind: int
    flags: int
    arg: int
    value: int
    body: bytes


class Framing:
    """One transport's frames: a 4-byte ``magic`` and, for each kind, the largest body it may carry."""

    def __init__(self, magic: bytes, limits: Mapping[int, int]) -> None:
        if len(magic) != 4:
            raise ValueError(f"a frame magic has 4 bytes, got {magic!r}")
        self.magic = magic
        self.limits = {int(k): n for k, n in limits.items()}
        self.kinds = {int(k): k for k in limits}  # a received kind comes back as the caller's own (an IntEnum)
        self.names = {int(k): getattr(k, "name", str(k)) for k in limits}

    def encode(self, kind: int, body: bytes = b"", *, arg: int = 0, value: int = 0, flags: int = 0) -> bytes:
        """One frame's bytes. Raises ValueError for an unknown kind or a body over its limit."""
        limit = self.limits.get(kind)
        if limit is None or len(body) > limit:
            raise ValueError(f"frame kind {kind} with a body of {len(body)} bytes (limit {limit})")
        try:
            return PREFIX.pack(self.magic, kind, flags, arg, len(body), value) + body
        except struct.error as exc:
            raise ValueError(f"frame kind {kind}: flags {flags}, arg {arg} or value {value} out of range "
                             f"({exc})") from None

    def reader(self, peer: str, accept: Collection[int] | None = None) -> FrameReader:
        """A reader of frames from ``peer`` (named in errors), taking only kinds in ``accept``
        (default: every kind this framing knows)."""
        return FrameReader(self, peer, frozenset(self.limits if accept is None else accept))


class FrameReader:
    """Splits a byte stream into frames; ``accept`` may change between frames (``feed`` parses lazily)."""

    def __init__(self, framing: Framing, peer: str, accept: frozenset[int]) -> None:
        self.framing = framing
        self.peer = peer
        self.accept = accept
        self._buf = bytearray()
        self._need: tuple[int, int, int, int, int] | None = None  # kind, flags, arg, size, value

    def feed(self, data: bytes) -> Iterator[Frame]:
        """The frames completed by ``data``, one at a time. Raises TransportError, naming the peer
        and what is wrong, on a bad magic, an unexpected kind or a body over its kind's limit."""
        self._buf += data
        while True:
            if self._need is None:
                if len(self._buf) < PREFIX.size:
                    return
                magic, kind, flags, arg, size, value = PREFIX.unpack_from(self._buf)
                if magic != self.framing.magic:
                    raise TransportError(f"{self.peer} sent a frame starting {bytes(self._buf[:4])!r}, "
                                         f"expected {self.framing.magic!r}")
                if kind not in self.accept:
                    raise TransportError(f"{self.peer} sent a frame of kind {kind}, expected one of "
                                         f"{sorted(self.framing.names.get(k, str(k)) for k in self.accept)}")
                limit = self.framing.limits[kind]
                if size > limit:
                    raise TransportError(f"{self.peer} sent a {self.framing.names[kind]} frame of {size} "
                                         f"bytes, the limit is {limit}")
                del self._buf[:PREFIX.size]
                self._need = (kind, flags, arg, size, value)
            kind, flags, arg, size, value = self._need
            if len(self._buf) < size:
                return
            body = bytes(self._buf[:size])
            del self._buf[:size]
            self._need = None
            yield Frame(self.framing.kinds[kind], flags, arg, value, body)
