"""The zmq transport's messages, and their decoders: frame counts, kinds and sizes, checked first.

Every message is one frame (after the ROUTER's routing id), whose first byte is its kind; the
one exception is a large payload, which follows its header as a second, zero-copy frame. One
frame per message means one libzmq call per message on each side.

Sender -> receiver: a delivery, ``b"D"``, the header's length (4 bytes, big-endian), the header
(the core's JSON), then the payload (raw bytes), in one frame; or, for a large payload, that
frame without the payload and the payload as a second frame. The answer to probe ``seq``:
``b"C" + seq`` (nothing newer) or ``b"N" + seq`` (a newer one follows).
Receiver -> sender: ``b"H" + hello`` on every (re)connection, ``b"A" + ack``, ``b"B"`` on close,
``b"W"`` (a want: send me the next version) and ``b"P" + seq`` (a probe: a want that asks for
an answer now).
A hello and an ack also count as a want.
Flow control: the sender sends a worker a version only against a want, so at most one delivery is
on its way to a worker and newer versions replace one another at the sender until it asks again.
Sizes are bounded twice: libzmq refuses a frame larger than the socket's bound before it
allocates it, and the decoders check the header's declared length against the frame and the
limit before reading it. Nothing here unpickles; a malformed message raises TransportError and
is dropped.
"""

from __future__ import annotations

import json
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

import torch
from wsync_core import TransportError
from wsync_core.layout import Layout
from wsync_core.protocol import MAX_ACK_BYTES, MAX_HEADER_BYTES, PROTOCOL, check_protocol, decode_json
from wsync_core.transport import MAX_ORIGIN_BYTES

__all__ = [
    "DATA", "CURRENT", "NEWER", "REPLACED", "REFUSED", "HELLO", "ACK", "BYE", "WANT", "PROBE", "MAX_REFUSAL_BYTES",
    "MAX_HELLO_BYTES", "MAX_PEER_FRAME", "MAX_SEQ_BYTES", "DELIVERY_HEAD",
    "Hello", "PeerMessage",
    "header_limit", "encode_delivery", "decode_delivery", "decode_answer", "encode_refusal", "decode_refusal",
    "decode_peer", "payload_tensor",
]

DATA, CURRENT, NEWER = b"D", b"C", b"N"
#: sender -> a worker's connection: another connection now speaks for that worker index
REPLACED = b"R"
#: sender -> a connection whose hello it refused (a worker index out of range), with why (UTF-8 text)
REFUSED = b"X"
#: the longest reason a refusal carries
MAX_REFUSAL_BYTES = 300
HELLO, ACK, BYE, WANT, PROBE = b"H", b"A", b"B", b"W", b"P"
#: the longest probe sequence number accepted (decimal digits)
MAX_SEQ_BYTES = 20
#: the largest hello accepted
MAX_HELLO_BYTES = 4096
#: the largest frame a sender accepts from any peer (libzmq drops a peer that sends more)
MAX_PEER_FRAME = MAX_ACK_BYTES + 4096
_LENGTH = struct.Struct(">I")
#: the bytes before a delivery's header: its kind and the header's length
DELIVERY_HEAD = 1 + _LENGTH.size

Buffer = Union[bytes, bytearray, memoryview]
if TYPE_CHECKING:
    from typing_extensions import Buffer as ReadableBuffer  # any buffer (collections.abc.Buffer on 3.12+)


def _size(frame: Any) -> int:
    return memoryview(frame).nbytes


def _describe(frames: Sequence[Any], extra: int) -> str:
    sizes = [_size(f) for f in frames]
    more = f" and {extra} more" if extra else ""
    kind = bytes(memoryview(frames[0])[:8]) if frames else b""
    return f"{len(frames) + extra} frames (kind {kind!r}, sizes {sizes}{more})"


@dataclass(frozen=True)
class Hello:
    """What a receiver announces on every (re)connection: who it is, the schema it holds, and the
    origin of the scheme it was pickled from ("" if none)."""

    worker: int
    model_id: str
    digest: str
    nbytes: int
    origin: str = ""

    def encode(self) -> bytes:
        obj = {"wsync": PROTOCOL, "w": self.worker, "m": self.model_id, "d": self.digest, "n": self.nbytes,
               "o": self.origin}
        return json.dumps(obj, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: Buffer) -> Hello:
        """Parse hello bytes; raises TransportError naming what is malformed."""
        obj = check_protocol(decode_json(data, "hello", MAX_HELLO_BYTES), "hello")
        fields = {"w": int, "m": str, "d": str, "n": int}
        for key, kind in fields.items():
            value = obj.get(key)
            if not isinstance(value, kind) or isinstance(value, bool) or isinstance(value, int) and value < 0:
                raise TransportError(f"hello field {key!r} is missing or malformed: {value!r:.60}")
        origin = obj.get("o", "")
        if not isinstance(origin, str) or len(origin) > MAX_ORIGIN_BYTES:
            raise TransportError(f"hello field 'o' is malformed: {origin!r:.60}")
        return cls(obj["w"], obj["m"], obj["d"], obj["n"], origin)


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


def encode_delivery(header: bytes, payload: ReadableBuffer = b"") -> bytes:
    """A delivery's first frame: kind, header length, header, then ``payload`` (empty when the
    payload goes as a frame of its own)."""
    return b"".join((DATA, _LENGTH.pack(len(header)), header, payload))


def decode_delivery(frames: Sequence[Any], extra: int, nbytes: int, max_header: int) -> tuple[bytes, Any]:
    """Check a sender -> receiver delivery; returns (header bytes, payload: a frame or a view of one).

    ``extra`` counts frames beyond those in ``frames`` (already discarded). The header's declared
    length is checked against ``max_header`` and the frame before the header is read. The
    payload may be shorter than ``nbytes`` (the core then reports the mismatch) but never longer.
    Raises TransportError for a wrong frame count, kind or size.
    """
    head = memoryview(frames[0]).cast("B") if frames else memoryview(b"")
    if extra or not 1 <= len(frames) <= 2 or head.nbytes < DELIVERY_HEAD or head[:1] != DATA:
        raise TransportError(f"malformed message from the sender: expected [b'D' + length + header + payload] "
                             f"or [b'D' + length + header, payload], got {_describe(frames, extra)}")
    size = _LENGTH.unpack_from(head, 1)[0]
    end = DELIVERY_HEAD + size
    if not 0 < size <= max_header:
        raise TransportError(f"header of {size} bytes from the sender is out of bounds (1 to {max_header} bytes)")
    if end > head.nbytes:
        raise TransportError(f"header of {size} bytes from the sender is longer than its frame "
                             f"({head.nbytes - DELIVERY_HEAD} bytes)")
    if len(frames) == 2 and end != head.nbytes:
        raise TransportError(f"malformed message from the sender: a payload both in the header's frame "
                             f"({head.nbytes - end} bytes) and in a frame of its own")
    payload = frames[1] if len(frames) == 2 else head[end:]
    if _size(payload) > nbytes:
        raise TransportError(f"payload of {_size(payload)} bytes from the sender is larger than this "
                             f"receiver's model ({nbytes} bytes)")
    return bytes(head[DELIVERY_HEAD:end]), payload


def _seq(data: memoryview, who: str) -> bytes:
    seq = bytes(data) if data.nbytes <= MAX_SEQ_BYTES else b""
    if not seq.isdigit():
        raise TransportError(f"malformed probe number from {who}: {data.nbytes} bytes, expected 1 to "
                             f"{MAX_SEQ_BYTES} decimal digits")
    return seq


def _kind_and_body(frames: Sequence[Any]) -> tuple[bytes, memoryview]:
    """A one-frame message's kind (its first byte; b"" if none) and the rest of the frame."""
    if len(frames) != 1:
        return b"", memoryview(b"")
    data = memoryview(frames[0]).cast("B")
    return bytes(data[:1]), data[1:]


def decode_answer(frames: Sequence[Any], extra: int) -> tuple[bytes, bytes]:
    """Check a sender's answer to a probe, ``b"C" + seq`` or ``b"N" + seq``; returns (kind, seq).
    Raises TransportError if malformed."""
    kind, body = _kind_and_body(frames)
    if extra or kind not in (CURRENT, NEWER):
        raise TransportError(f"malformed message from the sender: expected [b'C' + seq] or [b'N' + seq], "
                             f"got {_describe(frames, extra)}")
    return kind, _seq(body, "the sender")


def encode_refusal(reason: str) -> bytes:
    """The message refusing a connection's hello, saying why (cut to ``MAX_REFUSAL_BYTES``)."""
    return REFUSED + reason.encode("utf-8")[:MAX_REFUSAL_BYTES]


def decode_refusal(frame: Any) -> str:
    """The reason a refusal gives, as text: undecodable bytes replaced, cut to ``MAX_REFUSAL_BYTES``
    (it is only shown to the user)."""
    return bytes(memoryview(frame).cast("B")[1:1 + MAX_REFUSAL_BYTES]).decode("utf-8", "replace")


def decode_peer(frames: Sequence[Any], extra: int) -> PeerMessage:
    """Check a receiver -> sender message (routing id already removed): one frame, kind first.

    Raises TransportError for a wrong frame count, kind, size or a malformed hello.
    """
    kind, body = _kind_and_body(frames)
    if extra or kind not in (HELLO, ACK, BYE, WANT, PROBE) or kind in (BYE, WANT) and body.nbytes:
        raise TransportError(f"malformed message from a peer: expected [b'H' + hello], [b'A' + ack], [b'B'], "
                             f"[b'W'] or [b'P' + seq], got {_describe(frames, extra)}")
    if kind == PROBE:
        return PeerMessage(kind, seq=_seq(body, "a peer"))
    if kind == HELLO:
        return PeerMessage(kind, hello=Hello.decode(body))
    if kind == ACK:
        if body.nbytes > MAX_ACK_BYTES:
            raise TransportError(f"ack of {body.nbytes} bytes exceeds the limit of {MAX_ACK_BYTES} bytes")
        return PeerMessage(kind, data=bytes(body))
    return PeerMessage(kind)


def payload_tensor(frame: Any) -> torch.Tensor:
    """A read-only flat uint8 tensor over a received frame's bytes, without copying them."""
    view = memoryview(frame)
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the frame is read-only; so is a Delivery's payload
        return torch.frombuffer(view, dtype=torch.uint8)
