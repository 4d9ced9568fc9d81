"""The zmq transport with real sockets and real worker processes: sync, late join, restart, timeouts."""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import threading
import time
from collections.abc import Iterator

import pytest
import torch
import zmq

from wsync_core import SchemaMismatchError, TransportError, WeightSyncScheme, WorkerTimeoutError, list_transports
from wsync_zmq import ZmqTransport
from wsync_zmq import sender as zmq_sender
from zmq_helpers import digest, make_model


def bump(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)


@pytest.fixture
def sender():
    made: list[WeightSyncScheme] = []

    def build(num_workers: int = 2, model=None, **kw) -> WeightSyncScheme:
        kw.setdefault("timeout", 60.0)
        scheme = WeightSyncScheme("zmq", **kw)
        scheme.init_on_sender(model=make_model(0) if model is None else model, num_workers=num_workers)
        made.append(scheme)
        return scheme

    yield build
    for scheme in made:
        scheme.shutdown()


def test_registered_with_capabilities():
    info = {i.name: i for i in list_transports()}["zmq"]
    assert info.error is None and info.distribution == "wsync-zmq"
    assert {"multi_host", "auth", "late_join", "subset_send"} <= set(info.capabilities)


def test_options_are_checked_and_loopback_is_the_default():
    t = ZmqTransport()
    assert t.options["address"].startswith("tcp://127.0.0.1:") and t.checksum
    assert pickle.loads(pickle.dumps(t)).options == t.options
    with pytest.raises(ValueError, match="bind="):
        ZmqTransport(address="tcp://0.0.0.0:5555")
    with pytest.raises(ValueError, match="explicit port"):
        ZmqTransport(address="tcp://127.0.0.1:*")
    assert ZmqTransport(address="tcp://10.1.2.3:5555", bind="tcp://0.0.0.0:5555").options["bind"]
    with pytest.raises(ValueError, match="Z85"):
        ZmqTransport(curve_server_key="short")
    with pytest.raises(ValueError, match="curve_server_key"):
        ZmqTransport(curve_allowed_clients=["x" * 40])


def test_processes_sync_late_join_restart_and_a_dead_worker(sender, spawn):
    model = make_model(0)
    scheme = sender(2, model)
    options = scheme.transport.options
    w0 = spawn(0, options)
    scheme_blob = pickle.dumps(scheme)  # pickled after init: configuration only, same address
    assert pickle.loads(scheme_blob).transport.options["address"] == options["address"]
    w1 = spawn(1, options)
    scheme.connect()
    for w in (w0, w1):
        assert w.wait_version(0)["digest"] == digest(model)
    for v in (1, 2):
        bump(model)
        assert scheme.send() == v
        for w in (w0, w1):
            assert w.wait_version(v)["digest"] == digest(model)

    w1.kill()  # a worker dies: the next send costs only the timeout, and worker 0 is updated
    bump(model)
    with pytest.raises(WorkerTimeoutError) as info:
        scheme.send(timeout=20.0)  # returns once worker 0 acks: worker 1 is known gone
    assert info.value.workers == [1]
    assert w0.wait_version(3)["digest"] == digest(model)

    w1 = spawn(1, options)  # restarted: it gets the latest version at connect
    assert w1.wait_version(3)["digest"] == digest(model)
    bump(model)
    assert scheme.send() == 4
    for w in (w0, w1):
        assert w.wait_version(4)["digest"] == digest(model)
    assert scheme.send(worker_ids=[0]) == 5
    assert w0.wait_version(5)
    assert w0.errors() == [] and w1.errors() == []


@contextlib.contextmanager
def _independent_receiver(scheme: WeightSyncScheme, local, *, pickled: bool = False) -> Iterator[WeightSyncScheme]:
    """Worker 0 built from ``scheme``'s address alone (not unpickled; with ``pickled``, unpickled
    from it), connected with ``scheme`` in a thread of this process; shut down on the way out."""
    receiver = (pickle.loads(pickle.dumps(scheme)) if pickled
                else WeightSyncScheme("zmq", address=scheme.transport.options["address"], timeout=30.0))
    receiver.init_on_receiver(model=local, worker_idx=0)
    thread = threading.Thread(target=receiver.connect)
    thread.start()
    try:
        scheme.connect()
        thread.join(30)
        yield receiver
    finally:
        thread.join(30)
        receiver.shutdown()


def test_independent_receiver_builds_its_own_scheme(sender):
    model = make_model(0)
    scheme = sender(1, model, timeout=30.0)
    local = make_model(7)
    with _independent_receiver(scheme, local) as receiver:
        assert digest(local) == digest(model)
        bump(model)
        handle = scheme.send_async()
        assert receiver.receive(timeout=30.0) == 1
        assert handle.wait() == 1 and digest(local) == digest(model)


@pytest.mark.parametrize("kib", [4, 256])
def test_a_large_payload_is_adopted_a_small_one_copied_and_a_worker_write_stays_local(sender, kib):
    """Above 64 KiB the payload comes in a frame of its own, which the worker's model adopts (its
    tensor then views a new frame each version: no copy); a small one is copied into the model.
    Either way a write to the worker's model changes nothing the sender sends next."""
    model = {"w": torch.arange(kib * 256, dtype=torch.float32)}
    scheme = sender(1, model, timeout=30.0)
    local = {"w": torch.zeros(kib * 256)}
    with _independent_receiver(scheme, local) as receiver:
        addresses = [local["w"].data_ptr()]
        for v in (1, 2):
            model["w"].add_(1.0)
            handle = scheme.send_async()
            assert receiver.receive(timeout=30.0) == v and handle.wait() == v
            assert torch.equal(local["w"], model["w"])
            addresses.append(local["w"].data_ptr())
            local["w"].mul_(-1.0)  # the worker's own write: the next version overwrites it
        moved = [a != b for a, b in zip(addresses, addresses[1:])]  # (a freed frame's address may come back)
        assert moved == ([True, True] if kib > 64 else [False, False])


def test_a_worker_whose_index_another_process_took_over_is_told(sender):
    """Newest hello wins (a worker restarted on another host while its old connection lingers), and the
    old connection, if a process still reads it, is told: its receive() raises instead of waiting for
    versions that go to the new one."""
    model = make_model(0)
    scheme = sender(1, model, timeout=30.0)
    old_model = make_model(7)
    with _independent_receiver(scheme, old_model) as old:
        new_model = make_model(8)
        new = WeightSyncScheme("zmq", address=scheme.transport.options["address"], timeout=30.0)
        new.init_on_receiver(model=new_model, worker_idx=0)
        try:
            new.connect()  # the sender answers its hello with the version it holds
            bump(model)
            handle = scheme.send_async()
            assert new.receive(timeout=30.0) == 1 and handle.wait() == 1
            assert digest(new_model) == digest(model)
            held = digest(old_model)
            with pytest.raises(TransportError, match="took its place"):
                old.receive(timeout=30.0)
            with pytest.raises(TransportError, match="took its place"):
                old.receive(timeout=0.0)
            assert digest(old_model) == held
        finally:
            new.shutdown()


def test_a_worker_of_another_jobs_trainer_at_the_same_address_is_refused_and_says_so(sender):
    """Two copies of one script with a fixed address: job B's trainer cannot bind, but its workers,
    already started, reach job A's sender under the index of A's worker. A's sender refuses the
    hello (it carries B's origin): the stray's connect() raises naming another trainer's scheme,
    its model is untouched, and A's worker keeps its index and every version (it was pushed out
    before, and A's send then failed)."""
    model = make_model(0)
    a = sender(1, model, timeout=30.0)
    b = sender(1, make_model(3), timeout=30.0, address=a.transport.options["address"])
    mine = make_model(7)
    with _independent_receiver(a, mine, pickled=True) as receiver:
        stray_model = make_model(9)
        held = digest(stray_model)
        stray = pickle.loads(pickle.dumps(b))
        stray.init_on_receiver(model=stray_model, worker_idx=0)
        try:
            with pytest.raises(TransportError, match=r"belongs to another trainer's scheme .* Give each job its own "
                                                     r"address"):
                stray.connect(timeout=30.0)
            assert digest(stray_model) == held and stray.version == -1
            bump(model)
            handle = a.send_async()
            assert receiver.receive(timeout=30.0) == 1 and handle.wait(timeout=30.0) == 1
            assert digest(mine) == digest(model)
        finally:
            stray.shutdown()


def test_a_hello_the_sender_cannot_read_is_answered_with_why(sender):
    """A worker of another wsync release (another protocol) is refused with a reason naming the
    protocols, as an index out of range is, instead of waiting out its connect()."""
    import json

    scheme = sender(1, make_model(0), timeout=30.0)
    outcome: list[BaseException] = []

    def connect() -> None:
        try:
            scheme.connect(timeout=3.0)
        except WorkerTimeoutError as exc:  # no worker of this protocol came: what the test expects
            outcome.append(exc)

    connecting = threading.Thread(target=connect, daemon=True)
    connecting.start()
    ctx = zmq.Context()
    peer = ctx.socket(zmq.DEALER)
    try:
        peer.setsockopt(zmq.LINGER, 0)
        peer.connect(scheme.transport.options["address"])
        peer.send(b"H" + json.dumps({"wsync": 2, "w": 0, "m": "policy", "d": "ab", "n": 4}).encode())
        assert peer.poll(30_000), "the sender never answered a hello of another protocol"
        answer = peer.recv()
        assert answer.startswith(b"X") and b"hello is of wsync protocol 2, this side speaks protocol 1" in answer
    finally:
        peer.close()
        ctx.term()
        connecting.join(30)
    assert len(outcome) == 1


def test_schema_mismatch_is_reported_without_sending_the_payload(sender):
    scheme = sender(1, make_model(0, width=8), timeout=20.0)
    wrong = make_model(1, width=5)
    receiver = WeightSyncScheme("zmq", address=scheme.transport.options["address"], timeout=20.0)
    receiver.init_on_receiver(model=wrong, worker_idx=0)
    before = digest(wrong)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            receiver.connect()
        except SchemaMismatchError as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        with pytest.raises(SchemaMismatchError):
            scheme.connect()
    finally:
        thread.join(30)
        receiver.shutdown()
    assert errors and "0.weight" in str(errors[0]) and digest(wrong) == before


def test_shutdown_leaves_no_thread_or_descriptor(sender):
    def fds() -> int:
        gc.collect()  # descriptors of earlier tests' garbage (a map awaiting collection) close here, not mid-test
        return len(os.listdir("/proc/self/fd"))

    threads, before = set(threading.enumerate()), fds()
    model = make_model(0)
    scheme = sender(1, model, timeout=30.0)
    receiver = pickle.loads(pickle.dumps(scheme))
    receiver.init_on_receiver(model=make_model(1), worker_idx=0)
    thread = threading.Thread(target=receiver.connect)
    thread.start()
    scheme.connect()
    thread.join(30)
    bump(model)
    scheme.send_async()
    assert receiver.receive(timeout=30.0) == 1
    receiver.shutdown()
    scheme.shutdown()
    assert set(threading.enumerate()) <= threads
    assert fds() == before


def test_endpoints_closed_or_never_opened_raise_transport_error():
    """The endpoint base's lifecycle: every call before open or after close raises TransportError,
    close is idempotent, and a woken sender's poll returns at once."""
    from wsync_core import TransportError
    from wsync_core.deadline import Deadline
    from wsync_core.layout import Layout
    from wsync_core.transport import ReceiverContext, SenderContext
    from wsync_core.weights import flatten

    layout = Layout.of(flatten(make_model(0)))
    transport = ZmqTransport()
    sender = transport.sender(SenderContext(1, layout, "policy", torch.device("cpu")))
    receiver = transport.receiver(ReceiverContext(0, layout, "policy", torch.device("cpu")))
    with pytest.raises(TransportError, match="not open"):
        receiver.recv(Deadline(0.0))
    sender.open(Deadline(10))
    receiver.open(Deadline(10))
    sender.wake()
    t0 = time.monotonic()
    sender.poll(Deadline(30.0))  # woken: returns at once, not after 30 s
    assert time.monotonic() - t0 < 15
    for endpoint in (receiver, sender):
        endpoint.close()
        endpoint.close()
    with pytest.raises(TransportError, match="closed"):
        receiver.recv(Deadline(0.0))
    with pytest.raises(TransportError, match="closed"):
        receiver.ack(b"{}")
    with pytest.raises(TransportError, match="closed"):
        sender.poll(Deadline(0.0))
    with pytest.raises(TransportError, match="closed"):
        sender.acquire(Deadline(0.0))


def test_a_receiver_whose_start_fails_raises_its_error_and_closes(monkeypatch):
    """A receiver whose start fails after it made its context and socket (configuring the socket
    fails: out of descriptors, say) raises that failure from open, and its close frees them. Its stop
    read the monitor it never made: close raised AttributeError ('NoneType' object has no attribute
    'get'), which hid the failure, and the context was never ended."""
    import errno

    from wsync_core.deadline import Deadline
    from wsync_core.layout import Layout
    from wsync_core.transport import ReceiverContext
    from wsync_core.weights import flatten
    from wsync_zmq import receiver as zmq_receiver

    made: list[zmq.Socket] = []

    def fail(sock, *args, **kwargs):
        made.append(sock)
        raise zmq.ZMQError(errno.EMFILE)

    monkeypatch.setattr(zmq_receiver, "configure", fail)
    layout = Layout.of(flatten(make_model(0)))
    receiver = ZmqTransport().receiver(ReceiverContext(0, layout, "policy", torch.device("cpu")))
    with pytest.raises(zmq.ZMQError) as caught:
        receiver.open(Deadline(10))
    assert caught.value.errno == errno.EMFILE
    assert len(made) == 1 and made[0].closed and made[0].context.closed
    receiver.close()  # idempotent


def test_a_version_that_takes_longer_than_the_heartbeat_to_cross_arrives(sender, monkeypatch):
    """A payload whose transfer lasts longer than ``heartbeat`` (a large model on a slow link)
    reaches the worker: the link is alive while its bytes flow. It never did: ZMQ's heartbeats
    count only whole messages as traffic, so the worker closed the connection mid-payload, again
    at every try (a 32 MiB model on 20 Mbit/s links with the default 10 s never arrived). Here a
    small send buffer on the sender slows loopback to about 2 MB/s, and the heartbeat is 0.3 s."""
    plain = zmq_sender.configure

    def slow(sock, *args, **kwargs):
        plain(sock, *args, **kwargs)
        sock.setsockopt(zmq.SNDBUF, 8192)

    monkeypatch.setattr(zmq_sender, "configure", slow)
    model = torch.nn.Linear(1024, 1024)  # 4 MiB: about 2 s here
    scheme = sender(1, model, heartbeat=0.3, timeout=60.0)
    receiver = pickle.loads(pickle.dumps(scheme))  # the same options, the heartbeat included
    local = torch.nn.Linear(1024, 1024)
    receiver.init_on_receiver(model=local, worker_idx=0)
    thread = threading.Thread(target=receiver.connect, kwargs={"timeout": 60.0})
    thread.start()
    try:
        scheme.connect(timeout=60.0)
        thread.join(60)
        assert torch.equal(local.weight, model.weight)
        bump(model)
        handle = scheme.send_async()
        assert receiver.wait_for_version(1, timeout=60.0) == 1
        assert handle.wait(60.0) == 1 and torch.equal(local.weight, model.weight)
    finally:
        thread.join(60)
        receiver.shutdown()
