"""What the core writes into headers and acks: small JSON objects, checked field by field on arrival.

JSON and nothing else crosses between processes besides raw tensor bytes, so a hostile peer
can at worst send a malformed message, which raises TransportError and touches no model.
"""

from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from .errors import TransportError

__all__ = ["Header", "Ack", "MAX_HEADER_BYTES", "MAX_ACK_BYTES", "CRC_CHUNK", "PROTOCOL", "crc32"]

PROTOCOL = 1
#: the largest header accepted (it may carry a full layout: ~100 bytes per tensor)
MAX_HEADER_BYTES = 32 * 1024 * 1024
#: the largest ack accepted
MAX_ACK_BYTES = 64 * 1024
#: the payload is checksummed in chunks of this many bytes, one CRC32 each
CRC_CHUNK = 16 * 1024 * 1024


def _decode(data: bytes, limit: int, what: str) -> dict[str, Any]:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TransportError(f"{what} must be bytes, got {type(data).__name__}")
    if len(data) > limit:
        raise TransportError(f"{what} of {len(data)} bytes exceeds the limit of {limit} bytes")
    try:
        obj = json.loads(bytes(data))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TransportError(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(obj, dict) or obj.get("wsync") != PROTOCOL:
        raise TransportError(f"{what} is not a wsync protocol {PROTOCOL} message")
    return obj


def _field(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = obj.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise TransportError(f"{what} field {key!r} is missing or malformed: {value!r:.60}")
    return value


def crc32(buffer: torch.Tensor) -> list[int]:
    """CRC32 of each ``CRC_CHUNK``-byte chunk of a flat uint8 tensor (copied to the host first if
    it lives on a GPU). Chunks are summed in parallel threads: zlib releases the GIL."""
    data = buffer.cpu().numpy().data
    chunks = [data[i : i + CRC_CHUNK] for i in range(0, len(data), CRC_CHUNK)] or [data]
    if len(chunks) < 3:
        return [zlib.crc32(c) for c in chunks]
    with ThreadPoolExecutor(max_workers=min(len(chunks), os.cpu_count() or 1),
                            thread_name_prefix="wsync-crc") as pool:
        return list(pool.map(zlib.crc32, chunks))


@dataclass(frozen=True)
class Header:
    """What comes with every payload: version, model, layout digest, size and optional CRC32s
    (one per ``CRC_CHUNK`` bytes).

    ``layout`` (the full sender layout, decoded JSON) is sent the first time a worker gets a
    payload, so a mismatch can be reported key by key.
    """

    version: int
    model_id: str
    digest: str
    nbytes: int
    crc: list[int] | None = None
    layout: Any = None

    def encode(self) -> bytes:
        obj: dict[str, Any] = {
            "wsync": PROTOCOL, "v": self.version, "m": self.model_id,
            "d": self.digest, "n": self.nbytes, "c": self.crc,
        }
        if self.layout is not None:
            obj["l"] = self.layout
        return json.dumps(obj, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> Header:
        """Parse header bytes; raises TransportError naming what is malformed."""
        obj = _decode(data, MAX_HEADER_BYTES, "header")
        version = _field(obj, "v", int, "header")
        nbytes = _field(obj, "n", int, "header")
        if version < 0 or nbytes < 0:
            raise TransportError(f"header has a negative version or size ({version}, {nbytes})")
        crc = obj.get("c")
        chunks = max(1, -(-nbytes // CRC_CHUNK))
        if crc is not None and not (isinstance(crc, list) and len(crc) == chunks
                                    and all(isinstance(c, int) and not isinstance(c, bool) for c in crc)):
            raise TransportError(f"header field 'c' is malformed: {crc!r:.60} (expected {chunks} CRC32s)")
        return cls(version, _field(obj, "m", str, "header"), _field(obj, "d", str, "header"),
                   nbytes, crc, obj.get("l"))


@dataclass(frozen=True)
class Ack:
    """A worker's answer: the version it now holds, or the error that kept it from applying one."""

    worker: int
    version: int
    error: str | None = None
    error_type: str | None = None

    def encode(self) -> bytes:
        obj: dict[str, Any] = {"wsync": PROTOCOL, "w": self.worker, "v": self.version}
        if self.error is not None:
            obj["e"] = self.error[:4000]
            obj["t"] = self.error_type
        return json.dumps(obj, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> Ack:
        """Parse ack bytes; raises TransportError naming what is malformed."""
        obj = _decode(data, MAX_ACK_BYTES, "ack")
        err = obj.get("e")
        etype = obj.get("t")
        if err is not None and not isinstance(err, str) or etype is not None and not isinstance(etype, str):
            raise TransportError("ack error fields are malformed")
        return cls(_field(obj, "w", int, "ack"), _field(obj, "v", int, "ack"), err, etype)
