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
from wsync_zmq.wire import DATA, HELLO, Hello, decode_delivery, decode_peer, payload_tensor
from zmq_helpers import make_model

LAYOUT = Layout.of(flatten(make_model(0)))
NBYTES = LAYOUT.nbytes
MAX_HEADER = 4096

kinds = st.sampled_from([DATA, HELLO, b"A", b"B", b"", b"DD", b"\x00", b"\xff"])
blobs = st.one_of(st.binary(max_size=64), st.binary(min_size=NBYTES - 2, max_size=NBYTES + 2),
                  st.builds(lambda h: json.dumps(h).encode(), st.recursive(
                      st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                      lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(list("wmdnvc") + ["wsync"]),
                                                                          c, max_size=6), max_leaves=12)))
frame_lists = st.tuples(st.lists(st.one_of(kinds, blobs), max_size=4), st.integers(0, 3))


@settings(max_examples=400, deadline=None)
@given(frame_lists)
def test_delivery_decoder_accepts_only_bounded_messages(case):
    frames, extra = case
    try:
        header, payload = decode_delivery(frames, extra, NBYTES, MAX_HEADER)
    except TransportError:
        return
    assert extra == 0 and len(frames) == 3 and frames[0] == DATA
    assert 0 < len(header) <= MAX_HEADER and len(payload) <= NBYTES
    assert payload_tensor(payload).numel() == len(payload)


@settings(max_examples=400, deadline=None)
@given(frame_lists)
def test_peer_decoder_accepts_only_wellformed_messages(case):
    frames, extra = case
    try:
        msg = decode_peer(frames, extra)
    except TransportError:
        return
    assert extra == 0 and msg.kind in (HELLO, b"A", b"B")
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
    rid, kind, _ = router.recv_multipart()
    assert kind == HELLO
    try:
        yield router, rid, endpoint
    finally:
        endpoint.close()
        ctx.destroy(linger=0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.lists(st.one_of(kinds, blobs), min_size=1, max_size=5))
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
    assert len(frames) == 3 and frames[0] == DATA
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
        decode_peer([HELLO, data], 0)
    except TransportError:
        pass
