"""The byte-stream base: its framing (what is written reads back; anything else is a Violation,
checked before a byte of it is allocated), a stream that is not a socket, streams cut at any
byte, and a receive or a send that never waits for the I/O thread's reads or writes (wsync-tcp
and wsync-unix test the rest with real sockets)."""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from core_helpers import connect_both
from wsync_core import (Capabilities, Deadline, Layout, ReceiverContext, SenderContext, StreamReceiver, StreamSender,
                        Transport, TransportError, WeightSyncScheme)
from wsync_core import stream as stream_module
from wsync_core.protocol import MAX_ACK_BYTES, MAX_HEADER_BYTES
from wsync_core.stream import HELLO_BODY, STREAM_VERSION, Kind, Violation, _Reader, frame, hello_frame

ALL = frozenset(range(1, 9))


def reader_over(data: bytes, payload_max: int, sizes: list[int]):
    """A reader of ``data`` (in chunks of at most 7 bytes) whose sink records what it is asked for."""
    pos = 0

    def read_into(view: memoryview) -> int:
        nonlocal pos
        n = min(len(view), 7, len(data) - pos)
        if n == 0:
            raise EOFError  # end of the test's bytes
        view[:n] = data[pos:pos + n]
        pos += n
        return n

    def sink(size: int) -> torch.Tensor:
        sizes.append(size)
        return torch.empty(size, dtype=torch.uint8)

    reader = _Reader(payload_max, sink)
    reader.accept = ALL
    return reader, read_into


def read_all(data: bytes, payload_max: int, sizes: list[int]) -> list:
    reader, read_into = reader_over(data, payload_max, sizes)
    frames = []
    while True:
        try:
            _, got = reader.read(read_into)
        except EOFError:
            return frames
        if got is not None:
            frames.append(got)


@given(header=st.binary(max_size=300), payload=st.binary(max_size=300), ack=st.binary(max_size=300),
       worker=st.integers(0, 0xFFFF), origin=st.text("0123456789abcdef", max_size=16))
def test_frames_read_back(header: bytes, payload: bytes, ack: bytes, worker: int, origin: str) -> None:
    data = (hello_frame(worker, len(payload), origin) + frame(Kind.DELIVER, header, len(header), len(payload))
            + payload + frame(Kind.ACK, ack) + frame(Kind.PING) + frame(Kind.BYE, b"reason"))
    frames = read_all(data, len(payload), [])
    assert [f.kind for f in frames] == [Kind.HELLO, Kind.DELIVER, Kind.ACK, Kind.PING, Kind.BYE]
    version, got_worker, nbytes, got_origin = HELLO_BODY.unpack(frames[0].body)
    assert (version, got_worker, nbytes, got_origin.rstrip(b"\0").decode()) == (STREAM_VERSION, worker, len(payload),
                                                                                 origin)
    assert frames[1].body == header
    assert (bytes(frames[1].payload.numpy()) if payload else frames[1].payload) == (payload or None)
    assert frames[2].body == ack and frames[4].body == b"reason"


@settings(max_examples=300)
@given(data=st.binary(min_size=16, max_size=200), payload_max=st.integers(0, 64))
def test_garbage_is_a_violation_and_never_allocates_past_the_limits(data: bytes, payload_max: int) -> None:
    sizes: list[int] = []
    try:
        read_all(data, payload_max, sizes)
    except Violation:
        pass
    assert all(s <= payload_max for s in sizes)


def test_sizes_over_the_limits_are_refused_from_the_prefix_alone() -> None:
    for data in (frame(Kind.DELIVER, a=MAX_HEADER_BYTES + 1, b=0), frame(Kind.DELIVER, a=0, b=11),
                 frame(Kind.ACK, a=MAX_ACK_BYTES + 1), frame(Kind.CHALLENGE, a=31), frame(99),
                 b"XX" + frame(Kind.PING)[2:]):
        try:
            read_all(data, 10, [])
        except Violation:
            continue
        raise AssertionError(f"{data[:16]!r} was accepted")
    reader, read_into = reader_over(frame(Kind.ACK, b"x"), 0, [])
    reader.accept = frozenset({Kind.HELLO})  # out of turn
    try:
        reader.read(read_into)
        reader.read(read_into)
        reader.read(read_into)
    except Violation:
        return
    raise AssertionError("an ack out of turn was accepted")


class _Pipe:
    """A stream that is not a socket object: a descriptor read and written with os.read/os.write."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def fileno(self) -> int:
        return self.fd

    def send(self, data: memoryview) -> int:
        return os.write(self.fd, data)

    def recv_into(self, view: memoryview) -> int:
        chunk = os.read(self.fd, len(view))
        view[:len(chunk)] = chunk
        return len(chunk)

    def close(self) -> None:
        os.close(self.fd)


class _Listener:
    """Hands out one end of a new socketpair per connect() as a _Pipe, woken through an eventfd that
    counts the connects waiting (a semaphore: each accept() takes one, and it stays readable while
    more wait, as a listening socket does)."""

    def __init__(self, channel: str) -> None:
        self.channel = channel
        self.waiting: list[int] = []
        self.bell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC | os.EFD_SEMAPHORE)
        _listeners[channel] = self

    def fileno(self) -> int:
        return self.bell

    def accept(self):
        os.eventfd_read(self.bell)
        return _Pipe(self.waiting.pop(0)), None

    def close(self) -> None:
        """Stop listening: a receiver connecting later is refused, as by a closed socket (one of
        the next test on the same channel must not reach this one)."""
        if _listeners.get(self.channel) is self:
            del _listeners[self.channel]
        os.close(self.bell)

    def connect(self) -> _Pipe:
        ours, theirs = socket.socketpair()
        self.waiting.append(theirs.detach())
        os.eventfd_write(self.bell, 1)
        return _Pipe(ours.detach())


_listeners: dict[str, _Listener] = {}


class PipeTransport(Transport):
    """The byte-stream base over descriptors the base knows nothing about (no socket objects)."""

    name = "pipes"
    interface = 2
    capabilities = Capabilities(processes=False)

    def __init__(self, *, channel: str = "pipes") -> None:
        super().__init__(channel=channel)

    def sender(self, ctx: SenderContext) -> StreamSender:
        channel = self.options["channel"]

        class Sender(StreamSender):
            def listen(self) -> _Listener:
                return _Listener(channel)

        return Sender("pipes sender", ctx)

    def receiver(self, ctx: ReceiverContext) -> StreamReceiver:
        channel = self.options["channel"]

        class Receiver(StreamReceiver):
            def connect(self, timeout: float) -> _Pipe:
                listener = _listeners.get(channel)
                if listener is None:
                    raise ConnectionRefusedError("no sender listens")
                return listener.connect()

        return Receiver(f"pipes worker {ctx.worker_idx}", ctx)


def test_a_stream_that_is_not_a_socket() -> None:
    sender = WeightSyncScheme(PipeTransport(), timeout=30.0)
    model, theirs = nn.Linear(4, 3), nn.Linear(4, 3)
    sender.init_on_sender(model=model, num_workers=1)
    receiver = WeightSyncScheme(PipeTransport(), timeout=30.0)
    receiver.init_on_receiver(model=theirs, worker_idx=0)
    done = threading.Event()

    def work() -> None:
        receiver.connect()
        while not done.is_set():
            receiver.receive(timeout=0.05)
        receiver.shutdown()

    t = threading.Thread(target=work)
    t.start()
    try:
        sender.connect()
        with torch.no_grad():
            model.weight.add_(1.0)
        assert sender.send() == 1
        assert torch.equal(model.weight, theirs.weight)
    finally:
        done.set()
        t.join(30)
        sender.shutdown()


class _Gate:
    """Holds the next call that passes through it once armed, until opened."""

    def __init__(self) -> None:
        self.armed = False
        self.entered, self.opened = threading.Event(), threading.Event()

    def pass_through(self) -> None:
        """Wait here until the gate opens, if it is armed (it disarms: one call waits)."""
        if self.armed:
            self.armed = False
            self.entered.set()
            self.opened.wait(60)

    def send_through(self, model: nn.Linear, sender: WeightSyncScheme):
        """Arm this gate, change ``model`` and ``send_async()`` it; once the gate holds the
        version's bytes, the send's handle."""
        self.armed = True
        with torch.no_grad():
            model.weight.add_(1.0)
        handle = sender.send_async()
        assert self.entered.wait(30), "the version's bytes never reached the gate"
        return handle

    def returns_while_held(self, call: threading.Thread) -> bool:
        """Start ``call`` while this gate holds the I/O thread; whether it returned before the
        gate opens (it opens then, and ``call`` is joined)."""
        call.start()
        call.join(20)  # a call that does not wait for the I/O thread returns at once
        held = call.is_alive()
        self.opened.set()
        call.join(30)
        return not held


class GatedPipeTransport(PipeTransport):
    """PipeTransport whose receivers' next read (``gate``) or its sender I/O thread's next write
    (``write_gate``), once armed, waits for the gate to open: a version whose bytes are still
    coming, or still going."""

    name = "gated-pipes"
    gate = _Gate()
    write_gate = _Gate()

    def sender(self, ctx: SenderContext) -> StreamSender:
        endpoint = super().sender(ctx)
        plain, gate = endpoint.write, self.write_gate

        def write(stream, data: memoryview) -> int:
            if threading.current_thread() is endpoint.thread:
                gate.pass_through()
            return plain(stream, data)

        endpoint.write = write
        return endpoint

    def receiver(self, ctx: ReceiverContext) -> StreamReceiver:
        endpoint = super().receiver(ctx)
        plain, gate = endpoint.read_into, self.gate

        def read_into(stream, view: memoryview) -> int:
            gate.pass_through()
            return plain(stream, view)

        endpoint.read_into = read_into
        return endpoint


def connected_pair(make: Callable[[], Transport], features: int, **options: Any,
                   ) -> tuple[nn.Linear, nn.Linear, WeightSyncScheme, WeightSyncScheme]:
    """A trainer's model and a worker's (``Linear(features, features)``), and a sender (with
    ``options``) and a receiver, each of ``make()``, connected between them."""
    model, theirs = nn.Linear(features, features), nn.Linear(features, features)
    sender = WeightSyncScheme(make(), timeout=30.0, **options)
    sender.init_on_sender(model=model, num_workers=1)
    receiver = WeightSyncScheme(make(), timeout=30.0)
    receiver.init_on_receiver(model=theirs, worker_idx=0)
    assert connect_both(sender, receiver) == (None, None)
    return model, theirs, sender, receiver


def test_a_receive_with_no_time_returns_at_once_while_a_version_is_being_read() -> None:
    """The receiver's I/O thread reads without the endpoint's lock: ``receive(timeout=0)`` (a safe
    point in an inference loop) while a version's bytes are still coming returns None at once.
    It waited for the read (up to 8 MiB a round: 10-40 ms at p99.9 while 256 MiB versions came
    over tcp)."""
    gate = GatedPipeTransport.gate = _Gate()
    model, theirs, sender, receiver = connected_pair(lambda: GatedPipeTransport(channel="gated"), 64, sync=False)
    returned: list = []
    waiting = threading.Thread(target=lambda: returned.append(receiver.receive(timeout=0.0)))
    try:
        handle = gate.send_through(model, sender)
        assert gate.returns_while_held(waiting) and returned == [None]
        assert receiver.receive(timeout=30.0) == 1 and handle.wait(30) == 1
        assert torch.equal(model.weight, theirs.weight)
    finally:
        gate.opened.set()
        receiver.shutdown()
        sender.shutdown()


def test_a_send_returns_at_once_while_the_io_thread_writes_a_version() -> None:
    """The sender's I/O thread writes without the endpoint's lock: a ``send_async()`` (or the
    trainer's wait for acks) while a large version's bytes are being written does not wait for
    the write. It did (up to 8 MiB a connection, twice a round: another thread's wait for the lock
    was 29 ms at p99, 117 ms at most, while 128 MiB versions went to two workers over tcp)."""
    gate = GatedPipeTransport.write_gate = _Gate()
    model, theirs, sender, receiver = connected_pair(  # 1 MiB: more than a pipe holds
        lambda: GatedPipeTransport(channel="gated-write"), 512, sync=False)
    handles: list = []
    second = threading.Thread(target=lambda: handles.append(sender.send_async()))
    try:
        first = gate.send_through(model, sender)
        with torch.no_grad():
            model.weight.add_(1.0)
        assert gate.returns_while_held(second) and len(handles) == 1
        assert receiver.wait_for_version(2, timeout=30.0) == 2
        assert handles[0].wait(30) == 2 and first.wait(30) == 1
        assert torch.equal(model.weight, theirs.weight)
    finally:
        gate.opened.set()
        receiver.shutdown()
        sender.shutdown()


class ChoppyPipeTransport(PipeTransport):
    """PipeTransport whose sender writes and receivers read a few random bytes to 64 KiB per call:
    every frame and payload is cut at arbitrary points, across the frames of a delivery."""

    name = "choppy-pipes"

    def sender(self, ctx: SenderContext) -> StreamSender:
        endpoint, chance = super().sender(ctx), random.Random(7)
        plain = endpoint.write
        endpoint.write = lambda stream, data: plain(stream, data[:chance.choice((1, 5, 17, 4099, 65536))])
        return endpoint

    def receiver(self, ctx: ReceiverContext) -> StreamReceiver:
        endpoint, chance = super().receiver(ctx), random.Random(ctx.worker_idx)
        plain = endpoint.read_into
        endpoint.read_into = lambda stream, view: plain(stream, view[:chance.choice((1, 3, 16, 1000, 65536))])
        return endpoint


def test_versions_cut_at_any_byte_arrive_exact() -> None:
    """Writes that take any part of what is queued (the sender accounts for them after each
    write, without its lock) and reads of any size deliver every version byte for byte."""
    model = nn.Sequential(nn.Linear(200, 300), nn.Linear(300, 7))
    theirs = [nn.Sequential(nn.Linear(200, 300), nn.Linear(300, 7)) for _ in range(2)]
    sender = WeightSyncScheme(ChoppyPipeTransport(channel="choppy"), timeout=60.0)
    sender.init_on_sender(model=model, num_workers=2)
    receivers = [WeightSyncScheme(ChoppyPipeTransport(channel="choppy"), timeout=60.0) for _ in theirs]
    for w, (r, m) in enumerate(zip(receivers, theirs)):
        r.init_on_receiver(model=m, worker_idx=w)
    done = threading.Event()

    def work(r: WeightSyncScheme) -> None:
        r.connect()
        while not done.is_set():
            r.receive(timeout=0.02)

    threads = [threading.Thread(target=work, args=(r,)) for r in receivers]
    for t in threads:
        t.start()
    try:
        sender.connect()
        for version in range(1, 6):
            with torch.no_grad():
                for p in model.parameters():
                    p.uniform_(-version, version)
            assert sender.send() == version
            for m in theirs:
                for mine, got in zip(model.parameters(), m.parameters()):
                    assert torch.equal(mine, got)
    finally:
        done.set()
        for t in threads:
            t.join(30)
        for r in receivers:
            r.shutdown()
        sender.shutdown()


class GarblingPipeTransport(PipeTransport):
    """PipeTransport whose sender, once ``garble`` is set, drops one byte of the next payload it
    writes (and counts it written): the stream is out of step from there, as after damage in
    transit that TCP did not catch."""

    name = "garbling-pipes"
    garble = [False]

    def __init__(self, *, channel: str = "garbled", checksum: bool = True) -> None:
        Transport.__init__(self, channel=channel, checksum=checksum)  # a damaged payload is refused

    def sender(self, ctx: SenderContext) -> StreamSender:
        endpoint, garble = super().sender(ctx), self.garble
        plain = endpoint.write

        def write(stream, data: memoryview) -> int:
            if garble[0] and len(data) > 1000:
                garble[0] = False
                n = plain(stream, data[1:])
                return n + 1 if n == len(data) - 1 else n
            return plain(stream, data)

        endpoint.write = write
        return endpoint


def _receive_errors(receiver: WeightSyncScheme, done: Callable[[list[str]], bool]) -> list[str]:
    """Receive, half a second at a time, until ``done(errors)`` or 30 s; the TransportErrors raised."""
    errors: list[str] = []
    deadline = time.monotonic() + 30
    while not done(errors) and time.monotonic() < deadline:
        try:
            receiver.receive(timeout=0.5)
        except TransportError as exc:
            errors.append(str(exc))
    return errors


def test_a_worker_whose_stream_broke_reports_it_then_connects_again() -> None:
    """A stream that goes out of step (a frame that is not one) raises TransportError naming it
    from the worker's next receive, and the worker connects again by itself: the next version
    reaches it (and the version the damaged stream carried, again, whole). Before, the worker stopped
    for good: every later call raised the same error, and the sender named it gone in every send
    (seen once over an emulated link)."""
    GarblingPipeTransport.garble[0] = False
    model, theirs, sender, receiver = connected_pair(GarblingPipeTransport, 64)
    try:
        GarblingPipeTransport.garble[0] = True
        with torch.no_grad():
            model.weight.add_(1.0)
        handle = sender.send_async()
        errors = _receive_errors(receiver, lambda errors: receiver.version >= 1)
        assert any("not a wsync stream" in e for e in errors), errors
        assert torch.equal(model.weight, theirs.weight)  # version 1 came again, whole, on the new connection
        with torch.no_grad():
            model.weight.add_(1.0)
        handle = sender.send_async()
        assert receiver.wait_for_version(2, timeout=30.0) == 2 and handle.wait(30) == 2
        assert torch.equal(model.weight, theirs.weight)
    finally:
        receiver.shutdown()
        sender.shutdown()


class FailingSinkPipeTransport(PipeTransport):
    """PipeTransport whose receivers, once ``fail`` is set, cannot allocate a payload's buffer
    (an out-of-memory error in the I/O thread)."""

    name = "failing-sink-pipes"
    fail = [False]

    def receiver(self, ctx: ReceiverContext) -> StreamReceiver:
        endpoint, fail = super().receiver(ctx), self.fail
        plain = endpoint._target

        def target(size: int) -> torch.Tensor | None:
            if fail[0]:
                raise RuntimeError("DefaultCPUAllocator: not enough memory")
            return plain(size)

        endpoint._target = target
        return endpoint


def test_an_error_in_the_receivers_io_thread_is_raised_by_receive() -> None:
    """An unexpected error in a worker's I/O thread (an allocation that fails) is raised by its
    next receive(), naming it; before, the thread died silently and the worker waited for ever."""
    FailingSinkPipeTransport.fail[0] = False
    model, theirs, sender, receiver = connected_pair(FailingSinkPipeTransport, 64)
    try:
        FailingSinkPipeTransport.fail[0] = True
        with torch.no_grad():
            model.weight.add_(1.0)
        sender.send_async()
        errors = _receive_errors(receiver, lambda errors: bool(errors))
        assert errors and "I/O thread failed" in errors[0] and "not enough memory" in errors[0], errors
    finally:
        FailingSinkPipeTransport.fail[0] = False
        receiver.shutdown()
        sender.shutdown()


def test_an_io_thread_stuck_past_close_closes_its_own_descriptors(monkeypatch, caplog) -> None:
    """close() waits a bounded time for the I/O thread; one stuck longer in a plugin's call (a
    connect that hangs) is named in a warning and closes its selector and wake-up pipe itself when
    it ends: closed under it, their numbers could be another file's by the time it wrote to them."""
    monkeypatch.setattr(stream_module, "_JOIN_S", 0.2)
    entered, release = threading.Event(), threading.Event()

    class Stuck(StreamReceiver):
        def connect(self, timeout: float) -> _Pipe:
            entered.set()
            release.wait(30)
            raise ConnectionRefusedError("no sender listens")

    endpoint = Stuck("stuck worker 0", ReceiverContext(0, Layout.of({"w": torch.zeros(4)}), "m", torch.device("cpu")))
    endpoint.open(Deadline(5))
    thread = endpoint.thread
    assert thread is not None and entered.wait(30)
    wake_r = endpoint.wake_r
    with caplog.at_level(logging.WARNING, logger="wsync.stream"):
        endpoint.close()
    assert "still running" in caplog.text
    os.fstat(wake_r)  # still open: the thread may still use it
    assert endpoint.selector is not None
    release.set()
    thread.join(30)
    assert not thread.is_alive() and endpoint.selector is None
