"""A worker's side: a background thread takes part in the broadcasts on this worker's link (a
group of two ranks: the sender and this worker) into the worker's own receive buffers (never the
model), so the sender never waits for ``receive()``; a buffer is handed to the core only once the
sender's ``commit`` for it arrives (never for an aborted or half-received one). The mailbox keeps
only the newest: a worker that stops calling ``receive()`` applies the newest version when it
resumes, never the ones that arrived meanwhile. Nor one that arrived before a newer was
published: a ``receive()`` that finds a version waiting (or one being received) first reads from
the sender's store the number of the newest version published to this worker
(``wire.published_key``, written at publish) and waits for that one (``ReceiverBase``'s probe, at
most two ``collective_timeout``: the broadcast in flight and the newest).

The core's acks go to the sender's events from the core's ``AckPusher`` thread, in order, so
``receive()`` never waits on the store (an ack that cannot reach it is dropped, as the stream
transports drop one while disconnected). A heartbeat thread bumps this worker's counter in the store and reads
whether the sender gave this inbox up (``evict``). The worker then joins again under a fresh inbox, so once it is
reachable again (a link restored, a broadcast that failed) it gets the newest version; what its
old link still brings meanwhile is dropped (each delivery first checks the inbox's ``evict`` key,
which the sender sets before it reports the worker gone). A sender that dies makes ``recv``
raise TransportError (its store is gone); one that shuts down makes it return None at once.

Deliveries are adoptable: the core makes the model's tensors views of the buffer instead of
copying it, and releases it once the model moved on. A buffer the core holds is never written;
the pool grows to at most ``_POOL`` = 4 buffers (the one the model views, one the core is
applying, one delivered but not yet taken, one being filled) and usually holds 2. Were all 4
held, the thread would wait for a release, and after ``collective_timeout`` receive into a
scratch buffer it drops (the collective must complete; the sender then sees no ack).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist
from wsync_core import Deadline, Delivery, ReceiverContext, TransportError, WorkerTimeoutError
from wsync_core.endpoints import AckPusher, ReceiverBase
from wsync_core.transport import wait_listening

from . import wire
from .config import Config

__all__ = ["DistributedReceiver", "HEARTBEAT_S"]

log = logging.getLogger("wsync.distributed")

#: seconds between two heartbeats
HEARTBEAT_S = 0.2
#: receive buffers kept at most (see the module's docstring); usually 2: the model's and the next
_POOL = 4

#: the shortest wait a store connect keeps: TCPStore retries about once a second, so a connect
#: given less (0.05 s) took 1.1 s; a probe with less time left than this makes no new connection
_CONNECT_FLOOR_S = 1.0


class DistributedReceiver(ReceiverBase):
    def __init__(self, cfg: Config, ctx: ReceiverContext) -> None:
        super().__init__(f"distributed worker {ctx.worker_idx}", ctx)
        self.cfg = cfg
        self.worker = ctx.worker_idx
        self.nbytes = ctx.layout.nbytes
        self.origin = ctx.origin
        if cfg.backend == "nccl":
            if ctx.device.type != "cuda":
                raise TransportError(f"distributed: backend='nccl' needs a model on CUDA, got {ctx.device}")
            self.device = ctx.device
        else:
            self.device = torch.device("cpu")
        self.inbox = uuid.uuid4().hex
        self.evicted = ""  # the inbox the sender gave up, once the heartbeat thread saw it
        self.beat_at = time.monotonic()  # when a heartbeat last reached the sender's store
        self.pool: list[torch.Tensor] = []
        self.held: set[int] = set()  # slots the core holds, or that wait in the mailbox or for a commit
        self.filled: tuple[int, int, int] | None = None  # (seq, slot, nbytes): received in full, not yet committed
        self.taking = False  # the receive thread is in a broadcast
        self.probe_patience = 2 * cfg.timeout
        self.asker: dist.Store | None = None  # the probe thread's store client (``newest_published``)
        self.stopped = threading.Event()
        self.bye = False  # the sender shut down (its store is gone)
        self.store: dist.Store | None = None
        self.threads: list[threading.Thread] = []
        self.reapers: list[threading.Thread] = []  # threads aborting links that failed (``_drop_link``)
        self.acks = AckPusher(self._push_ack, self.what)
        self.ack_store: dist.Store | None = None  # the ack thread's store client (``_push_ack``)
        self.link: tuple[str, wire.Link] | None = None

    # -- the core's calls ------------------------------------------------------------------
    def start(self, deadline: Deadline) -> None:
        try:
            if not wait_listening(self.cfg.host, self.cfg.port, deadline, lambda: self._woken):
                return  # shutting down: recv returns None, the core's connect() raises StateError
        except TimeoutError as exc:
            raise WorkerTimeoutError(f"{self.what}: no sender store at {self.cfg.host}:{self.cfg.port} within "
                                     f"{deadline.timeout:g} s (is the sender connecting with the same host and "
                                     f"port?): {exc}", []) from None
        self.store = self._client(deadline)  # (the store listens: no second wait)
        try:
            self.asker = self._clone()
            self.ack_store = self._clone()
            self.store.add(wire.heartbeat_key(self.worker), 1)
            for target, name in ((self._beat, "heartbeat"), (self._receive, "receive")):
                thread = threading.Thread(target=target, args=(self._clone(),),
                                          name=f"wsync-distributed-{name}-{self.worker}", daemon=True)
                thread.start()
                self.threads.append(thread)
            self._join(self.store)
        except RuntimeError as exc:
            raise TransportError(f"{self.what}: cannot join the sender at {self.cfg.host}:{self.cfg.port}: "
                                 f"{wire.brief(exc)}") from exc

    def ack(self, data: bytes) -> None:
        """Hand the ack to the ack thread (``AckPusher``), which pushes it to the sender's events
        after the ones before it: a store client on a cut link waits for TCP to give up on it."""
        self.check_open()
        self.acks.put(wire.encode_event(wire.ACK, self.worker, wire.from_inbox(self.inbox, bytes(data))))

    def arriving(self) -> bool:
        """Whether a version is being received, or waits for its commit (``self.cond`` held)."""
        return self.taking or self.filled is not None

    def newest_published(self, deadline: Deadline) -> int | None:
        """The ``seq`` of the newest version the sender published to this worker, read from its store
        (one round trip, bounded by the deadline and ``heartbeat_timeout``); None if there is no
        time left, the sender shut down, or its store does not answer (``recv`` then returns what
        arrived; the heartbeat thread notices a store out of reach). A connection that failed is
        made anew at the next call (the sender's store may be back, or another sender's)."""
        wait = min(deadline.remaining(), max(1.0, self.cfg.heartbeat_timeout))
        if self.bye or self.stopped.is_set() or wait <= 0:
            return None
        asker = self.asker
        if asker is None and wait < _CONNECT_FLOOR_S:  # a connect this short would overrun the deadline
            return None
        try:
            if asker is None:
                asker = self.asker = self._connect(Deadline(wait))
            asker.set_timeout(timedelta(seconds=wait))
            return asker.add(wire.published_key(self.worker), 0)  # 0 if nothing was published to it yet
        except (RuntimeError, TransportError) as exc:
            self.asker = None
            log.debug("%s: cannot read the newest published version: %s", self.what, wire.brief(exc))
            return None

    def stop(self) -> None:
        self.stopped.set()
        # the acks land before the goodbye; none are pushed with no store to tell, or on a dead
        # link (each would wait for TCP to give up)
        self.acks.close(self.cfg.timeout + 5, deliver=not (self.bye or self._cut_off()))
        store = self.store
        # after "bye" the store is gone (its client would log errors); out of reach, a goodbye waits
        # out a dead link: the sender gives this worker up on its own
        if store is not None and not self.bye and not self._cut_off():
            try:
                store.queue_push(wire.EVENTS, wire.encode_event(wire.LEAVE, self.worker,
                                                                wire.from_inbox(self.inbox, b"receiver shut down")))
                store.queue_push(wire.inbox_key(self.inbox), wire.encode_control(wire.Control(kind="stop")))
            except RuntimeError as exc:  # the sender is gone: the threads stop on their own
                log.debug("%s: goodbye failed: %s", self.what, wire.brief(exc))
        self._drop_link()
        # the links' aborts (this one's, and those of links that failed before) end before the process
        # can: gloo threads still running at exit end it with std::terminate ("terminate called
        # without an active exception", SIGABRT)
        for thread in [*self.threads, *self.reapers]:
            thread.join(timeout=self.cfg.timeout + 5)
            if thread.is_alive():
                log.warning("%s: thread %s did not stop", self.what, thread.name)
        self.threads.clear()
        self.reapers.clear()
        self.link = None
        self.store = self.asker = self.ack_store = None

    def _connect(self, deadline: Deadline) -> dist.Store:
        """A new client of the sender's store (``wire.connect``) that fails on a dead link, started
        once the store accepts connections (``wait_listening``: a cut link or a sender gone fails
        by the deadline, quietly, where torch's client would retry past it, printing C++ traces).
        Raises TransportError if none by the deadline, or once shutting down."""
        try:
            if not wait_listening(self.cfg.host, self.cfg.port, deadline, lambda: self._woken or self.stopped.is_set()):
                raise TransportError(f"{self.what}: shutting down")
        except TimeoutError as exc:
            raise TransportError(f"{self.what}: the sender's store at {self.cfg.host}:{self.cfg.port} is out of reach: "
                                 f"{exc}") from None
        return self._client(deadline)

    def _client(self, deadline: Deadline) -> dist.Store:
        """A new client of the sender's store (``wire.connect``) that fails on a dead link."""
        return wire.watched(self.cfg, lambda: wire.connect(self.cfg, deadline))

    def _clone(self) -> dist.Store:
        """Another client of the sender's store, for one more thread, that fails on a dead link."""
        store = self.store
        assert store is not None  # (start connects it first)
        return wire.watched(self.cfg, lambda: wire.clone(store))

    # -- buffers ---------------------------------------------------------------------------
    def _release(self, slot: int) -> None:
        with self.cond:
            self.held.discard(slot)
            self.cond.notify_all()

    def _drop_filled(self) -> None:
        with self.cond:
            filled, self.filled = self.filled, None
            if filled is not None:
                self.held.discard(filled[1])
                self.cond.notify_all()

    def _cut_off(self) -> bool:
        """Whether the sender's store has been out of reach for twice ``heartbeat_timeout``: the
        sender is dead, or cut off and has given this worker up already."""
        return time.monotonic() - self.beat_at > 2 * self.cfg.heartbeat_timeout

    def _slot(self) -> int | None:
        """A buffer to fill, marked held: free, else new (up to ``_POOL``), else one the core
        releases in time. None: none freed up, or the sender is out of reach."""
        deadline = Deadline(self.cfg.timeout)
        with self.cond:
            while True:
                slot = next((i for i in range(len(self.pool)) if i not in self.held), None)
                if slot is None and len(self.pool) < _POOL:
                    self.pool.append(torch.empty(self.nbytes, dtype=torch.uint8, device=self.device))
                    slot = len(self.pool) - 1
                if slot is not None:
                    self.held.add(slot)
                    return slot
                if deadline.expired() or self.stopped.is_set() or self._cut_off():
                    return None
                self.cond.wait(deadline.slice(1.0))

    def _deliver(self, store: dist.Store, inbox: str, slot: int, header: bytes, nbytes: int, seq: int) -> None:
        """Hand the first ``nbytes`` of the buffer in ``slot`` (what the sender published as ``seq``)
        to the core, if the sender still serves this worker under ``inbox``; else free it (the
        worker joins again and gets the newest version then)."""
        if self._served(store, inbox):
            buffer = self.pool[slot]
            payload = buffer if nbytes == buffer.numel() else buffer[:nbytes]
            self.put(Delivery(header, payload, lambda: self._release(slot), adoptable=True), seq)
        else:
            self._release(slot)

    def _served(self, store: dist.Store, inbox: str) -> bool:
        """Whether the sender has not given up ``inbox`` (its ``evict`` key, read over ``store``,
        is unset). A given-up worker applies nothing that was on its old link when it was cut (the
        sender counts it gone until it joins again, so a version it applied then would count
        nowhere); a store that does not answer in ``heartbeat_timeout`` counts as given up."""
        if self.evicted == inbox:
            return False
        wait = max(1.0, self.cfg.heartbeat_timeout)
        try:
            store.set_timeout(timedelta(seconds=wait))
            try:
                evicted = store.check([wire.evict_key(inbox)])
            finally:
                store.set_timeout(wire.POP_TIMEOUT)
        except RuntimeError as exc:
            log.warning("%s: cannot ask the sender whether it still serves this worker: %s; joining again",
                        self.what, wire.brief(exc))
            evicted = True
        if evicted:
            if not self.stopped.is_set():
                log.warning("%s: the sender gave this worker up while a version was on its way; dropping it "
                            "and joining again", self.what)
            self.evicted = inbox
            return False
        return True

    # -- threads ---------------------------------------------------------------------------
    def _join(self, store: dist.Store) -> None:
        """Announce this worker under the current inbox (the sender then sees ``Joined``)."""
        join = json.dumps({"inbox": self.inbox, "nbytes": self.nbytes, "origin": self.origin}).encode()
        store.queue_push(wire.EVENTS, wire.encode_event(wire.JOIN, self.worker, join))

    def _push_ack(self, event: bytes) -> None:
        """Push one ack event to the sender's events (on the ``AckPusher``'s thread). A client that
        failed (a link cut, then back: its socket never recovers) is replaced by a new connection,
        once; raises TransportError if the ack still cannot be pushed."""
        wait = max(1.0, self.cfg.heartbeat_timeout)
        for attempt in range(2):
            try:
                if self.ack_store is None:
                    self.ack_store = self._connect(Deadline(wait))
                self.ack_store.queue_push(wire.EVENTS, event)
                return
            except (RuntimeError, TransportError) as exc:
                self.ack_store = None  # the next try, or the next ack, connects again
                if attempt:
                    raise TransportError(f"{self.what}: cannot push an ack to the sender's store at "
                                         f"{self.cfg.host}:{self.cfg.port}: {wire.brief(exc)}") from exc

    def _beat(self, store: dist.Store | None) -> None:
        """Bump the heartbeat; note an eviction. A store call that fails (a cut link, a sender
        gone) is retried on a new connection, each call and connect bounded, so beats resume once
        the link is back and ``close`` never waits long for this thread."""
        key = wire.heartbeat_key(self.worker)
        wait = max(1.0, self.cfg.heartbeat_timeout)
        if store is not None:
            store.set_timeout(timedelta(seconds=wait))
        while not self.stopped.wait(HEARTBEAT_S):
            try:
                if store is None:
                    store = self._connect(Deadline(wait))
                    store.set_timeout(timedelta(seconds=wait))
                store.add(key, 1)
                self.beat_at = time.monotonic()
                inbox = self.inbox
                if inbox != self.evicted and store.check([wire.evict_key(inbox)]):
                    log.warning("%s: the sender gave this worker up; joining again", self.what)
                    self.evicted = inbox
            except (RuntimeError, TransportError) as exc:
                log.debug("%s: heartbeat failed: %s", self.what, wire.brief(exc))
                store = None

    def _receive(self, store: dist.Store) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while not self.stopped.is_set():
            if self.evicted == self.inbox:
                rejoined = self._rejoin()
                if rejoined is None:
                    return
                store = rejoined
                continue
            try:
                raw = store.queue_pop(wire.inbox_key(self.inbox), True)
            except RuntimeError as exc:
                if isinstance(exc, dist.DistStoreError) and "timeout" in str(exc).lower():
                    continue
                if not self.stopped.is_set():  # the sender died, or this connection broke: join again
                    log.warning("%s: lost the sender's store at %s:%d: %s", self.what, self.cfg.host, self.cfg.port,
                                wire.brief(exc))
                    self.evicted = self.inbox
                continue
            try:
                ctl, header = wire.decode_control(raw)
            except TransportError as exc:
                log.warning("%s: ignoring a bad control message: %s", self.what, exc)
                continue
            if ctl.kind == "bye":  # the sender's store closes next: stop using it; recv returns None
                self.bye = True
                self.stopped.set()
                self.wake()
                return
            if ctl.kind == "stop":
                continue
            if ctl.kind == "refused":  # (its index out of range): the reason comes as the header
                self.stopped.set()
                self.fail(f"the sender refused it: {header[:300].decode('utf-8', 'replace')}")
                return
            if ctl.kind == "replaced":  # no more heartbeats: the index is the other receiver's
                self.stopped.set()
                self.fail(f"another receiver joined the sender as worker {self.worker} and took its "
                          f"place (a process started again under the same worker_idx while this one runs?); this "
                          f"one gets no more versions and keeps the one it holds")
                return
            if ctl.kind == "evict":
                self.evicted = self.inbox
            elif ctl.kind == "commit":
                with self.cond:
                    filled, self.filled = self.filled, None
                if filled is not None and filled[0] == ctl.seq:
                    self._deliver(store, self.inbox, filled[1], header, filled[2], ctl.seq)
                elif filled is not None:
                    self._release(filled[1])
            elif ctl.kind == "abort":
                with self.cond:
                    if self.filled is not None and self.filled[0] == ctl.seq:
                        self._drop_filled()
            elif ctl.group is None or not 0 <= ctl.nbytes <= self.nbytes:  # fewer: a prefix (a delta)
                self._drop_filled()
                self.put(Delivery(header, torch.empty(0, dtype=torch.uint8)), ctl.seq)  # the core reports the mismatch
            else:
                self._take_part(store, ctl, header)

    def _rejoin(self) -> dist.Store | None:
        """The sender gave this worker up, or its link failed: drop the link and what it
        half-delivered, then join again under a fresh inbox over a new store connection (returned;
        None once closing). Until that succeeds, ``recv`` raises TransportError (the sender is dead
        or out of reach); each try is bounded, so a dead sender never stalls this thread."""
        self._drop_link()
        self._drop_filled()
        self.inbox = uuid.uuid4().hex
        wait = max(1.0, self.cfg.heartbeat_timeout)
        while not self.stopped.is_set():
            try:
                store = self._connect(Deadline(wait))
                self._join(store)
            except (RuntimeError, TransportError) as exc:
                self.fail(f"the sender's store at {self.cfg.host}:{self.cfg.port} is out of reach (the sender "
                          f"died, or the link is cut): {wire.brief(exc)}")
                self.stopped.wait(HEARTBEAT_S)
                continue
            self.clear_failure()
            return store
        return None

    def _drop_link(self, slot: int | None = None, works: list | None = None) -> None:
        """Forget the link; a thread of its own (in ``reapers``, which ``stop`` joins) aborts it and
        lets go of its ``works`` (gloo may wait for a peer that is gone in either), then frees
        ``slot``, which those works may write until then."""
        link, self.link = self.link, None
        if link is None and works is None:
            if slot is not None:
                self._release(slot)
            return
        pending = [works]  # the last reference: dropped in the reaper, never in the receive thread

        def reap() -> None:
            if link is not None:
                wire.abort(link[1])
            wire.settle(pending.pop() or [], self.cfg.timeout)
            if slot is not None:
                self._release(slot)

        reaper = threading.Thread(target=reap, name=f"wsync-distributed-abort-{self.worker}", daemon=True)
        reaper.start()
        self.reapers = [r for r in self.reapers if r.is_alive()] + [reaper]

    def _take_part(self, store: dist.Store, ctl: wire.Control, header: bytes) -> None:
        """Receive the broadcast of ``ctl.seq`` into a free buffer; deliver it once complete if
        ``header`` came with it, else it waits there for its commit. If the link fails, join again."""
        self._drop_filled()  # the sender moved on: what it left uncommitted is dead
        with self.cond:
            self.taking = True
        try:
            self._take_into(store, ctl, header)
        finally:
            with self.cond:
                self.taking = False

    def _take_into(self, store: dist.Store, ctl: wire.Control, header: bytes) -> None:
        """``_take_part`` while ``taking`` is set."""
        slot = self._slot()
        if slot is None:  # the collective must still complete: receive into scratch, deliver nothing
            log.warning("%s: all %d receive buffers are held; dropping the version numbered %d", self.what,
                        _POOL, ctl.seq)
            buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        else:
            buffer = self.pool[slot]
        inbox = self.inbox
        works: list = []
        error = ""
        group = ctl.group
        assert group is not None  # (_receive takes a part only for a control that names its link)
        try:
            if self.link is None or self.link[0] != group:
                self._drop_link()
                self.link = (group, wire.new_group(self.cfg, store, group, 1))
            if self.nbytes:
                works = wire.broadcast(self.link[1], buffer, ctl.spans())
                wire.wait_works(works, Deadline(self.cfg.timeout), f"link {ctl.group}",
                                lambda: self.stopped.is_set() or self.evicted == inbox or self._cut_off(),
                                self.device.type == "cuda")
        except Exception as exc:  # gloo's errors, and what a garbage rendezvous key written to the store
            # by anyone makes it raise (MemoryError: std::bad_alloc): the link failed, join again (before,
            # it ended the receive thread: the worker never took another version)
            error = wire.brief(exc)  # a string: the traceback would keep the works alive in this thread
        if error:
            self._drop_link(slot, works)
            del works
            if not self.stopped.is_set():
                log.warning("%s: link %s failed: %s; joining again", self.what, ctl.group, error)
                self.evicted = inbox
            return
        if slot is None:
            return
        if header:
            self._deliver(store, inbox, slot, header, ctl.nbytes, ctl.seq)
        else:
            with self.cond:
                self.filled = (ctl.seq, slot, ctl.nbytes)

