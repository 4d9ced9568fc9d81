"""Hypothesis feeds malformed frames to the decoders, and to a live receiver endpoint over a real
socket: the only error is TransportError, and nothing out of bounds is accepted."""

from __future__ import annotations

import json

import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wsync_conformance.strategies import hostile_json
from wsync_core import TransportError
from wsync_core.deadline import Deadline
from wsync_core.layout import Layout
from wsync_core.protocol import Header
from wsync_core.transport import ReceiverContext
from wsync_core.weights import flatten
from wsync_zmq import ZmqTransport
from wsync_zmq.wire import (ACK, BYE, DATA, DELIVERY_HEAD, HELLO, PROBE, WANT, Hello, decode_delivery, decode_peer,
                            encode_delivery, payload_tensor)
from zmq_helpers import make_model

LAYOUT = Layout.of(flatten(make_model(0)))
NBYTES = LAYOUT.nbytes
MAX_HEADER = 4096

kinds = st.sampled_from([DATA, HELLO, ACK, BYE, WANT, PROBE, b"", b"DD", b"\x00", b"\xff"])
blobs = st.one_of(st.binary(max_size=64), st.binary(min_size=NBYTES - 2, max_size=NBYTES + 2),
                  st.builds(lambda h: json.dumps(h).encode(), st.recursive(
                      st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                      lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(list("wmdnvc") + ["wsync"]),
                                                                          c, max_size=6), max_leaves=12)))
#: a delivery's first frame: its kind, a declared header length (true, or any), a header, maybe a payload
heads = st.builds(lambda kind, size, header, payload: kind + (len(header) if size is None else size).to_bytes(4, "big")
                  + header + payload, kinds, st.none() | st.integers(0, 2**32 - 1), blobs, st.binary(max_size=16) | blobs)
frame_lists = st.tuples(st.lists(st.one_of(kinds, blobs, heads), max_size=4), st.integers(0, 3))
#: one-frame peer messages: a kind byte then a body
peer_frames = st.tuples(st.lists(st.builds(bytes.__add__, kinds, blobs) | kinds | blobs, max_size=3), st.integers(0, 2))


@settings(max_examples=400, deadline=None)
@given(frame_lists)
def test_delivery_decoder_accepts_only_bounded_messages(case):
    frames, extra = case
    try:
        header, payload = decode_delivery(frames, extra, NBYTES, MAX_HEADER)
    except TransportError:
        return
    assert extra == 0 and len(frames) in (1, 2) and frames[0][:1] == DATA
    size = int.from_bytes(frames[0][1:DELIVERY_HEAD], "big")
    assert 0 < len(header) == size <= MAX_HEADER and header == frames[0][DELIVERY_HEAD:DELIVERY_HEAD + size]
    assert len(frames) == 1 or len(frames[0]) == DELIVERY_HEAD + size
    assert memoryview(payload).nbytes <= NBYTES
    assert payload_tensor(payload).numel() == memoryview(payload).nbytes


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=MAX_HEADER), st.binary(max_size=NBYTES), st.booleans())
def test_delivery_round_trips(header, payload, separate):
    frames = [encode_delivery(header), payload] if separate else [encode_delivery(header, payload)]
    got_header, got_payload = decode_delivery(frames, 0, NBYTES, MAX_HEADER)
    assert got_header == header and bytes(memoryview(got_payload)) == payload


@settings(max_examples=400, deadline=None)
@given(st.one_of(frame_lists, peer_frames))
def test_peer_decoder_accepts_only_wellformed_messages(case):
    frames, extra = case
    try:
        msg = decode_peer(frames, extra)
    except TransportError:
        return
    assert extra == 0 and len(frames) == 1 and msg.kind == frames[0][:1] and msg.kind in (HELLO, ACK, BYE, WANT, PROBE)
    assert msg.kind not in (BYE, WANT) or frames[0] == msg.kind  # no body
    if msg.kind == HELLO:
        assert msg.hello.worker >= 0 and msg.hello.nbytes >= 0


@given(st.builds(Hello, st.integers(0, 2**40), st.text(max_size=30), st.text(max_size=64), st.integers(0, 2**50)))
def test_hello_round_trips(hello):
    assert Hello.decode(hello.encode()) == hello


@pytest.fixture(scope="module")
def live():
    """A receiver endpoint connected over TCP loopback to a raw ROUTER the test drives."""
    address = ZmqTransport().options["address"]
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    router.bind(address)
    transport = ZmqTransport(address=address)
    endpoint = transport.receiver(ReceiverContext(0, LAYOUT, "policy", torch.device("cpu")))
    endpoint.open(Deadline(10))
    endpoint.recv(Deadline(0.5))  # handles the connection's events, sending the hello
    assert router.poll(10_000), "no hello"
    rid, hello = router.recv_multipart()
    assert hello[:1] == HELLO
    try:
        yield router, rid, endpoint
    finally:
        endpoint.close()
        ctx.destroy(linger=0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.lists(st.one_of(kinds, blobs, heads), min_size=1, max_size=5))
def test_live_receiver_raises_transport_error_or_delivers_in_bounds(live, frames):
    router, rid, endpoint = live
    router.send_multipart([rid, *frames])
    deadline = Deadline(10)
    while True:
        try:
            delivery = endpoint.recv(Deadline(min(1.0, deadline.remaining())))
        except TransportError:
            return
        if delivery is not None or deadline.expired():
            break
    assert delivery is not None, "a message vanished"
    assert len(frames) in (1, 2) and frames[0][:1] == DATA
    assert delivery.payload.dtype == torch.uint8 and delivery.payload.numel() <= NBYTES
    try:
        Header.decode(delivery.header)  # the core's own decoder takes it from here
    except TransportError:
        pass


@settings(max_examples=400, deadline=None)
@given(hostile_json())
def test_hello_and_peer_decoders_give_a_value_or_transport_error_for_hostile_json(data):
    """5000-digit integers, deep nesting, NaN, non-UTF-8, wrong types: a value or TransportError."""
    try:
        hello = Hello.decode(data)
    except TransportError:
        pass
    else:
        assert hello.worker >= 0 and hello.nbytes >= 0
    try:
        decode_peer([HELLO + data], 0)
    except TransportError:
        pass
