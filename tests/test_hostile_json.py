"""Hostile or broken JSON from a peer: every core decoder returns a value or raises TransportError,
never anything else, and still accepts everything the core itself writes."""

from __future__ import annotations

import json
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from wsync_conformance.strategies import HOSTILE_TOKENS, hostile_json
from wsync_core import TransportError
from wsync_core.layout import Layout
from wsync_core.protocol import (
    MAX_ACK_BYTES,
    MAX_HEADER_BYTES,
    MAX_JSON_DEPTH,
    MAX_JSON_DIGITS,
    Ack,
    Header,
    decode_json,
)


@settings(max_examples=600, deadline=None)
@given(hostile_json())
def test_decode_json_gives_a_value_or_transport_error(data: bytes) -> None:
    try:
        decode_json(data, "message", MAX_ACK_BYTES)
    except TransportError:
        pass


@settings(max_examples=600, deadline=None)
@given(hostile_json())
def test_header_and_ack_decoders_give_a_value_or_transport_error(data: bytes) -> None:
    try:
        header = Header.decode(data)
    except TransportError:
        pass
    else:
        assert header.version >= 0 and header.nbytes >= 0
        if header.layout is not None:
            try:
                Layout.from_wire(header.layout)
            except ValueError:  # the core turns this into TransportError
                pass
    try:
        Ack.decode(data)
    except TransportError:
        pass


@pytest.mark.parametrize("token", HOSTILE_TOKENS[:10], ids=lambda t: repr(t[:12]))
@pytest.mark.parametrize("field", ["v", "w", "e"])
def test_each_hostile_token_in_an_ack_raises_transport_error(token: bytes, field: str) -> None:
    fields = {"v": b"1", "w": b"0", "e": b'"x"'}
    fields[field] = token
    data = b'{"wsync":1,' + b",".join(b'"%s":%s' % (k.encode(), v) for k, v in fields.items()) + b"}"
    with pytest.raises(TransportError):
        Ack.decode(data)


@pytest.mark.parametrize("data", [
    b'{"wsync":1,"v":1,"n":0,"m":"policy","d":"x","l":[["a",["float32"],[1],0,4]]}',  # dtype of the wrong type
    b'{"wsync":1,"v":1,"n":0,"m":"policy","d":"x","l":{"a":1}}',
    b'{"wsync":1,"v":1,"n":0,"m":"policy","d":"x","l":[["a","float32",[true],0,4]]}',
    b'{"wsync":1,"v":1,"n":' + b"1" + b"0" * 30 + b',"m":"policy","d":"x"}',
    b'{"wsync":1,"v":1,"n":4,"m":"policy","d":"x","c":[18446744073709551616]}',
])
def test_mistyped_or_out_of_range_header_fields_raise_transport_error(data: bytes) -> None:
    with pytest.raises(TransportError):
        Header.decode(data)


def test_limits_refuse_only_what_no_honest_peer_sends() -> None:
    ok = b'{"a":' * (MAX_JSON_DEPTH - 1) + b"1" + b"}" * (MAX_JSON_DEPTH - 1)
    assert decode_json(ok, "message", 1 << 20) is not None
    with pytest.raises(TransportError, match="deep"):
        decode_json(b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), "message", 1 << 20)
    assert decode_json(b'["' + b"[" * 5000 + b'"]', "message", 1 << 20) == ["[" * 5000]  # brackets in a string
    assert decode_json(b"-" + b"9" * MAX_JSON_DIGITS, "message", 100) == -int("9" * MAX_JSON_DIGITS)
    with pytest.raises(TransportError, match="integer"):
        decode_json(b"9" * (MAX_JSON_DIGITS + 1), "message", 100)
    with pytest.raises(TransportError, match="exceeds"):
        decode_json(b" " * 101, "message", 100)


def test_what_the_core_writes_still_decodes() -> None:
    tensors = {f"layer{i}.{k}": torch.zeros(3, 5) for i in range(300) for k in ("weight", "bias")}
    layout = Layout.of(tensors)
    crc = [4294967295, 0] * 50
    header = Header(2**40, "policy", layout.digest, 100 * (16 << 20), crc, json.loads(layout.to_json()))
    assert Header.decode(header.encode()) == header
    ack = Ack(3, 2**40, "worker 3: [{weird}] error \"text\"", "TransportError")
    assert Ack.decode(ack.encode()) == ack


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64), st.sampled_from([bytes, bytearray, memoryview]))
def test_any_bytes_like_object_is_accepted(data: bytes, kind) -> None:
    try:
        decode_json(kind(data), "message", MAX_HEADER_BYTES)
    except TransportError:
        pass


@pytest.mark.parametrize("data", [
    b"[" * (MAX_JSON_DEPTH + 1) + b'"' + b'\\"' * ((MAX_ACK_BYTES - 40) // 2),  # a string that never ends
    b"[" * (MAX_JSON_DEPTH + 1) + b'"' * (MAX_ACK_BYTES - 40),
    b"[" * (MAX_ACK_BYTES - 1),
], ids=["escaped-quotes", "quotes", "brackets"])
def test_a_hostile_ack_costs_time_linear_in_its_size(data: bytes) -> None:
    """An ack of at most MAX_ACK_BYTES is refused in well under a second: the depth check once
    scanned for brackets outside strings with a regex that took time quadratic in the quotes of a
    string that never ends (16 s for 64 KiB, the sender's lock held all along; linear now, a few
    milliseconds). The bound is two hundred times what it takes."""
    started = time.monotonic()
    with pytest.raises(TransportError):
        Ack.decode(data)
    with pytest.raises(TransportError):
        Header.decode(data)
    assert time.monotonic() - started < 2.0
