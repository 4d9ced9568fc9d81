"""The endpoint bases: lifecycle and closed guard, events, the buffer pool, the newest-only mailbox and its probe."""

from __future__ import annotations

import math
import pickle
import select
import sys
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from wsync_core import (AckPusher, Acked, Buffer, Deadline, Delivery, Joined, Layout, ReceiverBase, ReceiverContext, SenderBase,
                        SenderContext, TransportError, Wakeup, WorkerTimeoutError)
from wsync_core.protocol import MAX_HEADER_BYTES

LAYOUT = Layout.of({"w": torch.zeros(4)})


class Sender(SenderBase):
    def __init__(self, n: int = 1, **kw) -> None:
        super().__init__("test sender", SenderContext(n, LAYOUT, "m", torch.device("cpu")), **kw)
        self.started = self.stopped = 0
        self.sent: list[tuple[int, bytes, list[int]]] = []
        self.used: list[int] = []

    def start(self, deadline: Deadline) -> None:
        self.started += 1

    def stop(self) -> None:
        self.stopped += 1

    def deliver(self, buffer, header, workers) -> None:
        self.sent.append((buffer.index, header, workers))
        self.used.append(buffer.used)
        for w in workers:
            self.hold(buffer, w)


class Receiver(ReceiverBase):
    def __init__(self) -> None:
        super().__init__("test receiver", ReceiverContext(0, LAYOUT, "m", torch.device("cpu")))
        self.acks: list[bytes] = []

    def ack(self, data: bytes) -> None:
        self.check_open()
        self.acks.append(data)


def test_deadline_timeouts_never_overflow() -> None:
    forever = Deadline(math.inf)
    assert forever.seconds() is None and forever.milliseconds() == -1
    assert 0 < Deadline(0.5).seconds() <= 0.5 and Deadline(0.0015).milliseconds() in (1, 2)
    assert Deadline(0).milliseconds() == 0
    for huge in (sys.maxsize, 1e10, 2.0**70):  # (an outside audit: OverflowError from select and time_t)
        assert Deadline(huge).seconds() is None and Deadline(huge).milliseconds() == -1


@pytest.mark.parametrize("transport", ["inproc", "shm", "mp"])
def test_a_huge_timeout_waits_as_forever_does(transport: str) -> None:
    """``receive(timeout=sys.maxsize)`` and a scheme's ``timeout=1e10`` wait as ``math.inf`` does
    (here: until a version comes), never raising OverflowError from the clock's range."""
    from wsync_core import WeightSyncScheme

    sender = WeightSyncScheme(transport, timeout=1e10)
    sender.init_on_sender(model={"w": torch.ones(4)}, num_workers=1)
    worker = pickle.loads(pickle.dumps(sender))
    worker.init_on_receiver(model={"w": torch.zeros(4)}, worker_idx=0)
    try:
        joined = threading.Thread(target=worker.connect)
        joined.start()
        sender.connect()
        joined.join()
        threading.Timer(0.2, sender.send).start()
        assert worker.receive(timeout=sys.maxsize) == 1
    finally:
        worker.shutdown()
        sender.shutdown()


def test_a_wakeup_ends_a_select_from_another_thread_and_stays_set() -> None:
    """``set()`` from another thread makes a select on ``fd`` return; a set before ``open()``
    leaves the new descriptor readable; ``close()`` is idempotent and the flag stays."""
    w = Wakeup()
    fd = w.open()
    assert not w.is_set and select.select([fd], [], [], 0)[0] == []
    threading.Timer(0.05, w.set).start()
    assert select.select([fd], [], [], 60.0)[0] == [fd] and w.is_set
    w.close()
    w.close()
    w.set()  # after close: only the flag
    assert w.is_set and w.fd == -1
    early = Wakeup()
    early.set()
    assert select.select([early.open()], [], [], 0)[0] == [early.fd]
    early.close()


def test_calls_before_open_and_after_close_raise_naming_the_transport() -> None:
    s = Sender()
    with pytest.raises(TransportError, match="test sender is not open"):
        s.poll(Deadline(0))
    s.close()  # before open: harmless, no stop()
    assert s.stopped == 0
    s.open(Deadline(1))
    s.close()
    s.close()
    assert (s.started, s.stopped) == (1, 1)
    for call in (lambda: s.poll(Deadline(0)), lambda: s.acquire(Deadline(0))):
        with pytest.raises(TransportError, match="test sender is closed"):
            call()
    s.open(Deadline(1))  # the core may retry connect() on the same endpoint
    assert s.is_open and s.started == 2
    s.close()
    r = Receiver()
    r.open(Deadline(1))
    r.close()
    for call in (lambda: r.recv(Deadline(0)), lambda: r.ack(b"x")):
        with pytest.raises(TransportError, match="test receiver is closed"):
            call()


def test_a_failing_start_closes() -> None:
    class Broken(Sender):
        def start(self, deadline):
            raise TransportError("cannot bind")

    s = Broken()
    with pytest.raises(TransportError, match="cannot bind"):
        s.open(Deadline(1))
    assert not s.is_open and s.stopped == 1


def test_poll_waits_for_an_event_from_another_thread_and_close_wakes_it() -> None:
    s = Sender()
    s.open(Deadline(1))
    assert s.poll(Deadline(0)) == []
    threading.Timer(0.05, s.emit, (Joined(0),)).start()
    assert s.poll(Deadline(math.inf)) == [Joined(0)]
    s.emit(Acked(0, b"a"))
    s.emit(Acked(0, b"b"))
    assert s.poll(Deadline(0)) == [Acked(0, b"a"), Acked(0, b"b")]
    threading.Timer(0.05, s.close).start()
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="closed"):
        s.poll(Deadline(math.inf))
    assert time.monotonic() - t0 < 20


def test_buffer_pool_hands_out_buffers_hold_and_latest() -> None:
    s = Sender(n=1, max_buffers=2)
    s.open(Deadline(1))
    a = s.acquire(Deadline(0))
    assert isinstance(a, Buffer) and a.index == 0 and a.tensor.numel() == LAYOUT.nbytes == a.used
    assert s.acquire(Deadline(0)) is a  # given up (no publish): handed out again
    s.publish(a, b"h1", [0])
    b = s.acquire(Deadline(0))
    assert b is not a  # never the latest
    with pytest.raises(TransportError, match="did not return"):
        s.publish(torch.empty(LAYOUT.nbytes, dtype=torch.uint8), b"h", [0])
    with pytest.raises(TransportError, match="did not return"):
        s.publish(Buffer(torch.empty(LAYOUT.nbytes, dtype=torch.uint8), 1), b"h", [0])  # not this pool's
    with pytest.raises(TransportError, match="exceeds the limit"):
        s.publish(b, b"x" * (MAX_HEADER_BYTES + 1), [0])
    b.used = LAYOUT.nbytes + 1
    with pytest.raises(TransportError, match="used="):
        s.publish(b, b"h", [0])
    b.used = 3  # the core filled a prefix: deliver() sees it, and the payload is those bytes
    s.publish(b, b"h2", [0])
    assert s.sent == [(0, b"h1", [0]), (1, b"h2", [0])] and s.used == [LAYOUT.nbytes, 3]
    assert b.payload.numel() == 3 and b.payload.data_ptr() == b.tensor.data_ptr()
    with pytest.raises(WorkerTimeoutError) as info:  # a is held by worker 0, b is the latest
        s.acquire(Deadline(0.05))
    assert info.value.workers == [0]
    threading.Timer(0.05, s.let_go, (s.buffers[0], 0)).start()
    assert s.acquire(Deadline(math.inf)) is a
    s.close()


def test_mailbox_keeps_the_newest_and_releases_the_older() -> None:
    r = Receiver()
    r.open(Deadline(1))
    released = []
    for i in range(3):
        r.put(Delivery(b"%d" % i, torch.zeros(0, dtype=torch.uint8), release=lambda i=i: released.append(i)))
    assert released == [0, 1]
    assert r.recv(Deadline(0)).header == b"2"
    assert r.recv(Deadline(0.01)) is None
    r.put(Delivery(b"3", torch.zeros(0, dtype=torch.uint8)))
    r.fail("the sender is gone")
    assert r.recv(Deadline(0)).header == b"3"  # what came before the failure is delivered first
    with pytest.raises(TransportError, match="the sender is gone"):
        r.recv(Deadline(0))
    r.close()


def test_a_numbered_delivery_that_arrives_late_never_replaces_a_newer_one() -> None:
    """Numbered deliveries may arrive out of order (a pool of I/O threads): an older one put after a
    newer one is released at once and the mailbox keeps the newer; unnumbered ones always replace."""
    r = Receiver()
    r.open(Deadline(1))
    released = []

    def put(n: int, number: int) -> None:
        r.put(Delivery(b"%d" % n, torch.zeros(0, dtype=torch.uint8), release=lambda: released.append(n)), number)

    put(5, 5)
    put(3, 3)  # late
    assert released == [3]
    assert r.recv(Deadline(0)).header == b"5"
    put(4, 4)  # late, with the mailbox empty: still dropped
    assert released == [3, 4] and r.recv(Deadline(0.01)) is None
    put(6, 6)
    put(7, -1)  # not numbered: replaces
    assert released == [3, 4, 6] and r.recv(Deadline(0)).header == b"7"
    r.close()


def test_wake_ends_a_wait_in_another_thread_and_every_later_one() -> None:
    r, s = Receiver(), Sender()
    r.open(Deadline(1))
    s.open(Deadline(1))
    for endpoint in (r, s):
        threading.Timer(0.05, endpoint.wake).start()
    t0 = time.monotonic()
    assert r.recv(Deadline(math.inf)) is None
    assert s.poll(Deadline(math.inf)) == []
    assert r.recv(Deadline(math.inf)) is None and s.poll(Deadline(math.inf)) == []
    assert time.monotonic() - t0 < 20
    r.close()
    s.close()


def test_wake_ends_a_wait_for_a_free_buffer_with_transport_error_not_a_timeout() -> None:
    s = Sender(n=1, max_buffers=2)
    s.open(Deadline(1))
    for _ in range(2):  # both buffers held by worker 0
        s.publish(s.acquire(Deadline(0)), b"h", [0])
    threading.Timer(0.05, s.wake).start()
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="woken while waiting for a free buffer: the scheme is shutting down"):
        s.acquire(Deadline(60))
    assert time.monotonic() - t0 < 20  # (it read "still held by workers [0] after 60 s", at once)
    s.close()


class Probing(Receiver):
    """A receiver whose sender published deliveries up to ``published``; ``newest_published``
    answers that and lets ``in_flight`` (the numbers not yet put) arrive from another thread."""

    def __init__(self, published: int | None, in_flight: list[int], patience: float = math.inf) -> None:
        super().__init__()
        self.published, self.in_flight = published, in_flight
        self.probe_patience = patience
        self.asked = 0
        self.courier: threading.Thread | None = None

    def newest_published(self, deadline: Deadline) -> int | None:
        self.asked += 1
        self.courier = threading.Thread(target=self._bring, daemon=True)
        self.courier.start()
        return self.published

    def _bring(self) -> None:
        for n in self.in_flight:
            time.sleep(0.01)  # the recv is waiting by now, most likely: either way it must get the newest
            self.put(_numbered(n), n)


def _numbered(n: int) -> Delivery:
    return Delivery(b"%d" % n, torch.zeros(0, dtype=torch.uint8))


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 5), st.integers(0, 4))
def test_a_waiting_delivery_is_returned_only_once_the_newest_published_is_in(waiting: int, in_flight: int) -> None:
    """A delivery waited when recv was called; the sender had published ``in_flight`` newer ones:
    recv returns the newest of them, never the one that waited (nor one in between)."""
    r = Probing(waiting + in_flight, list(range(waiting + 1, waiting + in_flight + 1)))
    r.open(Deadline(1))
    r.put(_numbered(waiting), waiting)
    assert r.recv(Deadline(60)).header == b"%d" % (waiting + in_flight)
    assert r.asked == 1
    r.close()


def test_no_probe_when_nothing_waited_or_no_time_is_left() -> None:
    r = Probing(5, [5])
    r.open(Deadline(1))
    threading.Timer(0.05, r.put, (_numbered(4), 4)).start()
    assert r.recv(Deadline(60)).header == b"4"  # it came during the call: taken at once, nobody asked
    assert r.asked == 0
    r.put(_numbered(4), 4)
    assert r.recv(Deadline(0)).header == b"4"  # no time to ask: what arrived
    assert r.asked == 0
    r.close()


def test_a_probe_that_cannot_tell_or_a_newest_that_never_comes_returns_what_arrived() -> None:
    for r in (Probing(None, []), Probing(9, [], patience=0.1)):
        r.open(Deadline(1))
        r.put(_numbered(4), 4)
        assert r.recv(Deadline(60)).header == b"4"
        assert r.asked == 1
        r.close()


def test_close_or_wake_ends_the_wait_for_the_newest() -> None:
    r = Probing(9, [])
    r.open(Deadline(1))
    r.put(_numbered(4), 4)
    threading.Timer(0.1, r.wake).start()
    assert r.recv(Deadline(math.inf)).header == b"4"  # woken: what arrived
    r.close()


class Stuck(Receiver):
    """A receiver whose question to its sender blocks (a client on a cut link) until ``unblock``."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0
        self.unblock = threading.Event()

    def newest_published(self, deadline: Deadline) -> int | None:
        self.asked += 1
        self.unblock.wait(60)
        return 9


def _probe_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("wsync-probe")]


def test_a_probe_blocked_on_a_cut_link_holds_no_recv_past_its_deadline() -> None:
    """The question blocks (a store client on a cut link waits for TCP to give up: it made a
    distributed worker's ``receive(timeout=0.5)`` take 5.5 s): recv returns what arrived at its
    deadline; while that call is out, a later recv asks nothing and returns at once; once it
    returns, the next recv asks again; close ends the probe thread."""
    r = Stuck()
    r.open(Deadline(1))
    r.put(_numbered(4), 4)
    t0 = time.monotonic()
    assert r.recv(Deadline(0.3)).header == b"4"
    assert time.monotonic() - t0 < 10 and r.asked == 1  # (it took 60 s: the plugin's own bound)
    r.put(_numbered(5), 5)
    t0 = time.monotonic()
    assert r.recv(Deadline(30)).header == b"5"  # the first call is still out: no second one
    assert time.monotonic() - t0 < 10 and r.asked == 1
    r.unblock.set()
    r.put(_numbered(9), 9)
    deadline = time.monotonic() + 10
    while r._asking is not None and time.monotonic() < deadline:  # (the first call's answer, 9, came late)
        time.sleep(0.01)
    assert r.recv(Deadline(30)).header == b"9" and r.asked == 2
    assert len(_probe_threads()) == 1
    r.close()
    assert _probe_threads() == []


def test_a_receiver_without_a_probe_starts_no_thread() -> None:
    r = Receiver()
    r.open(Deadline(1))
    r.put(_numbered(4), 4)
    assert r.recv(Deadline(1)).header == b"4"
    assert _probe_threads() == []
    r.close()


def _ack_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("wsync-ack")]


def test_acks_are_pushed_in_order_from_a_thread_and_put_never_waits(caplog: pytest.LogCaptureFixture) -> None:
    """A push that blocks (an RPC waiting for its reply, a store client on a cut link) holds no
    ``put``; the acks land in the order given once it returns; close lets the pending ones go
    first; a push that fails (or raises anything else: a plugin's bug) drops that ack, with a warning
    naming it, and the next ones go."""
    pushed: list[bytes] = []
    gate = threading.Event()

    def push(data: bytes) -> None:
        if data == b"1":
            gate.wait(30)
        if data == b"3":
            raise TransportError("link cut")
        if data == b"4":
            raise ValueError("a bug")
        pushed.append(data)

    acks = AckPusher(push, "test worker 0")
    assert _ack_threads() == []  # (none before the first ack)
    t0 = time.monotonic()
    for i in range(1, 6):
        acks.put(b"%d" % i)
    assert time.monotonic() - t0 < 5 and pushed == []  # the first push is blocked: no put waited for it
    gate.set()
    acks.close(30)
    assert pushed == [b"1", b"2", b"5"] and _ack_threads() == []
    assert "test worker 0: an ack did not reach the sender and was dropped: link cut" in caplog.text
    assert "test worker 0: pushing an ack raised ValueError, and it was dropped: a bug" in caplog.text


def test_close_drops_the_pending_acks_when_told_and_never_waits_past_its_timeout() -> None:
    pushed: list[bytes] = []
    gate = threading.Event()
    acks = AckPusher(lambda data: (gate.wait(30), pushed.append(data)), "test worker 0")
    acks.put(b"1")
    deadline = time.monotonic() + 10
    while acks.pending and time.monotonic() < deadline:  # "1" taken by the thread, blocked in push
        time.sleep(0.01)
    acks.put(b"2")
    t0 = time.monotonic()
    acks.close(0.2, deliver=False)  # the sender is gone: "2" is dropped; "1" is still being pushed
    assert time.monotonic() - t0 < 5
    gate.set()
    deadline = time.monotonic() + 10
    while _ack_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pushed == [b"1"] and _ack_threads() == []
    acks.put(b"3")  # a later put starts a new thread
    acks.close(30)
    assert pushed == [b"1", b"3"] and _ack_threads() == []


def test_at_most_64_acks_wait_and_the_oldest_go_first() -> None:
    pushed: list[bytes] = []
    gate = threading.Event()

    def push(data: bytes) -> None:
        gate.wait(30)
        pushed.append(data)

    acks = AckPusher(push, "test worker 0")
    acks.put(b"0")
    deadline = time.monotonic() + 10
    while acks.pending and time.monotonic() < deadline:  # "0" taken by the thread, blocked in push
        time.sleep(0.01)
    for i in range(1, 101):
        acks.put(b"%d" % i)
    gate.set()
    acks.close(30)
    assert pushed == [b"0"] + [b"%d" % i for i in range(37, 101)]
