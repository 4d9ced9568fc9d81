"""Layouts, headers and acks: what crosses between processes is checked field by field."""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from wsync_core import SchemaMismatchError, TransportError, WorkerTimeoutError
from wsync_core.layout import ALIGN, Layout
from wsync_core.protocol import Ack, Header


def test_layout_is_sorted_aligned_and_order_independent():
    a = Layout.of({"b": torch.zeros(3), "a": torch.zeros(2, dtype=torch.int8)})
    b = Layout.of({"a": torch.zeros(2, dtype=torch.int8), "b": torch.zeros(3)})
    assert a == b and a.digest == b.digest
    assert [e.key for e in a.entries] == ["a", "b"]
    assert all(e.offset % ALIGN == 0 for e in a.entries) and a.nbytes % ALIGN == 0
    assert Layout.from_wire(__import__("json").loads(a.to_json())) == a


def test_layout_differences_name_keys_shapes_dtypes():
    mine = Layout.of({"w": torch.zeros(2, 3), "b": torch.zeros(3), "only_mine": torch.zeros(1)})
    theirs = Layout.of({"w": torch.zeros(3, 2), "b": torch.zeros(3, dtype=torch.float16), "only_theirs": torch.zeros(1)})
    with pytest.raises(SchemaMismatchError) as info:
        mine.check_matches(theirs)
    msg = str(info.value)
    for part in ("'only_mine'", "'only_theirs'", "'w': shape [2, 3] on the sender, [3, 2] on the receiver",
                 "'b': dtype float32 on the sender, float16 on the receiver"):
        assert part in msg


def test_a_model_in_another_dtype_is_named_in_a_few_differences_and_counted() -> None:
    """300 tensors in float16 against float32: the message names the first ten and counts the
    rest (it named all 300, and the worker's ack cut it at 4000 characters, mid-word)."""
    mine = Layout.of({f"layer{i:03d}.w": torch.zeros(2) for i in range(300)})
    theirs = Layout.of({f"layer{i:03d}.w": torch.zeros(2, dtype=torch.float16) for i in range(300)})
    msg = str(pytest.raises(SchemaMismatchError, mine.check_matches, theirs).value)
    assert "'layer009.w': dtype float32 on the sender, float16 on the receiver" in msg and "'layer010.w'" not in msg
    assert msg.endswith("and 290 more differences of shape or dtype") and len(msg) < 1000


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=3), c, max_size=4),
                    max_leaves=12))
@settings(max_examples=200, deadline=None)
def test_malformed_layouts_raise_value_error(raw):
    try:
        Layout.from_wire(raw)
    except ValueError:
        pass


@given(st.binary(max_size=300))
@settings(max_examples=300, deadline=None)
def test_garbage_headers_and_acks_raise_transport_error(data):
    for decode in (Header.decode, Ack.decode):
        try:
            decode(data)
        except TransportError:
            pass


@given(st.dictionaries(st.sampled_from(["wsync", "v", "m", "d", "n", "c", "l", "w", "e", "t"]),
                       st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=3) | st.lists(st.integers(), max_size=2)))
@settings(max_examples=300, deadline=None)
def test_wrongly_typed_fields_raise_transport_error(obj):
    import json

    data = json.dumps(obj).encode()
    for decode in (Header.decode, Ack.decode):
        try:
            decoded = decode(data)
        except TransportError:
            continue
        if isinstance(decoded, Header):
            assert isinstance(decoded.version, int) and decoded.version >= 0 and isinstance(decoded.digest, str)


def test_a_message_of_another_protocol_says_which_protocol_it_is_of():
    """A peer of another wsync release: the error names both protocols, not only the one expected."""
    import json

    for decode in (Header.decode, Ack.decode):
        with pytest.raises(TransportError, match=r"is of wsync protocol 2, this side speaks protocol 1"):
            decode(json.dumps({"wsync": 2, "v": 1, "w": 0, "m": "policy", "d": "ab", "n": 4}).encode())
        with pytest.raises(TransportError, match=r"is not a wsync message \(expected protocol 1\)"):
            decode(b'{"v": 1}')


def test_a_sealed_header_without_payload_checksums_is_refused_where_this_side_checks_payloads():
    """A side that checks every payload (checksum=True) does not apply one whose header carries no
    checksums of it: sealed or not, a header without 'c' would leave the payload unchecked."""
    from wsync_core.protocol import seal

    for unchecked in (Header(1, "policy", "ab", 10).encode(True),
                      seal(b'{"wsync":1,"v":1,"m":"policy","d":"ab","n":10}')):
        for decode in (Header.decode, Header.decode_checked):
            with pytest.raises(TransportError, match=r"no checksums of its payload \('c'\).*checksum=True"):
                decode(unchecked, True)
        assert Header.decode(Header(1, "policy", "ab", 10).encode()).checksum is None  # (where no side checks)


def test_oversized_ack_is_refused_before_parsing():
    with pytest.raises(TransportError, match="exceeds"):
        Ack.decode(b"{" + b" " * (1 << 20) + b"}")


def test_header_roundtrip_and_worker_timeout_pickles():
    h = Header(3, "policy", "abc", 128, [42])
    assert Header.decode(h.encode()) == h
    big = torch.randint(0, 255, (3 * (16 << 20) + 5,), dtype=torch.uint8)
    import xxhash
    from wsync_core.protocol import checksum
    sums = checksum(big)
    assert len(sums) == 4 and sums[-1] == xxhash.xxh3_64_intdigest(big[3 * (16 << 20):].numpy().tobytes())
    e = pickle.loads(pickle.dumps(WorkerTimeoutError("late", [2, 1])))
    assert e.workers == [1, 2] and str(e) == "late"
