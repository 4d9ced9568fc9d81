"""Endpoint bases: the machinery every transport needs, so a plugin writes only its own I/O.

``SenderBase`` and ``ReceiverBase`` implement ``SenderEndpoint`` and ``ReceiverEndpoint`` (the
interface the core calls is unchanged). They carry:

- a lifecycle: ``open`` calls the plugin's ``start``, ``close`` its ``stop`` exactly once; close
  is idempotent and callable from any state, and every other call on an endpoint that is not
  open raises ``TransportError`` naming the transport;
- one condition (``self.cond``) guarding the endpoint's state, with ``wait_until`` that waits a
  slice at a time (no ``OverflowError`` for ``math.inf``) and looks once when the deadline passed;
- for senders: an event queue (``emit`` from any thread, ``poll`` returns them) and a pool of
  payload buffers (``Buffer``; their ``index`` is their place in ``buffers``): ``acquire`` hands one out,
  ``publish`` checks it is this pool's and gives it to the plugin's ``deliver``; ``hold``/``let_go``
  keep a buffer out of ``acquire`` while a worker may still read it;
- for receivers: a mailbox that keeps only the newest delivery (``put`` drops an older one not
  yet taken, releasing it), and ``fail`` to make ``recv`` raise once the mailbox is empty;
- for receivers, no stale version after a pause: a plugin that numbers its deliveries (``put``'s
  ``number``, increasing per receiver) and can ask its sender the number of the newest it
  published to this worker (``newest_published``) gets a ``recv`` that, when a delivery waited
  in the mailbox at entry (or ``arriving`` says one is partly in), first asks, then waits (until
  the deadline, at most ``probe_patience``) for a delivery numbered at least that. A worker that
  was away (frozen, busy) so never applies a version that a newer one published before its
  ``receive()`` had replaced; one that finds the mailbox empty is never asked about (no cost).
  The question is asked on a thread of the endpoint's own, and ``recv`` waits for the answer only
  until its deadline: a client blocked on a cut link (which its own timeouts may not bound) never
  holds ``recv`` past it.

``AckPusher`` is for a receiver whose ack is a blocking network call (a store push, an RPC): it
sends the acks from a thread of its own, in order, so that the ``receive()`` that applied a version
never waits on the network for its ack.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .deadline import Deadline
from .errors import TransportError, WorkerTimeoutError
from .protocol import MAX_HEADER_BYTES
from .transport import Buffer, Delivery, Event, ReceiverContext, ReceiverEndpoint, SenderContext, SenderEndpoint

__all__ = ["EndpointBase", "SenderBase", "ReceiverBase", "AckPusher"]

log = logging.getLogger("wsync.endpoints")

#: the longest single wait; a wait for longer is cut into slices of this many seconds
_SLICE_S = 1.0
#: seconds ``close`` waits for the thread asking ``newest_published`` to end (it ends once the
#: plugin's call returns: on a cut link, when the client gives up)
_PROBER_JOIN_S = 10.0
#: acks an ``AckPusher`` keeps while its sender does not answer (the oldest go first: a later ack
#: says more than an earlier one)
_ACKS_KEPT = 64


class EndpointBase:
    """The lifecycle and the condition shared by both sides; ``what`` names the endpoint in errors."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.cond = threading.Condition()
        self._state = "new"  # new -> open -> closed (-> open again: the core may retry connect())
        self._woken = False  # wake() was called: waits end at once

    @property
    def is_open(self) -> bool:
        return self._state == "open"

    def check_open(self) -> None:
        """Raise TransportError unless the endpoint is open (after ``open``, before ``close``)."""
        if self._state != "open":
            raise TransportError(f"{self.what} is {'closed' if self._state == 'closed' else 'not open yet'}")

    def open(self, deadline: Deadline) -> None:
        """Mark the endpoint open, then ``start(deadline)``; if that raises, the endpoint is closed."""
        with self.cond:
            if self._state == "open":
                raise TransportError(f"{self.what} is already open")
            self._state = "open"  # (a wake() before it stands: the scheme is shutting down)
        try:
            self.start(deadline)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Mark the endpoint closed and wake every waiter, then ``stop()`` once; idempotent, never raises."""
        with self.cond:
            if self._state != "open":
                self._state = "closed"
                return
            self._state = "closed"
            self.cond.notify_all()
        self.stop()

    def wake(self) -> None:
        """End a wait in another thread (``poll``, ``recv``, ``acquire``) and every later one at once:
        the scheme is shutting down. Callable from any thread; never raises."""
        with self.cond:
            self._woken = True
            self.cond.notify_all()

    def start(self, deadline: Deadline) -> None:
        """Take resources (bind, connect, start threads); raise TransportError or WorkerTimeoutError."""

    def stop(self) -> None:
        """Free every resource ``start`` took (called once, after the endpoint is marked closed); must not raise."""

    def wait_until(self, ready: Callable[[], bool], deadline: Deadline) -> bool:
        """With ``self.cond`` held: wait until ``ready()``, the deadline, ``wake`` or ``close``; returns
        ``ready()``. Looks once even when the deadline has passed; never hands ``math.inf`` to a
        blocking call.
        """
        while not ready() and self._state == "open" and not self._woken and not deadline.expired():
            self.cond.wait(deadline.slice(_SLICE_S))
        return ready()


class SenderBase(EndpointBase, SenderEndpoint):
    """A sender endpoint with events, a closed guard and a buffer pool; the plugin implements ``deliver``.

    ``max_buffers`` bounds the pool (default ``2 * num_workers + 2``: one buffer being written and
    one waiting per worker, the latest, and the one being filled). A plugin whose ``deliver`` sends
    only ``buffer.payload`` (the first ``used`` bytes) sets ``prefix_publish = True``.
    """

    def __init__(self, what: str, ctx: SenderContext, max_buffers: int | None = None) -> None:
        super().__init__(what)
        self.ctx = ctx
        self.max_buffers = max_buffers or 2 * ctx.num_workers + 2
        self.buffers: list[Buffer] = []  # the pool; buffers[i].index == i
        self.latest: Buffer | None = None
        self._holders: list[Counter] = []  # per buffer index: worker -> how many times it holds that buffer
        self._events: list[Event] = []

    # -- what the plugin implements -----------------------------------------------------------
    def deliver(self, buffer: Buffer, header: bytes, workers: Sequence[int]) -> None:
        """Move ``buffer`` (its first ``used`` bytes if the plugin sets ``prefix_publish``, else all of
        it) and ``header`` to ``workers`` without waiting for them (called with ``self.cond`` held);
        ``hold`` the buffer for each worker that may still read it."""
        raise NotImplementedError(f"{type(self).__qualname__} must implement deliver()")

    def allocate(self, index: int) -> torch.Tensor:
        """A new buffer of ``layout.nbytes`` bytes (override for shared memory, pinned memory...)."""
        return torch.empty(self.ctx.layout.nbytes, dtype=torch.uint8)

    # -- for the plugin's I/O -------------------------------------------------------------------
    def emit(self, event: Event) -> None:
        """Queue an event for ``poll`` (from any thread) and wake the poller."""
        with self.cond:
            self._events.append(event)
            self.cond.notify_all()

    def hold(self, buffer: Buffer, worker: int) -> None:
        """Keep ``buffer`` out of ``acquire`` until ``let_go(buffer, worker)`` (may nest)."""
        with self.cond:
            holders = self._holders_of(buffer)
            if holders is not None:
                holders[worker] += 1

    def let_go(self, buffer: Buffer, worker: int) -> None:
        """Undo one ``hold``; a buffer nobody holds may be handed out again."""
        with self.cond:
            holders = self._holders_of(buffer)
            if holders is None:  # the pool was freed (closed) meanwhile
                return
            holders[worker] -= 1
            if holders[worker] <= 0:
                del holders[worker]
                self.cond.notify_all()

    def owns(self, buffer: object) -> bool:
        """Whether ``buffer`` is a ``Buffer`` of this pool (``acquire`` handed it out since ``open``)."""
        index = buffer.index if isinstance(buffer, Buffer) else -1
        return 0 <= index < len(self.buffers) and self.buffers[index] is buffer

    def _holders_of(self, buffer: Buffer) -> Counter | None:
        """Who holds ``buffer``; None if it is not in the pool (any more)."""
        return self._holders[buffer.index] if self.owns(buffer) else None

    # -- SenderEndpoint --------------------------------------------------------------------------
    def acquire(self, deadline: Deadline) -> Buffer:
        """A buffer neither published last nor held; a new one while the pool has room.

        Raises WorkerTimeoutError naming the holders if none frees up by the deadline, TransportError
        if closed, woken (``wake``: the scheme is shutting down) or the allocation fails.
        """
        with self.cond:
            self.check_open()
            def free() -> Buffer | None:
                return next((b for b in self.buffers if b is not self.latest and not self._holders[b.index]), None)

            if free() is None and len(self.buffers) < self.max_buffers:
                index = len(self.buffers)
                try:
                    tensor = self.allocate(index)
                except (OSError, RuntimeError) as exc:
                    raise TransportError(f"{self.what}: cannot allocate a buffer of "
                                         f"{self.ctx.layout.nbytes} bytes: {exc}") from None
                self.buffers.append(Buffer(tensor, index))
                self._holders.append(Counter())
            if self.wait_until(lambda: free() is not None, deadline):
                buffer = free()
                assert buffer is not None  # (wait_until saw one, with self.cond held since)
                return buffer
            self.check_open()
            if self._woken:
                raise TransportError(f"{self.what}: woken while waiting for a free buffer: the scheme is shutting down")
            holders = sorted({w for h in self._holders for w in h})
            raise WorkerTimeoutError(f"{self.what}: all {len(self.buffers)} buffers are still held by workers "
                                     f"{holders} after {deadline.timeout:g} s", holders)

    def publish(self, buffer: Buffer, header: bytes, workers: Sequence[int]) -> None:
        """Make ``buffer`` the latest and ``deliver`` it; raises TransportError for a buffer this pool
        did not hand out, a ``used`` outside the buffer, a header over MAX_HEADER_BYTES, or a closed
        endpoint."""
        self.check_open()
        if not self.owns(buffer):
            raise TransportError(f"{self.what}: publish() got a buffer that acquire() did not return")
        if not 0 <= buffer.used <= buffer.tensor.numel():
            raise TransportError(f"{self.what}: publish() got a buffer with used={buffer.used}, outside "
                                 f"[0, {buffer.tensor.numel()}]")
        if len(header) > MAX_HEADER_BYTES:
            raise TransportError(f"{self.what}: a header of {len(header)} bytes exceeds the limit of "
                                 f"{MAX_HEADER_BYTES} bytes")
        with self.cond:
            self.check_open()
            self.latest = buffer
            self.deliver(buffer, bytes(header), list(workers))

    def poll(self, deadline: Deadline) -> list[Event]:
        """The events emitted since the last call, waiting for one until the deadline; TransportError if closed."""
        with self.cond:
            self.check_open()
            self.wait_until(lambda: bool(self._events), deadline)
            self.check_open()  # closed while waiting
            events, self._events = self._events, []
        return events

    def close(self) -> None:
        super().close()
        with self.cond:
            self._events.clear()
            self.latest = None
            self.buffers = []
            self._holders = []


@dataclass
class _Question:
    """A question to the probe thread (``ReceiverBase._ask_newest``) and its answer."""

    deadline: Deadline
    answer: int | None = None
    answered: bool = False


class ReceiverBase(EndpointBase, ReceiverEndpoint):
    """A receiver endpoint with a newest-only mailbox and a closed guard; the plugin implements ``ack``
    and feeds the mailbox from its own I/O (``put``, ``fail``).

    A plugin that numbers its deliveries and implements ``newest_published`` (and, if it can
    tell, ``arriving``) makes ``recv`` check, when a delivery waited, that it is the newest the
    sender had published (see the module's docstring); ``probe_patience`` bounds that wait.
    """

    #: seconds ``recv`` waits at most, after ``newest_published`` answered, for the delivery it
    #: named (then it returns what arrived): the plugin's bound on one delivery's journey, so a
    #: delivery its sender lost never holds up a ``recv`` that has no deadline
    probe_patience: float = math.inf

    def __init__(self, what: str, ctx: ReceiverContext) -> None:
        super().__init__(what)
        self.ctx = ctx
        self._mail: Delivery | None = None
        self._failure: str | None = None
        self._highest = -1  # the highest delivery number put since open (-1: none numbered)
        #: the thread that asks ``newest_published`` (started by the first probe), the question it
        #: has not taken yet, and the one whose call is out
        self._prober: threading.Thread | None = None
        self._question: _Question | None = None
        self._asking: _Question | None = None

    # -- what the plugin may implement ----------------------------------------------------------
    def newest_published(self, deadline: Deadline) -> int | None:
        """The number of the newest delivery the sender has published to this worker (as ``put``
        numbers them), asked of the sender by ``deadline``; None if it cannot tell (the default:
        no probe). Called on the endpoint's probe thread, without ``self.cond`` held; must not raise.
        A call that outlasts ``deadline`` holds up no ``recv`` (it returns what arrived), and later
        probes answer None until it returns."""
        return None

    def arriving(self) -> bool:
        """Whether a delivery is partly arrived (called with ``self.cond`` held; default False)."""
        return False

    # -- for the plugin's I/O -------------------------------------------------------------------
    def put(self, delivery: Delivery, number: int = -1) -> None:
        """Make ``delivery`` the next one ``recv`` returns; an older one not yet taken is released.
        ``number`` (>= 0, increasing per receiver while it is open) is what ``newest_published``
        names; -1: not numbered. A numbered delivery below the highest put so far (it arrived late,
        e.g. from a pool of I/O threads) never replaces a newer one: it is released at once."""
        older: Delivery | None
        with self.cond:
            if 0 <= number < self._highest:
                older = delivery
            else:
                older, self._mail = self._mail, delivery
                self._highest = max(self._highest, number)
                self.cond.notify_all()
        if older is not None and older.release is not None:
            older.release()

    def fail(self, reason: str) -> None:
        """Make ``recv`` raise TransportError(``reason``) once the mailbox is empty (until ``clear_failure``)."""
        with self.cond:
            self._failure = reason
            self.cond.notify_all()

    def clear_failure(self) -> None:
        """Forget a ``fail()``: ``recv`` waits for deliveries again (e.g. on reopening)."""
        with self.cond:
            self._failure = None

    # -- ReceiverEndpoint ------------------------------------------------------------------------
    def open(self, deadline: Deadline) -> None:
        with self.cond:
            self._highest = -1
        super().open(deadline)

    def recv(self, deadline: Deadline) -> Delivery | None:
        """The newest delivery, waiting for one until the deadline; None if none came. If one waited
        in the mailbox (or was ``arriving``) and the deadline has time left, first the sender's
        newest number (``newest_published``), then a wait, until the deadline or ``probe_patience``,
        for a delivery numbered at least that: what it returns is then never older than what was
        published before the call. With no time to wait, what has arrived.

        Raises TransportError if the endpoint is closed or failed (``fail``) with nothing left to deliver.
        """
        with self.cond:
            self.check_open()
            waited = not deadline.expired() and (self._mail is not None or self.arriving())
        if waited:
            newest = self._ask_newest(deadline)
            if newest is not None:
                with self.cond:
                    patience = Deadline(min(deadline.remaining(), self.probe_patience))
                    self.wait_until(lambda: self._highest >= newest or self._failure is not None, patience)
        with self.cond:
            self.check_open()
            self.wait_until(lambda: self._mail is not None or self._failure is not None, deadline)
            delivery, self._mail = self._mail, None
            if delivery is None and self._failure is not None:
                raise TransportError(f"{self.what}: {self._failure}")
            if delivery is None:
                self.check_open()
            return delivery

    def _ask_newest(self, deadline: Deadline) -> int | None:
        """``newest_published(deadline)``, asked on the endpoint's probe thread (started at the first
        call) and waited for until ``deadline``, ``wake`` or ``close``; None if no answer came by
        then, or while the call for an earlier question is still out (blocked on a cut link)."""
        if type(self).newest_published is ReceiverBase.newest_published:  # no probe: no thread
            return None
        with self.cond:
            if self._asking is not None:
                return None
            if self._prober is None:
                self._prober = threading.Thread(target=self._answer_probes, name=f"wsync-probe ({self.what})",
                                                daemon=True)
                self._prober.start()
            question = self._question = _Question(deadline)
            self.cond.notify_all()
            self.wait_until(lambda: question.answered, deadline)
            return question.answer

    def _answer_probes(self) -> None:
        """The probe thread: answer each question until ``close`` lets it go."""
        me = threading.current_thread()
        while True:
            with self.cond:
                while self._question is None and self._prober is me:
                    self.cond.wait()
                question = self._question
                if question is None or self._prober is not me:
                    return
                self._question, self._asking = None, question
            try:
                answer = self.newest_published(question.deadline)
            except Exception as exc:  # (the plugin's contract says it must not: the recv takes what arrived)
                log.warning("%s: newest_published raised %s: %s", self.what, type(exc).__name__, exc)
                answer = None
            with self.cond:
                question.answer, question.answered = answer, True
                if self._asking is question:
                    self._asking = None
                self.cond.notify_all()

    def close(self) -> None:
        super().close()
        with self.cond:
            delivery, self._mail = self._mail, None
            prober, self._prober, self._question = self._prober, None, None
            self.cond.notify_all()
        if prober is not None and prober is not threading.current_thread():
            prober.join(_PROBER_JOIN_S)  # (a daemon: one still blocked on a dead link ends when its call does)
        if delivery is not None and delivery.release is not None:
            delivery.release()


class AckPusher:
    """Sends a receiver's acks from a thread of its own, in the order given to ``put``.

    For a plugin whose ack is a blocking network call (a store push, an RPC that waits for its
    reply): on a link cut mid-ack, or a sender too busy to answer, that call waits for the
    network's timeouts, and made inside ``ack`` it would hold the ``receive()`` that applied the
    version past its timeout, then raise though the version was applied. ``push(data)`` sends one
    ack and returns once it landed; it raises TransportError if it cannot, and that ack is then
    dropped with a warning, as a stream transport drops one while disconnected (the sender names
    the worker when its send's timeout ends; the worker acks the next version it applies); so is
    one whose push raised anything else, and the next acks still go. The
    thread starts at the first ``put``; at most 64 acks wait (the oldest go first).
    """

    def __init__(self, push: Callable[[bytes], None], what: str) -> None:
        self.push = push
        self.what = what
        self.cond = threading.Condition()
        self.pending: deque[bytes] = deque(maxlen=_ACKS_KEPT)
        self.thread: threading.Thread | None = None
        self.closing = False

    def put(self, data: bytes) -> None:
        """Queue ``data`` to be pushed after the acks before it; returns at once."""
        with self.cond:
            self.pending.append(bytes(data))
            if self.thread is None:
                self.closing = False
                self.thread = threading.Thread(target=self._run, name=f"wsync-ack ({self.what})", daemon=True)
                self.thread.start()
            self.cond.notify_all()

    def close(self, timeout: float, deliver: bool = True) -> None:
        """Stop the thread once the acks queued so far are pushed (waiting ``timeout`` seconds at
        most), or with ``deliver=False`` drop them (the sender is gone or out of reach: each push
        would wait out a dead link). A push still blocked then is left to end on its own (the
        thread is a daemon). A later ``put`` starts a new thread."""
        with self.cond:
            thread, self.closing = self.thread, True
            if not deliver:
                self.pending.clear()
            self.cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        with self.cond:
            if self.thread is thread:
                self.thread = None
                self.pending.clear()  # (what a blocked push kept from going: it never will now)
            self.cond.notify_all()

    def _run(self) -> None:
        me = threading.current_thread()
        while True:
            with self.cond:
                while not self.pending and not self.closing and self.thread is me:
                    self.cond.wait()
                if not self.pending or self.thread is not me:
                    return
                data = self.pending.popleft()
            try:
                self.push(data)
            except TransportError as exc:
                log.warning("%s: an ack did not reach the sender and was dropped: %s", self.what, exc)
            except Exception as exc:  # (the plugin's contract says TransportError: the next acks still go)
                log.warning("%s: pushing an ack raised %s, and it was dropped: %s", self.what, type(exc).__name__, exc)
