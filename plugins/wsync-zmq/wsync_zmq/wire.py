"""The zmq transport's messages, and their decoders: frame counts, kinds and sizes, checked first.

Sender -> receiver: ``[b"D", header, payload]`` (header: the core's JSON; payload: raw bytes), and
the answer to probe ``seq``: ``[b"C", seq]`` (nothing newer) or ``[b"N", seq]`` (a newer one follows).
Receiver -> sender: ``[b"H", hello]`` on every (re)connection, ``[b"A", ack]``, ``[b"B"]`` on close,
``[b"W"]`` (a want: send me the next version) and ``[b"P", seq]`` (a probe: a want that asks for
an answer now).
A hello and an ack also count as a want.
Flow control: the sender sends a worker a version only against a want, so at most one delivery is
on its way to a worker and newer versions replace one another at the sender until it asks again.
Nothing here unpickles; a malformed message raises TransportError and is dropped.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch
from wsync_core import TransportError
from wsync_core.layout import Layout
from wsync_core.protocol import MAX_ACK_BYTES, MAX_HEADER_BYTES, PROTOCOL, decode_json

__all__ = [
    "DATA", "CURRENT", "NEWER", "HELLO", "ACK", "BYE", "WANT", "PROBE",
    "MAX_HELLO_BYTES", "MAX_PEER_FRAME", "MAX_SEQ_BYTES",
    "Hello", "PeerMessage",
    "header_limit", "decode_delivery", "decode_answer", "decode_peer", "payload_tensor",
]

DATA, CURRENT, NEWER = b"D", b"C", b"N"
HELLO, ACK, BYE, WANT, PROBE = b"H", b"A", b"B", b"W", b"P"
#: the longest probe sequence number accepted (decimal digits)
MAX_SEQ_BYTES = 20
#: the largest hello accepted
MAX_HELLO_BYTES = 4096
#: the largest frame a sender accepts from any peer (libzmq drops a peer that sends more)
MAX_PEER_FRAME = MAX_ACK_BYTES + 4096

Buffer = Union[bytes, bytearray, memoryview]


def _size(frame: Any) -> int:
    return memoryview(frame).nbytes


def _describe(frames: Sequence[Any], extra: int) -> str:
    sizes = [_size(f) for f in frames]
    more = f" and {extra} more" if extra else ""
    kind = bytes(memoryview(frames[0])[:8]) if frames else b""
    return f"{len(frames) + extra} frames (kind {kind!r}, sizes {sizes}{more})"


@dataclass(frozen=True)
class Hello:
    """What a receiver announces on every (re)connection: who it is and the schema it holds."""

    worker: int
    model_id: str
    digest: str
    nbytes: int

    def encode(self) -> bytes:
        obj = {"wsync": PROTOCOL, "w": self.worker, "m": self.model_id, "d": self.digest, "n": self.nbytes}
        return json.dumps(obj, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: Buffer) -> Hello:
        """Parse hello bytes; raises TransportError naming what is malformed."""
        obj = decode_json(data, "hello", MAX_HELLO_BYTES)
        if not isinstance(obj, dict) or obj.get("wsync") != PROTOCOL:
            raise TransportError(f"hello is not a wsync protocol {PROTOCOL} message")
        fields = {"w": int, "m": str, "d": str, "n": int}
        for key, kind in fields.items():
            value = obj.get(key)
            if not isinstance(value, kind) or isinstance(value, bool) or kind is int and value < 0:
                raise TransportError(f"hello field {key!r} is missing or malformed: {value!r:.60}")
        return cls(obj["w"], obj["m"], obj["d"], obj["n"])


@dataclass(frozen=True)
class PeerMessage:
    """A decoded receiver -> sender message: ``kind`` is HELLO, ACK or BYE."""

    kind: bytes
    hello: Hello | None = None
    data: bytes = b""
    seq: bytes = b""


def header_limit(layout: Layout) -> int:
    """The largest header a receiver with ``layout`` accepts (room for a sender's full layout)."""
    return min(MAX_HEADER_BYTES, 4 * len(layout.to_json()) + (1 << 20))


def decode_delivery(frames: Sequence[Any], extra: int, nbytes: int, max_header: int) -> tuple[bytes, Any]:
    """Check a sender -> receiver message; returns (header bytes, payload frame).

    ``extra`` counts frames beyond those in ``frames`` (already discarded). The payload may be
    shorter than ``nbytes`` (the core then reports the mismatch) but never longer. Raises
    TransportError for a wrong frame count, kind or size.
    """
    if extra or len(frames) != 3 or bytes(memoryview(frames[0])) != DATA:
        raise TransportError(f"malformed message from the sender: expected 3 frames [b'D', header, payload], "
                             f"got {_describe(frames, extra)}")
    header, payload = frames[1], frames[2]
    if not 0 < _size(header) <= max_header:
        raise TransportError(f"header of {_size(header)} bytes from the sender is out of bounds "
                             f"(1 to {max_header} bytes)")
    if _size(payload) > nbytes:
        raise TransportError(f"payload of {_size(payload)} bytes from the sender is larger than this "
                             f"receiver's model ({nbytes} bytes)")
    return bytes(memoryview(header)), payload


def _seq(frame: Any, who: str) -> bytes:
    data = bytes(memoryview(frame)) if _size(frame) <= MAX_SEQ_BYTES else b""
    if not data.isdigit():
        raise TransportError(f"malformed probe number from {who}: {_size(frame)} bytes, expected 1 to "
                             f"{MAX_SEQ_BYTES} decimal digits")
    return data


def decode_answer(frames: Sequence[Any], extra: int) -> tuple[bytes, bytes]:
    """Check a sender's answer to a probe, ``[b"C", seq]`` or ``[b"N", seq]``; returns (kind, seq).
    Raises TransportError if malformed."""
    kind = bytes(memoryview(frames[0])) if frames and _size(frames[0]) == 1 else b""
    if extra or len(frames) != 2 or kind not in (CURRENT, NEWER):
        raise TransportError(f"malformed message from the sender: expected [b'C', seq] or [b'N', seq], "
                             f"got {_describe(frames, extra)}")
    return kind, _seq(frames[1], "the sender")


def decode_peer(frames: Sequence[Any], extra: int) -> PeerMessage:
    """Check a receiver -> sender message (routing id already removed).

    Raises TransportError for a wrong frame count, kind, size or a malformed hello.
    """
    kind = bytes(memoryview(frames[0])) if frames and _size(frames[0]) == 1 else None
    expected = {HELLO: 2, ACK: 2, BYE: 1, WANT: 1, PROBE: 2}.get(kind) if kind else None
    if extra or expected is None or len(frames) != expected:
        raise TransportError(f"malformed message from a peer: expected [b'H', hello], [b'A', ack], [b'B'], "
                             f"[b'W'] or [b'P', seq], got {_describe(frames, extra)}")
    if kind == PROBE:
        return PeerMessage(kind, seq=_seq(frames[1], "a peer"))
    if kind == HELLO:
        return PeerMessage(kind, hello=Hello.decode(frames[1]))
    if kind == ACK:
        if _size(frames[1]) > MAX_ACK_BYTES:
            raise TransportError(f"ack of {_size(frames[1])} bytes exceeds the limit of {MAX_ACK_BYTES} bytes")
        return PeerMessage(kind, data=bytes(memoryview(frames[1])))
    return PeerMessage(kind)


def payload_tensor(frame: Any) -> torch.Tensor:
    """A read-only flat uint8 tensor over a received frame's bytes, without copying them."""
    view = memoryview(frame)
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the frame is read-only; so is a Delivery's payload
        return torch.frombuffer(view, dtype=torch.uint8)
