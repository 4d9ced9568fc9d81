"""What the core writes into headers and acks: small JSON objects, checked field by field on arrival.

JSON and nothing else crosses between processes besides raw tensor bytes, so a hostile peer
can at worst send a malformed message, which raises TransportError and touches no model.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from .errors import TransportError

__all__ = ["Header", "Ack", "MAX_HEADER_BYTES", "MAX_ACK_BYTES", "MAX_JSON_DEPTH", "MAX_JSON_DIGITS",
           "CHECKSUM_CHUNK", "PROTOCOL", "checksum", "check_protocol", "decode_json"]

PROTOCOL = 1
#: the largest header accepted (it may carry a full layout: ~100 bytes per tensor)
MAX_HEADER_BYTES = 32 * 1024 * 1024
#: the largest ack accepted
MAX_ACK_BYTES = 64 * 1024
#: the payload is checksummed in chunks of this many bytes, one XXH3-64 each (memory speed: a
#: CRC32 costs more than the wire on a fast link)
CHECKSUM_CHUNK = 16 * 1024 * 1024


#: the deepest nesting of arrays and objects accepted in any JSON from a peer
MAX_JSON_DEPTH = 32
#: the most digits an integer from a peer may have (int64 needs 19)
MAX_JSON_DIGITS = 40
#: the longest number literal of any kind accepted from a peer
_MAX_NUMBER_CHARS = 64

# The hot path: what ``Header.encode`` and ``Ack.encode`` write for a plain full payload and a
# plain ack, matched whole by one regex (a few microseconds instead of a checked ``json.loads``).
# Only what the checked parser accepts with the same value can match: canonical integers of at
# most 19 digits (range-checked after), strings of printable ASCII with nothing to unescape.
# Anything else, e.g. another key order, spaces or an escape, takes the checked parser.
_UINT = rb"(0|[1-9][0-9]{0,18})"
_ASCII = rb'([ !#-\[\]-~]*)'
_FAST_HEADER = re.compile(rb'\{"wsync":1,"v":' + _UINT + rb',"m":"' + _ASCII + rb'","d":"' + _ASCII
                          + rb'","n":' + _UINT + rb',"c":(null|\[[0-9,]{1,65536}\])(?:,"s":"([0-9a-f]{1,32})")?'
                          + rb'(?:,"h":(0|[1-9][0-9]{0,19}))?\}\Z')
#: a sender's session: hex digits (see ``Header.session``)
_SESSION = re.compile(r"[0-9a-f]{1,32}\Z")
_FAST_SUM = re.compile(rb"(?:0|[1-9][0-9]{0,19})\Z")
_FAST_ACK = re.compile(rb'\{"wsync":1,"w":' + _UINT + rb',"v":(-?(?:0|[1-9][0-9]{0,18}))(?:,"h":(0|[1-9][0-9]{0,19}))?\}\Z')
#: what comes before a message's own checksum, its last field (see ``seal``)
_SEAL = b',"h":'


def seal(body: bytes) -> bytes:
    """A JSON object's bytes with its own XXH3-64 as a last field ``"h"``: the hash of every byte
    before that field. With checksums on, headers and acks are sealed, so damage in transit that
    TCP's checksum missed is refused as damage (a changed digit would otherwise name another
    version, base or tensor, and still parse)."""
    head = body[:-1]
    return head + _SEAL + b"%d}" % xxhash.xxh3_64_intdigest(head)


def _check_seal(data: bytes, sealed: Any, what: str, required: bool) -> None:
    """Raise TransportError unless ``sealed`` (the decoded ``"h"``, or None where there is none) is
    the hash of ``data`` before its seal; where there is none, unless it is not ``required``."""
    if sealed is None:
        if required:
            raise TransportError(f"{what} carries no checksum of its own ('h'), and this side checks every "
                                 f"header and ack (checksum=True): damaged in transit, or the two sides were "
                                 f"given different checksum options")
        return
    at = data.rfind(_SEAL)
    if not (_is_int(sealed) and at > 0 and xxhash.xxh3_64_intdigest(data[:at]) == sealed):
        raise TransportError(f"{what} damaged in transit: its own checksum ('h') does not match its bytes")


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_JSON_DIGITS:
        raise TransportError(f"an integer of {len(text)} characters (the limit is {MAX_JSON_DIGITS} digits)")
    return int(text)


def _parse_float(text: str) -> float:
    value = float(text) if len(text) <= _MAX_NUMBER_CHARS else math.inf
    if not math.isfinite(value):
        raise TransportError(f"a number out of range: {text[:40]!r}")
    return value


def _parse_constant(text: str) -> Any:
    raise TransportError(f"{text} is not JSON")


def _too_deep(value: Any) -> bool:
    """Whether a parsed JSON ``value``'s arrays and objects nest more than MAX_JSON_DEPTH deep (one
    pass over what was parsed: a scan of the text for brackets outside strings took time quadratic
    in the number of quotes of an unterminated string, a 64 KiB ack stalling its sender for 16 s)."""
    level = [value]
    for _ in range(MAX_JSON_DEPTH):
        level = [v for c in level for v in (c.values() if isinstance(c, dict) else c)
                 if isinstance(v, (list, dict))]
        if not level:
            return False
    return True


def decode_json(data: Any, what: str, max_bytes: int) -> Any:
    """The value of JSON bytes from a peer, checked as it is parsed: at most ``max_bytes`` bytes,
    strict UTF-8, nesting at most MAX_JSON_DEPTH deep, integers of at most MAX_JSON_DIGITS
    digits, finite numbers only. Raises TransportError naming ``what`` for anything else."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TransportError(f"{what} must be bytes, got {type(data).__name__}")
    size = memoryview(data).nbytes
    if size > max_bytes:
        raise TransportError(f"{what} of {size} bytes exceeds the limit of {max_bytes} bytes")
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TransportError(f"{what} is not UTF-8: {exc}") from None
    deep = TransportError(f"{what} nests arrays or objects more than {MAX_JSON_DEPTH} deep")
    try:
        value = json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant)
    except TransportError as exc:
        raise TransportError(f"{what} is malformed: {exc}") from None
    except RecursionError:  # (deeper than Python's recursion limit)
        raise deep from None
    except ValueError as exc:  # JSONDecodeError is a ValueError
        raise TransportError(f"{what} is not valid JSON: {exc}") from None
    if isinstance(value, (list, dict)) and text.count("[") + text.count("{") > MAX_JSON_DEPTH and _too_deep(value):
        raise deep
    return value


def _decode(data: bytes, limit: int, what: str) -> dict[str, Any]:
    return check_protocol(decode_json(data, what, limit), what)


def check_protocol(obj: Any, what: str) -> dict[str, Any]:
    """``obj`` (a decoded JSON message, called ``what`` in errors) if it is a wsync message of this
    ``PROTOCOL``; raises TransportError saying which protocol it is of otherwise."""
    if not isinstance(obj, dict) or "wsync" not in obj:
        raise TransportError(f"{what} is not a wsync message (expected protocol {PROTOCOL})")
    if obj["wsync"] != PROTOCOL:
        raise TransportError(f"{what} is of wsync protocol {obj['wsync']!r:.20}, this side speaks protocol "
                             f"{PROTOCOL}: the two sides run wsync versions that cannot talk to each other")
    return obj


def _field(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = obj.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise TransportError(f"{what} field {key!r} is missing or malformed: {value!r:.60}")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _layout_shaped(raw: Any) -> bool:
    """Whether a header's layout has the wire form's types (its consistency is Layout.from_wire's to check)."""
    return isinstance(raw, list) and all(
        isinstance(e, list) and len(e) == 5 and isinstance(e[0], str) and isinstance(e[1], str)
        and isinstance(e[2], list) and all(_is_int(d) and 0 <= d < 1 << 63 for d in e[2])
        and _is_int(e[3]) and _is_int(e[4]) and 0 <= e[3] < 1 << 63 and 0 <= e[4] < 1 << 63
        for e in raw)


def _host_bytes(buffer: torch.Tensor) -> memoryview:
    # (numpy's stubs give an ndarray __buffer__ on Python 3.12+ only)
    return memoryview(buffer.cpu().numpy()).cast("B")  # type: ignore[arg-type]


def checksum(buffer: torch.Tensor) -> list[int]:
    """XXH3-64 of each ``CHECKSUM_CHUNK``-byte chunk of a flat uint8 tensor (copied to the host
    first if it lives on a GPU). One thread: at ~20 GiB/s it runs at memory speed (a second
    thread measured slower), and a pass of its own cost less than hashing while packing."""
    data = _host_bytes(buffer)
    return [xxhash.xxh3_64_intdigest(data[i : i + CHECKSUM_CHUNK])
            for i in range(0, len(data), CHECKSUM_CHUNK)] or [xxhash.xxh3_64_intdigest(data)]


_JSON_STRS: dict[str, bytes | None] = {}


def _json_str(text: Any) -> bytes | None:
    """``text`` as a JSON string (printable ASCII, nothing to escape), or None for anything else;
    remembered (a model id and a digest repeat every version)."""
    out = _JSON_STRS.get(text) if type(text) is str else None
    if out is None and type(text) is str and text not in _JSON_STRS:
        raw = text.encode("ascii", "replace")
        out = b'"' + raw + b'"' if len(raw) <= 256 and _ASCII_ONLY.match(raw) and raw.decode() == text else None
        if len(_JSON_STRS) < 64:
            _JSON_STRS[text] = out
    return out


_ASCII_ONLY = re.compile(_ASCII + rb"\Z")


def _fast_header(data: Any, sealed: bool) -> Header | None:
    """A header in the form ``Header.encode`` writes for a plain full payload, or None (the
    checked parser decides then). Equal to what ``Header.decode_checked`` returns for it."""
    if type(data) is not bytes or len(data) > 65536 + 256:
        return None
    m = _FAST_HEADER.match(data)
    if m is None:
        return None
    version, nbytes = int(m.group(1)), int(m.group(4))
    if version >= 1 << 63 or nbytes >= 1 << 63:
        return None
    raw = m.group(5)
    if raw == b"null":
        sums = None
    else:
        parts = raw[1:-1].split(b",")
        if len(parts) != max(1, -(-nbytes // CHECKSUM_CHUNK)) or not all(_FAST_SUM.match(p) for p in parts):
            return None
        sums = [int(p) for p in parts]
        if any(c >= 1 << 64 for c in sums):
            return None
    if m.group(7) is not None or sealed:
        _check_seal(data, m.group(7) and int(m.group(7)), "header", sealed)
    session = m.group(6)
    return Header(version, m.group(2).decode(), m.group(3).decode(), nbytes, sums,
                  session=session.decode() if session is not None else None)


@dataclass(frozen=True)
class Header:
    """What comes with every payload: version, model, layout digest, size and optional checksums
    (XXH3-64, one per ``CHECKSUM_CHUNK`` bytes).

    ``layout`` (the full sender layout, decoded JSON) is sent the first time a worker gets a
    payload, so a mismatch can be reported key by key.

    ``wire``, ``table`` and ``base`` describe an encoded payload (``wsync_core.delta``): floating
    tensors in dtype ``wire``; only the tensors or elements ``table`` lists; exact only for a
    receiver holding version ``base`` or newer. ``nbytes`` is then the payload's size, smaller
    than the layout's.

    ``session`` names the sender that numbered the version (hex digits, new for each sender): a
    trainer started again on the same address numbers from 0 again, and a worker still holding
    the old one's version 3 must take the new one's 0, 1, 2 and 3, not count them as old.
    """

    version: int
    model_id: str
    digest: str
    nbytes: int
    checksum: list[int] | None = None
    layout: Any = None
    wire: str | None = None
    table: list[list[int]] | None = None
    base: int | None = None
    session: str | None = None

    @property
    def encoded(self) -> bool:
        """Whether the payload is encoded (a wire dtype, a table or a base), not a plain full one."""
        return self.wire is not None or self.table is not None or self.base is not None

    def encode(self, sealed: bool = False) -> bytes:
        """The header as JSON bytes (a plain full payload's without ``json.dumps``: same bytes),
        ``sealed`` (``seal``) where the transport checksums what it moves."""
        body = None
        if (self.checksum is None and self.layout is None and self.wire is None and self.table is None
                and self.base is None and type(self.version) is int and type(self.nbytes) is int):
            m, d, s = _json_str(self.model_id), _json_str(self.digest), _json_str(self.session)
            if m is not None and d is not None and self.session is None:
                body = b'{"wsync":%d,"v":%d,"m":%s,"d":%s,"n":%d,"c":null}' % (PROTOCOL, self.version, m, d,
                                                                              self.nbytes)
            elif m is not None and d is not None and s is not None:
                body = b'{"wsync":%d,"v":%d,"m":%s,"d":%s,"n":%d,"c":null,"s":%s}' % (
                    PROTOCOL, self.version, m, d, self.nbytes, s)
        if body is None:
            obj: dict[str, Any] = {
                "wsync": PROTOCOL, "v": self.version, "m": self.model_id,
                "d": self.digest, "n": self.nbytes, "c": self.checksum,
            }
            if self.session is not None:
                obj["s"] = self.session
            if self.layout is not None:
                obj["l"] = self.layout
            if self.wire is not None:
                obj["w"] = self.wire
            if self.table is not None:
                obj["x"] = self.table
            if self.base is not None:
                obj["b"] = self.base
            body = json.dumps(obj, separators=(",", ":")).encode()
        return seal(body) if sealed else body

    @classmethod
    def decode(cls, data: bytes, sealed: bool = False) -> Header:
        """Parse header bytes, which must be ``sealed`` (``seal``) where this side checksums what
        it receives; raises TransportError naming what is malformed or damaged."""
        fast = _fast_header(data, sealed)
        return fast if fast is not None and (fast.checksum is not None or not sealed) else cls.decode_checked(data, sealed)

    @classmethod
    def decode_checked(cls, data: bytes, sealed: bool = False) -> Header:
        """``decode`` through the checked JSON parser alone (what the fast path must agree with)."""
        obj = _decode(data, MAX_HEADER_BYTES, "header")
        _check_seal(data, obj.get("h"), "header", sealed)
        version = _field(obj, "v", int, "header")
        nbytes = _field(obj, "n", int, "header")
        if not (0 <= version < 1 << 63 and 0 <= nbytes < 1 << 63):
            raise TransportError(f"header has a version or size out of range ({version}, {nbytes})")
        sums = obj.get("c")
        chunks = max(1, -(-nbytes // CHECKSUM_CHUNK))
        if sums is not None and not (isinstance(sums, list) and len(sums) == chunks
                                     and all(_is_int(c) and 0 <= c < 1 << 64 for c in sums)):
            raise TransportError(f"header field 'c' is malformed: {sums!r:.60} (expected {chunks} XXH3-64 sums)")
        if sums is None and sealed:
            raise TransportError("header carries no checksums of its payload ('c'), and this side checks every "
                                 "payload (checksum=True): the two sides were given different checksum options")
        layout = obj.get("l")
        if layout is not None and not _layout_shaped(layout):
            raise TransportError(f"header field 'l' is malformed: {layout!r:.60} (expected a list of "
                                 f"[key, dtype, shape, offset, nbytes])")
        wire, table, base = obj.get("w"), obj.get("x"), obj.get("b")
        if wire is not None and not isinstance(wire, str):
            raise TransportError(f"header field 'w' is malformed: {wire!r:.60}")
        if table is not None and not (isinstance(table, list) and all(
                isinstance(t, list) and len(t) == 3 and all(_is_int(x) and -1 <= x < 1 << 63 for x in t)
                for t in table)):
            raise TransportError(f"header field 'x' is malformed: {table!r:.60} (expected a list of "
                                 f"[tensor, count, offset])")
        if base is not None and not (_is_int(base) and 0 <= base < version):
            raise TransportError(f"header field 'b' is malformed: {base!r:.60} (expected a version before {version})")
        session = obj.get("s")
        if session is not None and not (isinstance(session, str) and _SESSION.match(session)):
            raise TransportError(f"header field 's' is malformed: {session!r:.60} (expected up to 32 hex digits)")
        return cls(version, _field(obj, "m", str, "header"), _field(obj, "d", str, "header"),
                   nbytes, sums, layout, wire, table, base, session)


@dataclass(frozen=True)
class Ack:
    """A worker's answer: the version it now holds, or the error that kept it from applying one."""

    worker: int
    version: int
    error: str | None = None
    error_type: str | None = None

    def encode(self, sealed: bool = False) -> bytes:
        """The ack as JSON bytes (a plain one without ``json.dumps``: same bytes), ``sealed``
        (``seal``) where the transport checksums what it moves."""
        if self.error is None and type(self.worker) is int and type(self.version) is int:
            body = b'{"wsync":%d,"w":%d,"v":%d}' % (PROTOCOL, self.worker, self.version)
        else:
            obj: dict[str, Any] = {"wsync": PROTOCOL, "w": self.worker, "v": self.version}
            if self.error is not None:
                obj["e"] = self.error[:4000]
                obj["t"] = self.error_type
            body = json.dumps(obj, separators=(",", ":")).encode()
        return seal(body) if sealed else body

    @classmethod
    def decode(cls, data: bytes, sealed: bool = False) -> Ack:
        """Parse ack bytes, which must be ``sealed`` (``seal``) where this side checksums what it
        receives; raises TransportError naming what is malformed or damaged."""
        if type(data) is bytes and len(data) <= 96:
            m = _FAST_ACK.match(data)
            if m is not None:
                if m.group(3) is not None or sealed:
                    _check_seal(data, m.group(3) and int(m.group(3)), "ack", sealed)
                return cls(int(m.group(1)), int(m.group(2)))
        return cls.decode_checked(data, sealed)

    @classmethod
    def decode_checked(cls, data: bytes, sealed: bool = False) -> Ack:
        """``decode`` through the checked JSON parser alone (what the fast path must agree with)."""
        obj = _decode(data, MAX_ACK_BYTES, "ack")
        _check_seal(data, obj.get("h"), "ack", sealed)
        err = obj.get("e")
        etype = obj.get("t")
        if err is not None and not isinstance(err, str) or etype is not None and not isinstance(etype, str):
            raise TransportError("ack error fields are malformed")
        return cls(_field(obj, "w", int, "ack"), _field(obj, "v", int, "ack"), err, etype)
