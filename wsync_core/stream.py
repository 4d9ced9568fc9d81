"""Transports over any reliable byte stream: the plugin says how to listen, accept, connect, send
and receive bytes; this module does the rest.

``StreamSender`` and ``StreamReceiver`` name no socket family. A stream is anything with
``fileno()`` (for ``selectors``), ``send(view) -> int``, ``recv_into(view) -> int`` (0 at end of
stream) and ``close()``: a socket of any family, or an object of the plugin's own whose methods
do the same (override ``write``/``read_into`` for other calls). The bases own:

- **framing**: every message is a 16-byte prefix (magic, kind, two numbers) and a body whose size
  the kind bounds, checked before anything is allocated or read: a header over
  ``MAX_HEADER_BYTES``, a payload over the receiver's ``layout.nbytes``, an ack over
  ``MAX_ACK_BYTES``, an unknown kind or a kind out of turn is a protocol violation: the peer is
  dropped (``Left`` on the sender), never delivered. Binary, with ``struct``: nothing unpickled.
- **authentication** (when an ``authkey`` is given): an HMAC-SHA256 challenge-response both ways
  before the hello, compared in constant time.
- **one I/O thread per endpoint** that never blocks on one peer and moves payloads without the
  endpoint's lock (a send, a poll or a wait for acks never waits for megabytes to be read or
  written: the lock is taken per frame read, and to account for what a write took): non-blocking
  streams, one output queue per connection, newest-wins (a newer publish replaces an unsent older one: at
  most one version waits per worker beyond the one being written, and it follows that one at once).
- **no stale version after a pause**: a receiver whose ``recv`` finds something that came or
  began coming before it was called (a delivery waiting, one half read, bytes unread) sends a
  probe; the sender answers it right after the newest version it held when the probe came (at
  once if that one is written already), and ``recv`` returns what it holds once the answer is in.
  A worker that was away (frozen, busy) so never applies a version that something newer had
  replaced before it asked; one that waits in ``recv`` when a version comes takes it at once.
- **membership**: a hello names this framing's version, the worker, its layout's size and its
  scheme's origin (a receiver of another version, of another trainer's scheme, or out of range
  is refused and told why); a new hello for a worker replaces its connection (``Joined`` again)
  unless its model does not fit where the holder's does; a connection that ends, errs, breaks the protocol or is silent for
  ``heartbeat`` seconds is reported ``Left``. Each side pings when idle, so a cut link is
  noticed within ``heartbeat`` seconds. A receiver reconnects by itself under its index, also
  after its stream went out of step (``recv`` raises that until a delivery comes on the new
  connection).
- **receivers** keep only the newest delivery, read straight into a buffer of their own (which
  the core may adopt), and hand a payload of another size over as its header and a ``meta``
  tensor so the core names the mismatch.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
import secrets
import select
import selectors
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from . import forked
from .deadline import Deadline
from .endpoints import ReceiverBase, SenderBase
from .errors import TransportError
from .protocol import MAX_ACK_BYTES, MAX_HEADER_BYTES
from .transport import (Acked, Buffer, Delivery, Joined, Left, ReceiverContext, SenderContext, claim_refusal,
                        index_refusal, origin_refusal, zero_copy_for)

__all__ = ["Stream", "Listener", "StreamSender", "StreamReceiver", "PREFIX", "HELLO_BODY", "STREAM_VERSION", "Kind",
           "Violation", "frame", "hello_frame"]

log = logging.getLogger("wsync.stream")

#: magic, kind, a, b: what ``a`` and ``b`` mean depends on the kind (see ``_sizes``)
PREFIX = struct.Struct("!2sBxIQ")
MAGIC = b"ws"
#: a hello's body: this framing's version, the worker's index, its layout's nbytes, its scheme's origin
HELLO_BODY = struct.Struct("!BHQ16s")
#: the version of this framing a hello names: a sender refuses a receiver of another, saying so
STREAM_VERSION = 2
NONCE_BYTES = 32
MAX_REASON_BYTES = 4096
#: bytes read from one peer before the I/O thread turns to the others
_READ_BUDGET = 8 << 20
#: a receiver's unsent acks beyond this mean the sender is not reading
_MAX_BACKLOG = 1 << 20
#: connections that have not said hello yet, at most (the oldest is dropped beyond)
_MAX_STRANGERS = 64
#: events waiting for poll() at most: a worker that acks past this (one ack per delivery is expected) is dropped
_MAX_EVENTS = 65536
#: seconds a receiver waits before connecting again after a connection went out of step (doubling to 1 s)
_BROKEN_DELAY_S = 0.05
#: bytes written to one peer before the I/O thread turns to the others
_WRITE_BUDGET = 8 << 20
#: seconds a closing receiver waits for room to write its last acks and goodbye
_GOODBYE_S = 1.0
#: seconds close() waits for the I/O thread to end (one stuck longer closes its own descriptors)
_JOIN_S = 30.0


class Kind:
    """Frame kinds. ``a``/``b`` of the prefix, per kind: see ``_sizes``."""

    CHALLENGE, RESPONSE, PROOF, HELLO, DELIVER, ACK, BYE, PING, PROBE, ANSWER = range(1, 11)


class Stream(Protocol):
    """What a stream must offer (a connected socket does)."""

    def fileno(self) -> int: ...
    def send(self, data: memoryview) -> int: ...
    def recv_into(self, buffer: memoryview) -> int: ...
    def close(self) -> None: ...


class Listener(Protocol):
    """What a listener must offer (a listening socket does)."""

    def fileno(self) -> int: ...
    def accept(self) -> tuple[Stream, Any]: ...
    def close(self) -> None: ...


class Violation(TransportError):
    """A peer broke the protocol: it is dropped."""


def _sizes(kind: int, a: int, b: int, payload_max: int) -> tuple[int, int]:
    """The body and payload bytes that follow a prefix; raises Violation for sizes out of bounds."""
    if kind in (Kind.CHALLENGE, Kind.PROOF) and a == NONCE_BYTES or kind == Kind.RESPONSE and a == 2 * NONCE_BYTES:
        return a, 0
    if kind == Kind.HELLO and a == HELLO_BODY.size and b == 0:
        return a, 0  # HELLO_BODY
    if kind == Kind.PING and a <= 0xFFFF and b <= 1 << 48:
        return 0, 0
    if kind in (Kind.PROBE, Kind.ANSWER) and b == 0:
        return 0, 0  # a = the probe's number
    if kind == Kind.DELIVER:  # a = header bytes, b = payload bytes
        if a > MAX_HEADER_BYTES or b > payload_max:
            raise Violation(f"a delivery of {a} header and {b} payload bytes exceeds the limits "
                            f"({MAX_HEADER_BYTES} and {payload_max})")
        return a, b
    if kind == Kind.ACK and a <= MAX_ACK_BYTES or kind == Kind.BYE and a <= MAX_REASON_BYTES:
        return a, 0
    raise Violation(f"a frame of kind {kind} with sizes ({a}, {b}) is malformed or over its limit")


def frame(kind: int, body: bytes = b"", a: int | None = None, b: int = 0) -> bytes:
    """One frame's prefix and body (``a`` defaults to the body's length)."""
    return PREFIX.pack(MAGIC, kind, len(body) if a is None else a, b) + body


def hello_frame(worker: int, nbytes: int, origin: str = "", version: int = STREAM_VERSION) -> bytes:
    """The hello of worker ``worker``, whose layout is ``nbytes``, of a scheme of ``origin``."""
    return frame(Kind.HELLO, HELLO_BODY.pack(version, worker, nbytes, origin.encode()[:16]))


def _mac(key: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, b"wsync-stream " + role + b" " + nonce, hashlib.sha256).digest()


@dataclass
class Frame:
    """One frame read off a stream: its ``Kind``, the prefix's two numbers, its body, and for
    DELIVER the payload."""

    kind: int
    a: int
    b: int
    body: bytes
    payload: torch.Tensor | None  # DELIVER only: the payload, or None if it was skipped


class _Reader:
    """Frames from one stream, read in place: prefix and body into bytes, a payload straight into
    the tensor ``sink(size)`` gives (None: read and drop it)."""

    def __init__(self, payload_max: int, sink: Callable[[int], torch.Tensor | None]) -> None:
        self.payload_max, self.sink = payload_max, sink
        self.accept: frozenset[int] = frozenset()
        self._start()

    def _start(self) -> None:
        self.view, self.pos, self.stage = memoryview(bytearray(PREFIX.size)), 0, 0
        self.frame: Frame | None = None
        self.skip = 0

    def read(self, read_into: Callable[[memoryview], int]) -> tuple[int, Frame | None]:
        """Read once; returns (bytes read, a completed frame or None). Raises EOFError at end of
        stream, BlockingIOError when nothing is there, Violation for a malformed frame."""
        n = read_into(self.view[self.pos:])
        if n == 0:
            raise EOFError("end of stream")
        self.pos += n
        if self.pos < len(self.view):
            return n, None
        if self.skip:
            self.skip -= len(self.view)
            self.pos = 0
            self.view = self.view[:min(self.skip, len(self.view))]
            return n, self._finish() if not self.skip else None
        if self.stage == 0:
            magic, kind, a, b = PREFIX.unpack(self.view)
            if magic != MAGIC:
                raise Violation(f"a frame starting {bytes(self.view[:4])!r} (not a wsync stream)")
            if kind not in self.accept and kind != Kind.PING:
                raise Violation(f"a frame of kind {kind} out of turn")
            body, payload = _sizes(kind, a, b, self.payload_max)
            self.frame = Frame(kind, a, b, b"", None)
            self.stage, self.body_len, self.need_payload = 1, body, payload
            if body:
                self.view, self.pos = memoryview(bytearray(body)), 0
                return n, None
        if self.stage == 1:
            f = self.frame
            assert f is not None  # (stage 0 made it)
            f.body = bytes(self.view) if self.body_len else b""
            self.stage = 2
            if self.need_payload:
                target = self.sink(self.need_payload)
                f.payload = target
                if target is None:
                    self.skip = self.need_payload
                    self.view, self.pos = memoryview(bytearray(min(self.skip, 1 << 20))), 0
                else:
                    # (numpy's stubs give an ndarray __buffer__ on Python 3.12+ only)
                    self.view, self.pos = memoryview(target.numpy()).cast("B"), 0  # type: ignore[arg-type]
                return n, None
        return n, self._finish()

    def _finish(self) -> Frame:
        done = self.frame
        assert done is not None  # (called once a frame's prefix was read)
        self._start()
        return done

    @property
    def busy(self) -> bool:
        """Whether a frame is partly read."""
        return self.stage != 0 or self.pos != 0


class _Conn:
    """One connection: its stream, reader, output queue and what it is (``stage``, ``worker``)."""

    def __init__(self, stream: Stream, reader: _Reader, stage: str) -> None:
        self.stream: Stream | None = stream  # None once the sender dropped it (``StreamSender._close``)
        self.reader, self.stage = reader, stage
        self.worker: int | None = None
        self.fits = False
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.out: deque[memoryview] = deque()
        self.writing: Buffer | None = None  # the buffer whose payload ``out`` holds
        self.pending: tuple[Buffer, bytes] | None = None  # the newest delivery not yet queued
        self.published = 0  # deliveries to this connection so far (the sender numbers them)
        self.pending_no = self.writing_no = 0  # the numbers of ``pending`` and ``writing``
        self.probe: tuple[int, int] | None = None  # a probe to answer: its number, and after which delivery
        self.born = self.seen = self.said = time.monotonic()

    def push(self, data: bytes) -> None:
        self.out.append(memoryview(data))


class _Loop:
    """The I/O thread's common parts: a selector, a wake-up pipe, reading and writing connections."""

    heartbeat: float

    selector: selectors.BaseSelector | None = None
    thread: threading.Thread | None = None

    def _setup(self) -> None:
        self.selector = selectors.DefaultSelector()
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.selector.register(self.wake_r, selectors.EVENT_READ, None)
        #: guards the hand-over of the selector and pipe to an I/O thread that outlived ``_teardown``
        self._handover = threading.Lock()
        self._ended = self._orphaned = False

    def _live_selector(self) -> selectors.BaseSelector:
        """The selector, from ``_setup`` to ``_teardown``: while the I/O thread runs."""
        selector = self.selector
        assert selector is not None
        return selector

    def _begin(self, name: str) -> None:
        self.thread = threading.Thread(target=self._thread, name=name, daemon=True)
        self.thread.start()
        forked.watch(self)  # a forked child closes its copies of the descriptors

    def _streams(self) -> list[Any]:
        """Every stream and listener this endpoint holds open."""
        return []

    def forget_in_child(self) -> None:
        """In a child made by ``fork``: close this process's copies of the descriptors and touch
        nothing else (no goodbye: the connections are the parent's)."""
        self._state, self.cond, self.thread = "closed", threading.Condition(), None
        for stream in self._streams():
            try:
                stream.close()
            except OSError:
                pass
        if self.selector is not None:
            self.selector.close()
            self.selector = None
            os.close(self.wake_r)
            os.close(self.wake_w)

    def _thread(self) -> None:
        """The I/O thread: ``_run``, then the selector and pipe closed if ``_teardown`` left them to it."""
        try:
            self._run()
        finally:
            with self._handover:
                self._ended = True
                if self._orphaned:
                    self._close_loop()

    def _teardown(self) -> None:
        """Stop the I/O thread and close the selector and the wake-up pipe (what ``_setup`` made).
        A thread still running after ``_JOIN_S`` (stuck in a plugin's call) closes them itself when it
        ends: closed under it, their numbers could be another file's by the time it wrote to them."""
        if self.selector is None:
            return
        self._kick()
        thread, self.thread = self.thread, None
        if thread is not None:
            thread.join(_JOIN_S)
            with self._handover:
                if not self._ended:
                    self._orphaned = True
                    log.warning("%s: the I/O thread is still running %g s after close() (stuck in a call of the "
                                "plugin's?); it closes its descriptors when it ends", getattr(self, "what", self), _JOIN_S)
                    return
        self._close_loop()

    def _close_loop(self) -> None:
        selector, self.selector = self.selector, None
        if selector is not None:
            selector.close()
            os.close(self.wake_r)
            os.close(self.wake_w)

    def _kick(self) -> None:
        """Make the I/O thread look at its queues now."""
        try:
            os.write(self.wake_w, b"x")
        except OSError:  # the pipe is full (a wake-up is pending anyway) or closed
            pass

    def _drain_wake(self) -> None:
        try:
            while os.read(self.wake_r, 4096):
                pass
        except OSError:
            pass

    def _watch(self, conn: _Conn) -> None:
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.out else 0)
        stream = conn.stream
        if stream is None:  # dropped: not watched (the selector would refuse it with ValueError)
            return
        try:
            selector = self._live_selector()
            if selector.get_key(stream).events != want:
                selector.modify(stream, want, conn)
        except (KeyError, ValueError):
            pass

    def _read(self, conn: _Conn) -> Iterator[Frame]:
        """The frames waiting on ``conn``, each yielded as soon as it is read: the caller handles
        one before the next is parsed (a hello changes which kinds may follow it in the same read),
        and stops reading by dropping the connection. Raises EOFError at the end of the stream,
        unless a frame came before it (an ack just before a goodbye is not lost: the next read
        meets the end again)."""
        budget, yielded = _READ_BUDGET, False
        try:
            while budget > 0 and conn.stream is not None:
                stream = conn.stream
                n, got = conn.reader.read(lambda view: self.read_into(stream, view))
                budget -= n
                conn.seen = time.monotonic()
                if got is not None:
                    yielded = True
                    yield got
        except (BlockingIOError, InterruptedError):
            return
        except EOFError:
            if not yielded:
                raise

    def _flush(self, conn: _Conn, watch: bool = True) -> None:
        """Write what the stream takes now, up to a budget (raises OSError for a broken one); with
        ``watch`` (only in the I/O thread, which owns the selector) watch for room for the rest."""
        budget = _WRITE_BUDGET
        stream = conn.stream
        assert stream is not None  # (never called for a connection dropped)
        try:
            while conn.out and budget > 0:
                n = self.write(stream, conn.out[0])
                budget -= n
                conn.said = time.monotonic()
                if n < len(conn.out[0]):
                    conn.out[0] = conn.out[0][n:]
                    break
                conn.out.popleft()
                if not conn.out:
                    self._written(conn)
        except (BlockingIOError, InterruptedError):
            pass
        if watch:
            self._watch(conn)

    def _written(self, conn: _Conn) -> None:
        """Everything queued for ``conn`` is written."""

    def _idle(self, conn: _Conn, now: float) -> str | None:
        """Ping an idle peer; the reason to drop a silent one, else None."""
        if now - conn.seen > self.heartbeat:
            return f"silent for {now - conn.seen:.1f} s (heartbeat {self.heartbeat:g} s)"
        if not conn.out and now - conn.said > self.heartbeat / 4:
            conn.push(frame(Kind.PING))
            self._flush(conn)
        return None

    def write(self, stream: Stream, data: memoryview) -> int:
        """Write some of ``data`` without blocking; returns how many bytes went (raise BlockingIOError for none)."""
        return stream.send(data)

    def read_into(self, stream: Stream, view: memoryview) -> int:
        """Read some bytes into ``view`` without blocking; 0 at end of stream (raise BlockingIOError for none)."""
        return stream.recv_into(view)

    def _run(self) -> None:
        raise NotImplementedError


class StreamSender(_Loop, SenderBase):
    """The sender over a byte stream: implement ``listen`` (and ``accept`` if ``listener.accept()[0]``
    is not it; ``write``/``read_into`` if the stream is not socket-like).

    ``authkey``: require the HMAC handshake with this key. ``heartbeat``: seconds of silence after
    which a worker counts as gone.
    """

    prefix_publish = True  # a delivery frames ``buffer.payload``, the first ``used`` bytes

    def __init__(self, what: str, ctx: SenderContext, *, authkey: bytes | None = None,
                 heartbeat: float = 10.0, max_buffers: int | None = None) -> None:
        super().__init__(what, ctx, max_buffers)
        self.authkey, self.heartbeat = authkey, heartbeat
        self.conns: dict[int, _Conn] = {}
        self.strangers: list[_Conn] = []  # connected, no hello yet
        self.listener: Listener | None = None
        self.failure: str | None = None

    def listen(self) -> Listener:
        """A listener, bound and listening; raise TransportError naming the address if it cannot be."""
        raise NotImplementedError(f"{type(self).__qualname__} must implement listen()")

    def accept(self, listener: Listener) -> Stream:
        """A newly connected stream (raise BlockingIOError if none is waiting)."""
        return listener.accept()[0]

    # -- lifecycle (SenderBase) -----------------------------------------------------------------
    def start(self, deadline: Deadline) -> None:
        self.failure = None
        listener = self.listener = self.listen()
        _nonblocking(listener)
        self.conns, self.strangers = {}, []
        self._setup()
        self._live_selector().register(listener, selectors.EVENT_READ, None)
        self._begin(f"wsync {self.what}")

    def stop(self) -> None:
        self._teardown()
        for conn in [*self.conns.values(), *self.strangers]:
            if not conn.out and conn.stream is not None:  # never cut into a half-written frame
                try:
                    self.write(conn.stream, memoryview(frame(Kind.BYE)))
                except OSError:
                    pass
            self._close(conn)
        self.conns, self.strangers = {}, []
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        forked.unwatch(self)  # last: a child forked while it closed lets go of what was still open

    def _streams(self) -> list[Any]:
        conns = [c.stream for c in [*self.conns.values(), *self.strangers] if c.stream is not None]
        return conns + ([self.listener] if self.listener is not None else [])

    def deliver(self, buffer: Buffer, header: bytes, workers: Sequence[int]) -> None:
        if self.failure is not None:
            raise TransportError(f"{self.what}: {self.failure}")
        for w in workers:
            conn = self.conns.get(w)
            if conn is None:
                continue  # gone since: its Left is (or was) reported by poll
            if conn.pending is not None:
                self.let_go(conn.pending[0], w)  # newest wins
            conn.published += 1
            conn.pending, conn.pending_no = (buffer, header), conn.published
            self.hold(buffer, w)
            if conn.writing is None and not conn.out:  # idle: start here, saving a thread switch
                try:
                    self._enqueue(conn)
                    self._flush(conn, watch=False)  # (only the I/O thread changes what the selector watches)
                except OSError:  # the I/O thread meets the same error and drops the connection
                    pass
        self._kick()  # the I/O thread writes the rest

    # -- the I/O thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self.is_open:
                ready = self._live_selector().select(min(1.0, self.heartbeat / 4))
                with self.cond:
                    if not self.is_open:
                        return
                    for key, mask in ready:
                        if key.fileobj is self.listener:
                            self._accept()
                        elif key.data is None:
                            self._drain_wake()
                        else:
                            self._serve(key.data, mask)
                    now = time.monotonic()
                    for conn in [*self.conns.values(), *self.strangers]:
                        self._guard(conn, functools.partial(self._idle, conn, now))
                        if conn.stream is not None and conn.pending is not None and conn.writing is None:
                            self._guard(conn, functools.partial(self._enqueue, conn))
                    # what each connection has to write (e.g. what publish began), written below
                    writes = [(c, list(c.out)) for c in [*self.conns.values(), *self.strangers]
                              if c.stream is not None and c.out]
                for conn, views in writes:
                    self._write_out(conn, views)
        except Exception as exc:  # noqa: BLE001 - the loop must not die silently: fail every worker
            log.exception("%s: the I/O thread failed", self.what)
            with self.cond:
                self.failure = f"its I/O thread failed: {type(exc).__name__}: {exc}"
                for w in list(self.conns):
                    self.emit(Left(w, self.failure))
                self.conns.clear()

    def _guard(self, conn: _Conn, step: Callable[[], str | None]) -> None:
        """Run ``step`` for ``conn``; drop the connection if it fails or returns a reason."""
        try:
            reason = step()
        except EOFError:
            reason = "it closed the connection (exited, killed, or shut down)"
        except Violation as exc:
            reason = f"protocol violation: {exc}"
            log.warning("%s dropped %s: %s", self.what, _who(conn), reason)
        except (OSError, TransportError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
            self._read_rest(conn)
        if reason is not None:
            self._drop(conn, reason)

    def _read_rest(self, conn: _Conn) -> None:
        """Before dropping a worker whose stream failed: handle the frames already there (a worker
        that acked and closed while a payload was being written to it resets the connection, so
        the write fails, but its last ack and goodbye are still there to read)."""
        if conn.worker is None or conn.stream is None:
            return
        try:
            for f in self._read(conn):
                self._frame(conn, f)
        except (EOFError, OSError, Violation, TransportError):
            pass  # the end, or what made the write fail: the drop that follows says why

    def _accept(self) -> None:
        listener = self.listener
        assert listener is not None  # (called for the listener's key)
        try:
            stream = self.accept(listener)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            log.warning("%s could not accept a connection: %s", self.what, exc)
            return
        _nonblocking(stream)
        conn = _Conn(stream, _Reader(0, lambda n: None), "auth" if self.authkey is not None else "hello")
        conn.reader.accept = frozenset({Kind.RESPONSE} if self.authkey is not None else {Kind.HELLO})
        if len(self.strangers) >= _MAX_STRANGERS:  # the oldest goes untold (a BYE with a reason is a
            # refusal for good): a worker among them, slow to say hello, connects again
            self._drop(self.strangers[0], "too many connections that have not said hello")
        self.strangers.append(conn)
        self._live_selector().register(stream, selectors.EVENT_READ, conn)
        if self.authkey is not None:
            conn.push(frame(Kind.CHALLENGE, conn.nonce))
            self._guard(conn, lambda: self._flush(conn))

    def _write_out(self, conn: _Conn, views: list[memoryview]) -> None:
        """Write the start of ``views`` (what ``conn.out`` held) up to a budget, without the lock:
        a send or a wait for acks meanwhile does not wait for megabytes to be written. Only this
        thread writes a connection whose queue is not empty, and only it closes one; the queue
        only grows meanwhile. Then, with the lock, drop what went and watch for room for the rest."""
        sent, budget, failure = 0, _WRITE_BUDGET, None
        stream = conn.stream
        assert stream is not None  # (only this thread drops a connection)
        try:
            for view in views:
                done = 0
                while done < len(view) and budget > 0:
                    n = self.write(stream, view[done:])
                    done, sent, budget = done + n, sent + n, budget - n
                if done < len(view):
                    break
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            failure = f"{type(exc).__name__}: {exc}"
        with self.cond:
            if conn.stream is None:
                return
            if sent:
                conn.said = time.monotonic()
            while sent:
                head = conn.out[0]
                if sent < len(head):
                    conn.out[0], sent = head[sent:], 0
                    break
                sent -= len(head)
                conn.out.popleft()
                if not conn.out:
                    self._guard(conn, lambda: self._written(conn))  # may queue the pending delivery
            if failure is not None:
                self._read_rest(conn)
                self._drop(conn, failure)
            elif conn.stream is not None:
                self._watch(conn)

    def _serve(self, conn: _Conn, mask: int) -> None:
        def step() -> None:
            if mask & selectors.EVENT_READ:
                for f in self._read(conn):
                    self._frame(conn, f)

        if conn.stream is not None:  # not dropped earlier in this round (replaced, or a stranger too many)
            self._guard(conn, step)

    def _frame(self, conn: _Conn, f: Frame) -> None:
        if f.kind == Kind.RESPONSE:
            key = self.authkey
            if key is None:  # (as the reader says: it takes a response only where there is a key)
                raise Violation(f"a frame of kind {f.kind} out of turn")
            if not hmac.compare_digest(f.body[:NONCE_BYTES], _mac(key, b"receiver", conn.nonce)):
                self._refuse(conn, "authentication failed (wrong authkey?)")
                return
            conn.push(frame(Kind.PROOF, _mac(key, b"sender", f.body[NONCE_BYTES:])))
            conn.stage, conn.reader.accept = "hello", frozenset({Kind.HELLO})
        elif f.kind == Kind.HELLO:
            version, worker, nbytes, origin = HELLO_BODY.unpack(f.body)
            if version != STREAM_VERSION:
                self._refuse(conn, f"the receiver speaks version {version} of wsync's stream framing, this sender "
                                   f"version {STREAM_VERSION}: give both the same wsync version")
                return
            self._hello(conn, worker, nbytes, origin.rstrip(b"\0").decode("ascii", "replace"))
        elif f.kind == Kind.ACK:
            if conn.worker is None:  # (as the reader says: it takes acks only after the hello)
                raise Violation(f"a frame of kind {f.kind} out of turn")
            if len(self._events) >= _MAX_EVENTS:
                raise Violation(f"{_MAX_EVENTS} events are waiting for poll(); one ack per delivery is expected")
            self.emit(Acked(conn.worker, f.body))
        elif f.kind == Kind.PROBE:
            conn.probe = (f.a, conn.published)
            if conn.writing is None and conn.pending is None:  # the newest is written already
                self._answer(conn)
        elif f.kind == Kind.BYE:
            self._drop(conn, "receiver shut down")

    def _hello(self, conn: _Conn, worker: int, nbytes: int, origin: str) -> None:
        why = index_refusal(worker, self.ctx.num_workers) or origin_refusal(worker, origin, self.ctx.origin)
        if why is not None:
            self._refuse(conn, why)
            return
        layout = self.ctx.layout
        held = self.conns.get(worker)
        if held is not None and held.fits and nbytes != layout.nbytes:
            self._refuse(conn, claim_refusal(worker, f"a payload of {nbytes} bytes; this sender's has {layout.nbytes}"))
            return
        self.strangers.remove(conn)
        old = self.conns.pop(worker, None)
        if old is not None:  # a reconnection: the new connection wins (no Left: it is not in conns);
            # told why, the old one stops for good instead of connecting again and taking it back
            self._drop(old, f"another connection said hello as worker {worker} and took its place (a process "
                            f"started again under the same worker_idx while this one runs?); this one gets no "
                            f"more versions and keeps the one it holds", tell=True)
        conn.stage, conn.worker, conn.fits = "worker", worker, nbytes == layout.nbytes
        conn.reader.accept = frozenset({Kind.ACK, Kind.BYE, Kind.PING, Kind.PROBE})
        self.conns[worker] = conn
        self.emit(Joined(worker))

    def _idle(self, conn: _Conn, now: float) -> str | None:
        if conn.worker is None and now - conn.born > self.heartbeat:  # pings do not count
            reason = f"no hello within {self.heartbeat:g} s of connecting"
            if self.authkey is not None:
                return reason  # dropped untold: a worker slow to answer the challenge connects again
            # a worker says hello as it connects, unless it waits for a challenge: one given an
            # authkey (this sender has none) is told, so that it says so
            self._refuse(conn, reason)
            return None
        return super()._idle(conn, now)

    def _refuse(self, conn: _Conn, reason: str) -> None:
        """Drop ``conn`` for good: its peer is told ``reason``, and stops (it does not connect again)."""
        log.warning("%s refused %s: %s", self.what, _who(conn), reason)
        self._drop(conn, reason, tell=True)

    def _enqueue(self, conn: _Conn) -> None:
        pending = conn.pending
        assert pending is not None  # (its callers check)
        buffer, header = pending
        conn.pending, conn.writing, conn.writing_no = None, buffer, conn.pending_no
        payload = buffer.payload
        size = payload.numel() if conn.fits else 0
        conn.push(frame(Kind.DELIVER, header, len(header), size))
        if size:
            # (numpy's stubs give an ndarray __buffer__ on Python 3.12+ only)
            conn.out.append(memoryview(payload.numpy()).cast("B"))  # type: ignore[arg-type]

    def _answer(self, conn: _Conn) -> None:
        """Answer the probe: everything the worker was sent before this frame is all there is."""
        if sum(len(v) for v in conn.out) > _MAX_BACKLOG:
            raise Violation(f"it probes faster than it reads ({_MAX_BACKLOG} bytes unread)")
        probe = conn.probe
        assert probe is not None  # (its callers check)
        conn.push(frame(Kind.ANSWER, a=probe[0]))
        conn.probe = None

    def _written(self, conn: _Conn) -> None:
        """What ``conn.out`` held is written: let the delivery go, answer a probe that waited for
        it, and queue the pending delivery right behind (``_flush`` writes on)."""
        if conn.writing is not None:
            buffer, conn.writing = conn.writing, None
            assert conn.worker is not None  # (only a worker's connection is given deliveries)
            self.let_go(buffer, conn.worker)
            if conn.probe is not None and conn.writing_no >= conn.probe[1]:
                self._answer(conn)
        if conn.pending is not None:
            self._enqueue(conn)

    def _drop(self, conn: _Conn, reason: str, tell: bool = False) -> None:
        """Close ``conn``, giving back what it held. With ``tell``, its peer is told ``reason`` (best
        effort, never cutting into a half-written frame), which it takes as a refusal for good; a
        peer not told (a stranger slow to say hello, a stream out of step) connects again."""
        if conn.stream is None:
            return
        if conn in self.strangers:
            self.strangers.remove(conn)
        if tell:
            if not conn.out:
                try:
                    self.write(conn.stream, memoryview(frame(Kind.BYE, reason.encode()[:MAX_REASON_BYTES])))
                except OSError:
                    pass
        if conn.worker is not None and self.conns.get(conn.worker) is conn:
            del self.conns[conn.worker]
            self.emit(Left(conn.worker, reason))
        for buffer in (conn.writing, conn.pending and conn.pending[0]):
            if buffer is not None:
                assert conn.worker is not None  # (only a worker's connection is given deliveries)
                self.let_go(buffer, conn.worker)
        conn.writing = conn.pending = conn.probe = None
        try:
            self._live_selector().unregister(conn.stream)
        except (KeyError, ValueError):
            pass
        self._close(conn)

    @staticmethod
    def _close(conn: _Conn) -> None:
        if conn.stream is not None:
            try:
                conn.stream.close()
            except OSError:
                pass
            conn.stream = None


def _nonblocking(stream: Stream | Listener) -> None:
    """Make ``stream`` non-blocking: ``setblocking(False)`` where it has one (a socket), else its descriptor."""
    setblocking = getattr(stream, "setblocking", None)
    if setblocking is not None:
        setblocking(False)
    else:
        os.set_blocking(stream.fileno(), False)


def _who(conn: _Conn) -> str:
    return f"worker {conn.worker}" if conn.worker is not None else "a peer that has not said hello"


class StreamReceiver(_Loop, ReceiverBase):
    """The receiver over a byte stream: implement ``connect`` (and ``write``/``read_into`` if the
    stream is not socket-like). It connects, and reconnects whenever the connection is lost, by itself.

    ``authkey``: prove it holds this key and require the sender to. ``heartbeat``: seconds of
    silence after which the sender counts as gone (then it reconnects). ``adopt``: hand the core
    payloads it may keep as the model's tensors (default: ``zero_copy_for(None, ctx)``).
    """

    def __init__(self, what: str, ctx: ReceiverContext, *, authkey: bytes | None = None,
                 heartbeat: float = 10.0, adopt: bool | None = None) -> None:
        super().__init__(what, ctx)
        self.authkey, self.heartbeat = authkey, heartbeat
        self.adopt = zero_copy_for(adopt, ctx)
        self.conn: _Conn | None = None
        self._spare: list[torch.Tensor] = []
        self._broken = False  # the last connection went out of step (a protocol violation)
        self._broken_delay = _BROKEN_DELAY_S  # the wait before connecting again after one
        self._cut_short = False  # the last connection ended before its handshake did
        self._probes = 0  # the number of the last probe sent
        self._answered = 0  # the number of the last probe the sender answered
        self._unreached: str | None = None  # why the last attempt to reach the sender failed

    def connect(self, timeout: float) -> Stream:
        """A stream connected to the sender, within about ``timeout`` seconds; raise OSError if
        the sender cannot be reached (it is tried again), TransportError if it never can be."""
        raise NotImplementedError(f"{type(self).__qualname__} must implement connect()")

    def last_error(self) -> str | None:
        """The error of the last failed attempt to reach the sender, until one succeeds."""
        return self._unreached

    def start(self, deadline: Deadline) -> None:
        self.clear_failure()
        self._setup()
        self._begin(f"wsync {self.what}")

    def stop(self) -> None:
        self._teardown()  # the I/O thread says goodbye to the sender on its way out
        self._spare.clear()
        forked.unwatch(self)  # last: a child forked while it closed lets go of what was still open

    def recv(self, deadline: Deadline) -> Delivery | None:
        """The newest delivery, waiting for one until the deadline; None if none came. If something
        came or began coming before this call, first ask the sender (a probe) and wait, until the
        deadline, for its answer, which follows the newest version it held: so what this returns
        is never older than what was published before the call. With no time to wait, what has
        arrived. Raises TransportError if closed or failed with nothing left to deliver."""
        with self.cond:
            self.check_open()
            conn = self.conn
            if conn is not None and conn.stage == "live" and not deadline.expired() and self._waited(conn):
                self._probes += 1
                probe = self._probes
                conn.push(frame(Kind.PROBE, a=probe))
                self._kick()
                self.wait_until(lambda: self._answered >= probe or self.conn is not conn
                                or self._failure is not None, deadline)
        return super().recv(deadline)

    def _waited(self, conn: _Conn) -> bool:
        """Whether a delivery waits, is partly read, or unread bytes are there (with ``self.cond`` held)."""
        if self._mail is not None or conn.reader.busy:
            return True
        stream = conn.stream
        assert stream is not None  # (a receiver's connection keeps its stream)
        try:
            return bool(select.select([stream], [], [], 0)[0])
        except (OSError, ValueError):  # closed meanwhile: the I/O thread reconnects
            return False

    def ack(self, data: bytes) -> None:
        """Queue ``data`` for the sender; dropped while disconnected (the sender re-publishes on the
        next hello, and the core acks again). Raises TransportError if the endpoint is closed, the
        ack is over MAX_ACK_BYTES, or the sender stopped reading."""
        if len(data) > MAX_ACK_BYTES:
            raise TransportError(f"{self.what}: an ack of {len(data)} bytes exceeds the limit of {MAX_ACK_BYTES}")
        with self.cond:
            self.check_open()
            conn = self.conn
            if conn is None or conn.stage != "live":
                return
            if sum(len(v) for v in conn.out) > _MAX_BACKLOG:
                raise TransportError(f"{self.what}: the sender has not read {_MAX_BACKLOG} bytes of acks")
            conn.push(frame(Kind.ACK, bytes(data)))
        self._kick()

    # -- the I/O thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._connect_and_serve()
        except Exception as exc:  # noqa: BLE001 - the thread must not die silently: recv raises it
            log.exception("%s: the I/O thread failed", self.what)
            self.fail(f"its I/O thread failed: {type(exc).__name__}: {exc}")

    def _connect_and_serve(self) -> None:
        """Connect, serve the connection until it ends, and again, until closed or failed for good."""
        delay = 0.01
        while self.is_open:
            try:
                stream = self.connect(min(2.0, self.heartbeat))
            except OSError as exc:
                log.debug("%s: cannot reach the sender yet: %s", self.what, exc)
                self._unreached = f"{self.what}: cannot reach the sender: {exc}"
                with self.cond:
                    self.cond.wait(delay)
                delay = min(delay * 2, 0.5)
                continue
            except TransportError as exc:
                self.fail(str(exc))
                return
            delay = 0.01
            self._unreached = None
            reason = self._serve(stream)
            if reason is not None:
                self.fail(reason)
                return
            if self._broken or self._cut_short:  # out of step, or ended before its handshake: connect
                with self.cond:                     # again, not at once every time
                    self.cond.wait(self._broken_delay)
                self._broken_delay = min(self._broken_delay * 2, 1.0)

    def _serve(self, stream: Stream) -> str | None:
        """Talk to the sender over ``stream`` until it ends; returns a reason to stop for good, or None."""
        _nonblocking(stream)
        with self.cond:
            conn = self.conn = _Conn(stream, _Reader(self.ctx.layout.nbytes, self._target), "auth")
            if self.authkey is None:
                self._live(conn)
            else:
                conn.reader.accept = frozenset({Kind.CHALLENGE, Kind.BYE})
            self._live_selector().register(stream, selectors.EVENT_READ, conn)
        try:
            while self.is_open:
                with self.cond:
                    self._flush(conn)  # what the handshake, ack() or a ping queued
                ready = self._live_selector().select(min(1.0, self.heartbeat / 4))
                if not self.is_open:
                    return None
                for key, mask in ready:
                    if key.data is None:
                        self._drain_wake()
                    elif mask & selectors.EVENT_READ:
                        # read without the lock (only this thread reads the stream): a receive(timeout=0)
                        # meanwhile takes what arrived at once, instead of waiting out a read of 8 MiB
                        for f in self._read(conn):
                            with self.cond:
                                reason = self._frame(conn, f)
                            if reason is not None:
                                return reason
                with self.cond:
                    self._flush(conn)
                    silent = self._idle(conn, time.monotonic())
                    if silent is not None:
                        log.info("%s: the sender is %s; reconnecting", self.what, silent)
                        return None
        except EOFError:  # untold (a sender that refuses says why, in a BYE): connect again
            return None
        except Violation as exc:  # damage in transit that TCP let through, or a sender's bug: report it,
            # and connect again (recv raises it until a delivery comes on a new connection)
            reason = f"the sender broke the protocol: {exc}; connecting again"
            log.warning("%s: %s", self.what, reason)
            self._broken = True
            self.fail(reason)
            return None
        except OSError as exc:
            log.info("%s: connection to the sender lost (%s); reconnecting", self.what, exc)
            return None
        finally:
            # ended before its handshake did (a sender with too many strangers, or restarting): the
            # next connection waits a little, longer each time
            self._cut_short = conn.stage != "live"
            with self.cond:
                if not self.is_open and conn.stage == "live":
                    self._goodbye(conn)
                self._hang_up()
        return None

    def _goodbye(self, conn: _Conn) -> None:
        """On close: write what is queued (an ack sent just before closing is not lost), then BYE,
        so the sender reports Left at once; gives up on a sender that takes nothing for a second."""
        conn.push(frame(Kind.BYE))
        stream = conn.stream
        assert stream is not None  # (a receiver's connection keeps its stream)
        deadline = time.monotonic() + _GOODBYE_S
        try:
            while True:
                self._flush(conn, watch=False)
                if not conn.out or time.monotonic() >= deadline:
                    return
                select.select([], [stream], [], 0.05)
        except OSError:  # gone already: it reports Left when it notices
            pass

    def _live(self, conn: _Conn) -> None:
        if not self._broken:  # (one out of step waits longer each time, until a delivery comes whole)
            self._broken_delay = _BROKEN_DELAY_S
        conn.stage, conn.reader.accept = "live", frozenset({Kind.DELIVER, Kind.PING, Kind.BYE, Kind.CHALLENGE,
                                                            Kind.ANSWER})
        conn.push(hello_frame(self.ctx.worker_idx, self.ctx.layout.nbytes, self.ctx.origin))

    def _frame(self, conn: _Conn, f: Frame) -> str | None:
        if f.kind == Kind.CHALLENGE:
            if self.authkey is None:
                return "the sender requires authentication: give this worker the sender's authkey"
            if conn.stage != "auth":
                raise Violation("a second challenge")
            conn.push(frame(Kind.RESPONSE, _mac(self.authkey, b"receiver", f.body) + conn.nonce))
            conn.stage, conn.reader.accept = "proof", frozenset({Kind.PROOF, Kind.BYE})
        elif f.kind == Kind.PROOF:
            key = self.authkey
            if key is None:  # (as the reader says: it takes a proof only after answering a challenge)
                raise Violation(f"a frame of kind {f.kind} out of turn")
            if not hmac.compare_digest(f.body, _mac(key, b"sender", conn.nonce)):
                return "the sender failed authentication (wrong authkey?)"
            self._live(conn)
        elif f.kind == Kind.BYE:
            hint = " (does this worker have an authkey and the sender none?)" if conn.stage == "auth" else ""
            if f.body:
                return f"the sender refused this worker: {f.body.decode('utf-8', 'replace')}{hint}"
            raise EOFError("the sender shut down")
        elif f.kind == Kind.ANSWER:
            self._answered = max(self._answered, f.a)
            self.cond.notify_all()
        elif f.kind == Kind.DELIVER:
            if self._broken:  # in step again: recv stops reporting the broken connection
                self._broken, self._broken_delay = False, _BROKEN_DELAY_S
                self.clear_failure()
            payload = f.payload
            if payload is None and f.b == 0:
                self.put(Delivery(f.body, torch.empty(0, dtype=torch.uint8)))
            elif payload is None:  # another size than this model: the core names the mismatch
                self.put(Delivery(f.body, torch.empty(f.b, dtype=torch.uint8, device="meta")))
            else:
                self.put(Delivery(f.body, payload, self._releaser(payload), adoptable=self.adopt))
        return None

    def _streams(self) -> list[Any]:
        return [self.conn.stream] if self.conn is not None else []

    def _target(self, size: int) -> torch.Tensor | None:
        if not 0 < size <= self.ctx.layout.nbytes:
            return None
        if size != self.ctx.layout.nbytes:  # a partial payload (wsync_core.delta): never recycled
            return torch.empty(size, dtype=torch.uint8)
        with self.cond:
            return self._spare.pop() if self._spare else torch.empty(size, dtype=torch.uint8)

    def _releaser(self, payload: torch.Tensor) -> Callable[[], None]:
        done: list[bool] = []

        def release() -> None:
            with self.cond:
                if not done and self.is_open and len(self._spare) < 2 and payload.numel() == self.ctx.layout.nbytes:
                    self._spare.append(payload)
                done.append(True)

        return release

    def _hang_up(self) -> None:
        conn, self.conn = self.conn, None
        if conn is None:
            return
        stream = conn.stream
        assert stream is not None  # (a receiver's connection keeps its stream)
        try:
            self._live_selector().unregister(stream)
        except (KeyError, ValueError):
            pass
        try:
            stream.close()
        except OSError:
            pass
