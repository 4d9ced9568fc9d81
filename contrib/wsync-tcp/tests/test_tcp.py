"""tcp's own tests: authentication, hostile peers on both sides, heartbeats, reconnects. Real
sockets and worker processes throughout."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from wsync_core import (Deadline, Joined, Layout, Left, ReceiverContext, SenderContext, TransportError,
                        WeightSyncScheme, WorkerTimeoutError)
from wsync_core.protocol import MAX_ACK_BYTES
from wsync_core.stream import PREFIX, Kind, hello_frame
from wsync_tcp import TcpTransport

from tcp_worker import make_model

LAYOUT = Layout.of({"w": torch.zeros(16)})


def prefix(kind: int, a: int = 0, b: int = 0, magic: bytes = b"ws") -> bytes:
    return PREFIX.pack(magic, kind, a, b)


def closed_by_peer(sock: socket.socket, within: float = 30.0) -> bool:
    """Whether the other end closes ``sock`` within ``within`` seconds (reading and dropping what comes)."""
    sock.settimeout(within)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def events_until(endpoint, done, timeout: float = 30.0) -> list:
    got, deadline = [], Deadline(timeout)
    while not done(got) and not deadline.expired():
        got += endpoint.poll(Deadline(deadline.slice(0.2)))
    return got


def bump(model: torch.nn.Module) -> None:
    with torch.no_grad():
        model[0].weight.add_(1.0)


@pytest.fixture
def sender():
    """``sender(num_workers, **options)``: a tcp sender scheme and its model; shut down after the test."""
    made = []

    def make(num_workers: int = 1, **options) -> tuple[WeightSyncScheme, torch.nn.Module]:
        scheme, model = WeightSyncScheme("tcp", timeout=60.0, **options), make_model(0)
        scheme.init_on_sender(model=model, num_workers=num_workers)
        made.append(scheme)
        return scheme, model

    yield make
    for scheme in made:
        scheme.shutdown()


@contextlib.contextmanager
def raw_sender(num_workers: int, heartbeat: float, **options: Any) -> Iterator[tuple[Any, tuple[str, int]]]:
    """A tcp sender endpoint (no scheme: raw sockets play its workers), open, and its address."""
    transport = TcpTransport(heartbeat=heartbeat, **options)
    endpoint = transport.sender(SenderContext(num_workers, LAYOUT, "policy", torch.device("cpu")))
    endpoint.open(Deadline(10))
    try:
        yield endpoint, (transport.options["host"], transport.options["port"])
    finally:
        endpoint.close()


def test_options_are_checked_and_the_secret_hidden() -> None:
    t = TcpTransport(authkey="s3cret")
    assert t.options["host"] == t.options["advertise"] == "127.0.0.1" and 0 < t.options["port"] < 65536
    assert "s3cret" not in repr(t)
    with pytest.raises(ValueError, match="advertise"):
        TcpTransport(host="0.0.0.0")
    with pytest.raises(ValueError, match="port"):
        TcpTransport(port=70000)
    with pytest.raises(ValueError, match="authkey"):
        TcpTransport(authkey="")


def test_auth_good_key_updates_wrong_key_and_no_key_refused(sender, spawn) -> None:
    scheme, model = sender(2, authkey="good key")
    options = scheme.transport.options
    good = spawn(0, options, announce=True)
    wrong = spawn(1, {**options, "authkey": "wrong key"}, announce=True)
    assert good.next() == wrong.next() == {"ready": True}  # both started: connecting takes them little
    with pytest.raises(WorkerTimeoutError) as info:
        scheme.connect(timeout=5.0)  # usable for the workers that answered
    assert info.value.workers == [1]
    good.wait_version(0)
    error = wrong.next()
    assert "authentication failed" in error.get("error", ""), error
    # a peer without the key that says hello at once is dropped, never joins
    host, port = options["host"], options["port"]
    with socket.create_connection((host, port)) as raw:
        raw.sendall(hello_frame(1, LAYOUT.nbytes))
        assert closed_by_peer(raw)
    bump(model)
    assert scheme.send(worker_ids=[0]) == 1
    assert good.wait_version(1)["v"] == 1
    with pytest.raises(WorkerTimeoutError) as info:
        scheme.send(timeout=2.0)
    assert info.value.workers == [1]


def test_sender_survives_hostile_peers_and_keeps_serving(sender, spawn) -> None:
    scheme, model = sender(1, heartbeat=1.0)
    options = scheme.transport.options
    worker = spawn(0, options)
    scheme.connect()
    worker.wait_version(0)
    address = (options["host"], options["port"])
    hostile = {
        "random bytes": os.urandom(4096),
        "another protocol": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        "a delivery, the sender's own kind": prefix(Kind.DELIVER, 10, 10),
        "an oversized ack before hello": prefix(Kind.ACK, MAX_ACK_BYTES + 1) + b"x" * 1000,
        "a hello out of range": hello_frame(7, 0),
        "a hello of another version of the framing": hello_frame(0, LAYOUT.nbytes, version=1),
        "a hello without its body (wsync before the framing had a version)": prefix(Kind.HELLO, 0, LAYOUT.nbytes),
        "a frame of unknown kind": prefix(99, 1, 1),
    }
    peers = {}
    for what, data in hostile.items():
        peers[what] = socket.create_connection(address)
        peers[what].sendall(data)
    mute = socket.create_connection(address)  # connects and never speaks
    for what, peer in peers.items():
        assert closed_by_peer(peer), f"the sender kept a peer that sent {what}"
        peer.close()
    assert closed_by_peer(mute), "the sender kept a peer that never spoke past its heartbeat"
    mute.close()
    with socket.create_connection(address) as pinger:  # pings, but never says hello
        pinger.settimeout(0.3)
        end, closed = time.monotonic() + 30, False
        while not closed and time.monotonic() < end:
            try:
                pinger.sendall(prefix(Kind.PING))
                closed = pinger.recv(65536) == b""
            except TimeoutError:
                pass
            except OSError:  # reset, broken pipe: closed by the sender
                closed = True
        assert closed, "the sender kept a peer that only pinged"
    for v in (1, 2):
        bump(model)
        assert scheme.send() == v
        assert worker.wait_version(v)["v"] == v


def test_a_worker_that_breaks_the_protocol_is_dropped_as_left() -> None:
    with raw_sender(2, heartbeat=5.0) as (endpoint, address):
        with socket.create_connection(address) as one, socket.create_connection(address) as two:
            one.sendall(hello_frame(0, LAYOUT.nbytes))
            two.sendall(hello_frame(1, LAYOUT.nbytes))
            got = events_until(endpoint, lambda e: len(e) >= 2)
            assert sorted(e.worker for e in got if isinstance(e, Joined)) == [0, 1]
            one.sendall(prefix(Kind.ACK, MAX_ACK_BYTES + 1))  # an oversized ack
            two.sendall(prefix(Kind.ACK, 3) + b"ok!")
            got = events_until(endpoint, lambda e: any(isinstance(x, Left) for x in e))
            left = [e for e in got if isinstance(e, Left)]
            assert [e.worker for e in left] == [0] and "protocol violation" in left[0].reason, got
            assert closed_by_peer(one)
            # a reconnection under the same index: Joined again, and the old connection goes
            with socket.create_connection(address) as again:
                again.sendall(hello_frame(1, LAYOUT.nbytes))
                got = events_until(endpoint, lambda e: any(isinstance(x, Joined) for x in e))
                assert Joined(1) in got
                assert closed_by_peer(two)
    with pytest.raises(TransportError, match="closed"):
        endpoint.poll(Deadline(0))


def fake_sender(frames: bytes):
    """A listening socket that, for the first peer, reads its hello and answers ``frames``."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(PREFIX.size)
            conn.sendall(frames)
            time.sleep(2)

    threading.Thread(target=serve, daemon=True).start()
    return listener, port


@pytest.mark.parametrize("what, frames", [
    ("a payload larger than the model", prefix(Kind.DELIVER, 2, LAYOUT.nbytes + 1) + b"{}"),
    ("a header over the limit", prefix(Kind.DELIVER, (32 << 20) + 1, 0)),
    ("garbage", b"\x00" * 64),
    ("an ack, the receiver's own kind", prefix(Kind.ACK, 2) + b"{}"),
])
def test_a_receiver_refuses_a_hostile_sender(what: str, frames: bytes) -> None:
    listener, port = fake_sender(frames)
    endpoint = TcpTransport(port=port).receiver(ReceiverContext(0, LAYOUT, "policy", torch.device("cpu")))
    endpoint.open(Deadline(10))
    try:
        with pytest.raises(TransportError, match="broke the protocol"):
            endpoint.recv(Deadline(30))
    finally:
        endpoint.close()
        listener.close()


def test_a_smaller_payload_reaches_the_core_whole() -> None:
    """A payload smaller than the model (a delta, a cast, or another model) reaches the core as
    its bytes; the core checks them against the header and names any mismatch."""
    listener, port = fake_sender(prefix(Kind.DELIVER, 2, 8) + b"{}" + b"x" * 8)
    endpoint = TcpTransport(port=port).receiver(ReceiverContext(0, LAYOUT, "policy", torch.device("cpu")))
    endpoint.open(Deadline(10))
    try:
        delivery = endpoint.recv(Deadline(30))
        assert delivery.header == b"{}" and delivery.payload.device.type == "cpu"
        assert bytes(delivery.payload.numpy()) == b"x" * 8
    finally:
        endpoint.close()
        listener.close()


def test_a_stopped_worker_is_noticed_by_the_heartbeat(sender, spawn) -> None:
    scheme, model = sender(2, heartbeat=1.0)
    options = scheme.transport.options
    workers = [spawn(i, options) for i in range(2)]
    scheme.connect()
    for w in workers:
        w.wait_version(0)
    os.kill(workers[1].proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerTimeoutError) as info:
            bump(model)
            scheme.send()  # timeout 60 s: the heartbeat ends it long before
        assert info.value.workers == [1]
        assert time.monotonic() - t0 < 45
        assert workers[0].wait_version(1)["v"] == 1
    finally:
        os.kill(workers[1].proc.pid, signal.SIGCONT)
    # it comes back by itself and gets the latest version
    assert workers[1].wait_version(1)["v"] == 1


def test_a_killed_worker_is_left_at_once_even_if_a_forked_child_lives_on(sender, spawn) -> None:
    """The child's copies of the connection are closed at fork, so the kernel ends the connection
    with the worker: the sender reports it gone long before the (60 s) heartbeat."""
    scheme, model = sender(1, heartbeat=60.0)
    worker = spawn(0, scheme.transport.options, fork=True)
    scheme.connect()
    child = worker.next()["child"]
    worker.wait_version(0)
    try:
        worker.proc.kill()
        worker.proc.wait(30)
        bump(model)
        t0 = time.monotonic()
        with pytest.raises(WorkerTimeoutError) as info:
            scheme.send(timeout=120.0)
        assert info.value.workers == [0] and time.monotonic() - t0 < 45
    finally:
        os.kill(child, signal.SIGKILL)


def read_frame(sock: socket.socket, timeout: float = 30.0) -> tuple[int, int, bytes]:
    """The next frame other than a ping on ``sock``: (kind, a, body); raises EOFError if it closes first."""
    sock.settimeout(timeout)

    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise EOFError("closed")
            data += chunk
        return data

    while True:
        _, kind, a, _ = PREFIX.unpack(exactly(PREFIX.size))
        if kind != Kind.PING:
            return kind, a, exactly(a) if kind in (Kind.BYE, Kind.ACK) else b""


def reasons_until_closed(sock: socket.socket) -> list[bytes]:
    """The reasons of the BYEs that come on ``sock`` until the sender closes it (a BYE with a
    reason is a refusal for good; one without, or none, leaves a worker connecting again)."""
    reasons = []
    with pytest.raises(EOFError):
        while True:
            kind, _, body = read_frame(sock)
            if kind == Kind.BYE and body:
                reasons.append(body)
    return reasons


def test_frames_right_behind_a_hello_are_taken_as_the_worker_s() -> None:
    """A worker that reconnects while a version waits sends its hello, then a probe (or an ack)
    right behind it: one read takes them all, and the sender handles each in turn, never as out of turn."""
    with raw_sender(1, heartbeat=30.0) as (endpoint, address), socket.create_connection(address) as peer:
        peer.sendall(hello_frame(0, LAYOUT.nbytes) + prefix(Kind.PROBE, 5) + prefix(Kind.ACK, 2) + b"{}")
        got = events_until(endpoint, lambda e: len(e) >= 2)
        assert got[0] == Joined(0) and not any(isinstance(e, Left) for e in got), got
        assert read_frame(peer)[:2] == (Kind.ANSWER, 5)  # the probe was answered, the worker kept


def test_a_stranger_dropped_in_the_round_it_is_readable_leaves_the_sender_serving(sender, spawn) -> None:
    """A local peer holds as many connections as the sender keeps without a hello, then opens one
    more (the oldest is dropped) while the oldest has bytes waiting, both seen in one select: the
    sender serves what is left, never the dropped one, and its worker keeps getting versions."""
    from wsync_core.stream import _MAX_STRANGERS

    scheme, model = sender(1, authkey="s3cret")
    options = scheme.transport.options
    worker = spawn(0, options)
    scheme.connect()
    worker.wait_version(0)
    endpoint = scheme._role.endpoint  # its I/O thread is held between two selects below
    address = (options["host"], options["port"])
    strangers = [socket.create_connection(address) for _ in range(_MAX_STRANGERS)]
    try:
        deadline = Deadline(30)
        while len(endpoint.strangers) < _MAX_STRANGERS and not deadline.expired():
            time.sleep(0.01)
        assert len(endpoint.strangers) == _MAX_STRANGERS
        with endpoint.cond:  # the I/O thread wakes, then waits here: both events land in its next select
            endpoint._kick()
            time.sleep(0.2)
            strangers.append(socket.create_connection(address))  # ready first: served first, drops the oldest
            strangers[0].sendall(b"w")
            time.sleep(0.2)
        for v in (1, 2):
            bump(model)
            assert scheme.send(timeout=30.0) == v
            assert worker.wait_version(v)["v"] == v
        assert endpoint.failure is None
    finally:
        for s in strangers:
            s.close()


def test_a_stranger_dropped_for_newer_ones_is_not_refused_for_good() -> None:
    """The oldest connection without a hello, dropped when one too many came, is closed without a
    reason: a BYE with one tells a receiver it was refused for good, so a worker slow to say hello
    during a flood of strangers (an outside audit: one 30 ms away) stopped, and never came back."""
    from wsync_core.stream import _MAX_STRANGERS

    with raw_sender(1, heartbeat=30.0) as (endpoint, address):
        oldest = socket.create_connection(address)
        others = [socket.create_connection(address) for _ in range(_MAX_STRANGERS)]
        try:
            assert reasons_until_closed(oldest) == []
        finally:
            for s in [oldest, *others]:
                s.close()


def test_a_worker_of_another_trainers_scheme_is_told_and_never_takes_an_index() -> None:
    """A hello naming another origin (a worker pickled from another job's scheme, given this
    address) is refused with the reason, and the worker holding that index keeps it."""
    transport = TcpTransport(heartbeat=30.0)
    endpoint = transport.sender(SenderContext(1, LAYOUT, "policy", torch.device("cpu"), "a" * 16))
    endpoint.open(Deadline(10))
    try:
        address = (transport.options["host"], transport.options["port"])
        with socket.create_connection(address) as mine, socket.create_connection(address) as stray:
            mine.sendall(hello_frame(0, LAYOUT.nbytes, "a" * 16))
            assert events_until(endpoint, lambda e: len(e) >= 1) == [Joined(0)]
            stray.sendall(hello_frame(0, LAYOUT.nbytes, "b" * 16))
            kind, _, reason = read_frame(stray)
            assert kind == Kind.BYE and b"another trainer's scheme" in reason, reason
            assert closed_by_peer(stray)
            assert endpoint.poll(Deadline(0.5)) == []  # no Left, no Joined: worker 0 is still the first
    finally:
        endpoint.close()


def test_a_worker_whose_index_another_connection_took_is_told_and_stops() -> None:
    """Newest hello wins (a worker restarted while its old connection lingers), and the old
    connection is told why: a receiver still reading it stops for good (its receive() raises) instead
    of connecting again and taking the index back, over and over."""
    with raw_sender(1, heartbeat=30.0) as (endpoint, address):
        with socket.create_connection(address) as old, socket.create_connection(address) as new:
            old.sendall(hello_frame(0, LAYOUT.nbytes))
            assert events_until(endpoint, lambda e: len(e) >= 1) == [Joined(0)]
            new.sendall(hello_frame(0, LAYOUT.nbytes))
            assert events_until(endpoint, lambda e: len(e) >= 1) == [Joined(0)]
            kind, _, reason = read_frame(old)
            assert kind == Kind.BYE and b"took its place" in reason, reason
    model = make_model(0)
    scheme = WeightSyncScheme("tcp", timeout=30.0)
    scheme.init_on_sender(model=model, num_workers=1)
    receivers = [WeightSyncScheme(scheme.transport, timeout=30.0) for _ in range(2)]
    try:
        first, second = receivers
        first.init_on_receiver(model=make_model(7), worker_idx=0)
        connecting = threading.Thread(target=first.connect)
        connecting.start()
        scheme.connect()
        connecting.join()
        held = make_model(8)
        second.init_on_receiver(model=held, worker_idx=0)
        second.connect()
        bump(model)
        handle = scheme.send_async()
        assert second.receive(timeout=30.0) == 1 and handle.wait() == 1
        with pytest.raises(TransportError, match="took its place"):
            first.receive(timeout=30.0)
        bump(model)
        handle = scheme.send_async()
        assert second.receive(timeout=30.0) == 2 and handle.wait() == 2  # the index stays the new one's
    finally:
        for s in (*receivers, scheme):
            s.shutdown()


def test_a_worker_that_cannot_reach_the_sender_is_told_why_when_connect_times_out() -> None:
    """No one listens on the port: connect() says so and quotes the socket's error, not only that
    no weights came (the cause was in a debug log line)."""
    from wsync_core import free_port

    port = free_port("127.0.0.1")
    worker = WeightSyncScheme(TcpTransport(port=port), timeout=1.0)
    worker.init_on_receiver(model=make_model(0), worker_idx=0)
    try:
        with pytest.raises(WorkerTimeoutError, match=rf"tcp worker 0 of 127\.0\.0\.1:{port}: cannot reach the "
                                                     rf"sender: .*Connection refused"):
            worker.connect()
    finally:
        worker.shutdown()


def test_a_stranger_dropped_for_its_silence_is_not_refused_for_good() -> None:
    """A connection that does not answer the challenge within the heartbeat is closed without a
    reason (a BYE with one is a refusal for good: a worker slow to answer, its process stalled,
    stopped). A sender without an authkey tells one that says no hello: a worker waits for a
    challenge only when it has an authkey (``test_a_key_on_one_side_only_is_named``, unix)."""
    with raw_sender(1, heartbeat=1.0, authkey="k") as (endpoint, address), socket.create_connection(address) as silent:
        assert reasons_until_closed(silent) == []


def test_a_worker_whose_connection_ends_during_the_handshake_connects_again() -> None:
    """A sender that closes the connection after the worker answered its challenge, untold (it had
    too many strangers, or was restarting), is connected to again, after a pause that grows: the
    worker no longer stops for good blaming its authkey (an outside audit); a wrong key is told in
    a BYE (``test_auth_good_key_updates_wrong_key_and_no_key_refused``)."""
    from wsync_core import free_port
    from wsync_core.stream import frame

    listener = socket.create_server(("127.0.0.1", free_port("127.0.0.1")))
    attempts: list[float] = []

    def fake_sender() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                attempts.append(time.monotonic())
                with conn, contextlib.suppress(EOFError, OSError):
                    conn.sendall(frame(Kind.CHALLENGE, os.urandom(32)))
                    read_frame(conn, timeout=10.0)  # its response; then closed, untold

    threading.Thread(target=fake_sender, daemon=True).start()
    worker = WeightSyncScheme(TcpTransport(port=listener.getsockname()[1], authkey="right key"), timeout=3.0)
    worker.init_on_receiver(model=make_model(0), worker_idx=0)
    try:
        with pytest.raises(WorkerTimeoutError):
            worker.connect()
        # connecting again: more than once; with a pause, not hundreds of times in 3 s
        assert 3 <= len(attempts) <= 30, len(attempts)
    finally:
        worker.shutdown()
        listener.close()
