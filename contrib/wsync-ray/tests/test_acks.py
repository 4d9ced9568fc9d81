"""The direct-ack socket on its own (no Ray): what the sender's ``AckServer`` admits, what it hands
on, and that no peer's bytes can stop it serving the others."""

from __future__ import annotations

import queue
import socket
import struct
import time
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wsync_core.protocol import MAX_ACK_BYTES

from wsync_ray.acks import AckFrame, AckLink, AckServer, Closed, Hello


def _next(inbox: queue.SimpleQueue, timeout: float = 10.0):
    return inbox.get(timeout=timeout)


def _quiet(inbox: queue.SimpleQueue, wait: float = 0.2) -> list:
    time.sleep(wait)
    out = []
    while True:
        try:
            out.append(inbox.get_nowait())
        except queue.Empty:
            return out


@pytest.fixture
def server():
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    srv = AckServer("127.0.0.1", inbox)
    try:
        yield srv, inbox
    finally:
        srv.close()


def _address(srv: AckServer, secret: bytes | None = None) -> list:
    return [srv.address[0], srv.address[1], srv.secret if secret is None else secret]


def _served(srv: AckServer, inbox: queue.SimpleQueue) -> None:
    """A good receiver still gets through: the server serves on."""
    token = uuid.uuid4().hex
    link = AckLink(_address(srv), 7, token, 5.0)
    try:
        link.send(b"still here")
        assert _next(inbox) == Hello(7, token)
        assert _next(inbox) == AckFrame(7, token, b"still here")
    finally:
        link.close()
    assert _next(inbox) == Closed(token)


def test_acks_arrive_in_order_then_the_end(server) -> None:
    srv, inbox = server
    token = uuid.uuid4().hex
    link = AckLink(_address(srv), 3, token, 5.0)
    acks = [bytes([i]) * (i + 1) for i in range(50)] + [b"x" * MAX_ACK_BYTES, b""]
    for data in acks:
        link.send(data)
    link.close()
    assert _next(inbox) == Hello(3, token)
    assert [_next(inbox) for _ in acks] == [AckFrame(3, token, d) for d in acks]
    assert _next(inbox) == Closed(token)


def test_wrong_secret_is_refused(server) -> None:
    srv, inbox = server
    link = AckLink(_address(srv, secret=bytes(16)), 1, uuid.uuid4().hex, 5.0)
    link.send(b"forged")
    link.sock.settimeout(10.0)
    try:  # the server closed the connection: an end of file, or a reset where our bytes were unread
        assert link.sock.recv(1) == b""
    except ConnectionResetError:
        pass
    link.close()
    assert _quiet(inbox) == []  # no hello, no ack handed on
    _served(srv, inbox)


def test_an_oversized_ack_ends_the_connection(server) -> None:
    srv, inbox = server
    token = uuid.uuid4().hex
    link = AckLink(_address(srv), 2, token, 5.0)
    link.send(b"fine")
    link.sock.sendall(struct.pack("!I", MAX_ACK_BYTES + 1) + b"y" * 64)
    assert _next(inbox) == Hello(2, token)
    assert _next(inbox) == AckFrame(2, token, b"fine")
    assert _next(inbox) == Closed(token)
    link.close()
    _served(srv, inbox)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(garbage=st.binary(max_size=300), authenticated=st.booleans())
def test_garbage_never_stops_the_server(server, garbage: bytes, authenticated: bool) -> None:
    srv, inbox = server
    if authenticated:
        token = uuid.uuid4().hex
        link = AckLink(_address(srv), 5, token, 5.0)
        link.sock.sendall(garbage)
        link.close()
        items = []
        while not items or not isinstance(items[-1], Closed):
            items.append(_next(inbox))
        assert items[0] == Hello(5, token)
        assert all(isinstance(i, AckFrame) and len(i.data) <= MAX_ACK_BYTES for i in items[1:-1])
    else:
        sock = socket.create_connection(srv.address, timeout=5.0)
        sock.sendall(garbage)
        sock.close()
        assert _quiet(inbox, 0.05) == []  # without the secret nothing is handed on
    _served(srv, inbox)


def test_close_stops_listening() -> None:
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    srv = AckServer("127.0.0.1", inbox)
    port = srv.address[1]
    link = AckLink(_address(srv), 0, uuid.uuid4().hex, 5.0)
    srv.close()
    srv.close()  # idempotent
    assert not srv._thread.is_alive()
    with pytest.raises(ConnectionRefusedError):  # nothing listens there any more
        socket.create_connection(("127.0.0.1", port), timeout=5.0)
    link.close()


# -- the sender's rules for the two channels (acks direct, joins and deaths through the mailbox) --
def _sender():
    pytest.importorskip("ray")
    import torch
    from wsync_core.layout import Layout
    from wsync_core.transport import SenderContext

    from wsync_ray import RayTransport
    from wsync_ray.endpoints import RaySender

    layout = Layout.of({"w": torch.zeros(4)})
    return RaySender(RayTransport().options, SenderContext(1, layout, "policy", torch.device("cpu")))


def _mailbox(*item):
    from wsync_ray.endpoints import _MailboxEvent

    return _MailboxEvent(list(item))


def test_sender_orders_direct_acks_with_the_mailboxs_events() -> None:
    """An ack that comes before its receiver's join waits for the join; a receiver's Left waits
    for its connection's end (so acks sent before it left come first); a replaced receiver's acks
    are dropped."""
    from wsync_core.transport import Acked, Joined, Left

    s = _sender()
    a, b = uuid.uuid4().hex, uuid.uuid4().hex
    assert s._handle(Hello(0, a)) == []
    assert s._handle(AckFrame(0, a, b"early")) == []  # its join is still on its way
    assert s._handle(_mailbox("join", 0, a)) == [Joined(0), Acked(0, b"early")]
    assert s._handle(AckFrame(0, a, b"v1")) == [Acked(0, b"v1")]
    assert s._handle(_mailbox("left", 0, "receiver shut down")) == []  # its connection is still open
    assert s._handle(AckFrame(0, a, b"last")) == [Acked(0, b"last")]
    assert s._handle(Closed(a)) == [Left(0, "receiver shut down")]
    assert s._handle(AckFrame(0, a, b"stale")) == []  # a departed receiver's
    assert s._handle(_mailbox("join", 0, b)) == [Joined(0)]
    assert s._handle(_mailbox("ack", 0, b"via mailbox")) == [Acked(0, b"via mailbox")]
    c = uuid.uuid4().hex
    assert s._handle(_mailbox("join", 0, c)) == [Joined(0)]  # a restart replaces b without a Left
    assert s._handle(AckFrame(0, b, b"replaced")) == []
    assert s._handle(AckFrame(0, c, b"new")) == [Acked(0, b"new")]


def test_sender_gives_up_waiting_for_a_connection_end(monkeypatch) -> None:
    """A Left whose connection never ends (a cut link) is handed on after ``LEFT_GRACE_S``."""
    from wsync_core.transport import Joined, Left

    from wsync_ray import endpoints

    monkeypatch.setattr(endpoints, "LEFT_GRACE_S", 0.0)
    s = _sender()
    a = uuid.uuid4().hex
    assert s._handle(Hello(0, a)) + s._handle(_mailbox("join", 0, a)) == [Joined(0)]
    assert s._handle(_mailbox("left", 0, "its Ray actor died")) == []
    assert s._due() == [Left(0, "its Ray actor died")]
    assert s._due() == []
