"""The trainer's side: hosts the store and sends each version to each worker over its own link.

A *link* is a private process group of two ranks (the sender, rank 0, and one worker, rank 1),
made on the worker's first delivery under a name no other link uses. Each worker has a *lane*: a
thread that sends that worker its deliveries over its link, one at a time, newest first (a
delivery queued behind the one in flight is replaced by a newer one, never queued after it).
A dead, slow or cut-off worker therefore stalls only its own lane: the others' links and threads
never wait for it. A lane whose link fails, or whose worker's heartbeat stays silent for
``heartbeat_timeout``, is given up: its worker is reported ``Left`` (the core's
``WorkerTimeoutError`` names it alone), its link aborted, and an ``evict`` tells the worker, if
it still runs, to join again, which gives it the newest version (``Joined``).

Protocol (see ``wire``): a buffer's contents get a number (``seq``) at ``acquire``. A lane tells
its worker ``data(seq)``, broadcasts the bytes over the link and sends ``commit(seq, header)``
only for a buffer the core published to that worker; receivers deliver nothing before the commit.
The endpoint streams: the core's ``ready`` calls start the lanes while it still copies the
snapshot (bucket k travels while bucket k+1 is copied), and the commit follows ``publish``. A
stream the core abandons (it calls ``acquire``, ``poll`` or ``close`` without publishing it) is
sent to the end, so the worker's collective completes, then ``abort(seq)`` drops it.

At each publish, before any lane may send it, the sender writes the ``seq`` it published to each
worker to the store (``wire.published_key``, one ``multi_set``, which does not wait for a reply):
a receiver that finds a version waiting at ``receive()`` reads it there and waits for that one.

Threads, each with its own store client: an event reader (joins, acks, leaves), a watcher (the
heartbeats) and one lane per connected worker.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from wsync_core import Acked, Deadline, Joined, Left, SenderContext, TransportError
from wsync_core import Buffer
from wsync_core.endpoints import SenderBase
from wsync_core import forked
from wsync_core.forked import close_inherited
from wsync_core.protocol import decode_json
from wsync_core.transport import MAX_ORIGIN_BYTES, claim_refusal, index_refusal, origin_refusal

from . import wire
from .config import Config

__all__ = ["DistributedSender"]

log = logging.getLogger("wsync.distributed")

#: links one worker index may have in set-up at once, its current lane's and those of lanes given
#: up meanwhile (a set-up waits for its peer until gloo gives up connecting, which under load or
#: with garbage rendezvous keys takes tens of seconds): a join beyond it waits until one set-up
#: ends, so a flood of joins from anyone who reaches the store costs a bounded number of threads
#: and sockets. A worker restarting in a loop, or one whose links fail, stays far below it.
_SETUPS_PER_WORKER = 16
#: how long ``close`` waits for each lane's thread (one aborting a link to a dead peer may take longer)
_LANE_JOIN_S = 5.0
#: how often the watcher reads the heartbeats
_HEARTBEAT_CHECK_S = 0.25
#: the longest one read of the heartbeats waits (a key deleted between its check and its read)
_READ_S = timedelta(seconds=5)
#: the core reports progress (``ready``) at least this many times per bucket
_READY_PER_BUCKET = 2
#: the first bucket's size at most: a stream starts sending once this much is copied (later
#: buckets are ``bucket_mb``; many small collectives cost CPU that a busy host lacks)
_FIRST_BUCKET = 8 << 20


@dataclass(eq=False)
class _Stream:
    """A snapshot being written (bytes ``[0, ready)`` final); ``headers``: what ``publish`` gave
    each worker for it; ``over``: the core is done with it (published or abandoned)."""

    buffer: Buffer
    seq: int
    ready: int = 0
    headers: dict[int, bytes] = field(default_factory=dict)
    over: bool = False
    abandoned: bool = False
    sent: bool = False  # some lane has it


@dataclass(eq=False)
class _Job:
    """One delivery for one lane: the bytes of ``buffer`` (numbered ``seq``), with ``header`` when
    known up front, else from ``stream`` once published; only its first ``nbytes`` (-1: all)."""

    buffer: Buffer
    seq: int
    header: bytes | None = None
    stream: _Stream | None = None
    nbytes: int = -1


@dataclass(eq=False)
class _Lane:
    """One connected worker: where it reads control messages, its link, its next job, its thread."""

    worker: int
    inbox: str
    nbytes: int
    link: str
    group: wire.Link | None = None
    pending: _Job | None = None
    current: _Job | None = None
    beats: int = -1
    seen: float = field(default_factory=time.monotonic)
    gone: bool = False
    setting_up: bool = False  # its thread is making its link (waiting for the worker's side)
    thread: threading.Thread | None = None


class DistributedSender(SenderBase):
    #: a delivery broadcasts ``buffer.used`` bytes (a delta, a wire dtype): the control message says how many
    prefix_publish = True

    def __init__(self, cfg: Config, ctx: SenderContext) -> None:
        # in use at once: the core's latest, the one it writes, and per worker the one on its link
        # (the one queued behind it is the latest or the stream)
        super().__init__("distributed sender", ctx, max_buffers=ctx.num_workers + 3)
        self.cfg = cfg
        self.nbytes = ctx.layout.nbytes
        if cfg.backend == "nccl":
            if ctx.device.type != "cuda":
                raise TransportError(f"distributed: backend='nccl' needs a model on CUDA, got {ctx.device}; "
                                     f"use backend='gloo' for CPU models")
            self.device = ctx.device
        else:
            self.device = torch.device("cpu")
        self.first_bytes = 0  # the first bucket's size; 0: like the others
        if cfg.stream:
            self.first_bytes = min(cfg.bucket_bytes, _FIRST_BUCKET)
            self.stream_bytes = max(1, min(cfg.bucket_bytes // _READY_PER_BUCKET, self.first_bytes))
        self.lanes: dict[int, _Lane] = {}
        self.running: dict[int, set[_Lane]] = {}  # worker index -> its lanes whose thread has not ended
        self.waiting: dict[int, tuple[str, int]] = {}  # worker index -> (inbox, nbytes) of a join held back
        self.links = 0  # links named so far (each name is used once)
        self.seq = 0
        self.seqs: dict[int, int] = {}  # buffer index -> seq of its contents
        self.acquired: Buffer | None = None  # the buffer last acquired, unless abandoned half-written
        self.stream: _Stream | None = None  # ready() called, the core not done with it yet
        self.closing = False
        self.failure: str | None = None  # why the event reader stopped before close: publishes raise it
        self.store: dist.Store | None = None
        self.marks: dist.Store | None = None  # the core's thread's store client: the published numbers
        self.sock: socket.socket | None = None
        self.threads: list[threading.Thread] = []

    # -- the core's calls ------------------------------------------------------------------
    def start(self, deadline: Deadline) -> None:
        self.failure = None
        self.store, self.sock = wire.listen(self.cfg)
        forked.watch(self)
        self.marks = wire.clone(self.store, timedelta(seconds=self.cfg.timeout))
        for target, name, wait in ((self._read_events, "events", wire.POP_TIMEOUT), (self._watch, "watch", _READ_S)):
            thread = threading.Thread(target=target, args=(wire.clone(self.store, wait),),
                                      name=f"wsync-distributed-{name}", daemon=True)
            thread.start()
            self.threads.append(thread)

    def allocate(self, index: int) -> torch.Tensor:
        return torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)

    def acquire(self, deadline: Deadline) -> Buffer:
        """A buffer no lane reads and that is not the core's latest; raises WorkerTimeoutError naming
        the workers whose lanes hold every buffer."""
        with self.cond:
            self.check_open()
            self._end_stream()
            if self.acquired is not None:  # written in full, published or not: the core may publish it again
                self.latest = self.acquired
        buffer = super().acquire(deadline)
        with self.cond:
            self.seq += 1
            self.seqs[buffer.index] = self.seq
            self.acquired = buffer
        return buffer

    def ready(self, buffer: Buffer, nbytes: int, workers: Sequence[int]) -> None:
        """Bytes ``[0, nbytes)`` of ``buffer`` are final: the lanes of ``workers`` may send them (the
        first call starts the stream). A CUDA buffer (NCCL) is final on the device too: the core
        synchronizes its stream before each call, so the links' streams need no event."""
        with self.cond:
            self.check_open()
            if not self.owns(buffer):
                raise TransportError("distributed: ready() got a buffer that acquire() did not return")
            found = buffer
            stream = self.stream
            if stream is None or stream.buffer is not found:
                self._end_stream()
                stream = self.stream = _Stream(found, self.seqs[found.index])
                for w in sorted(set(workers)):
                    lane = self.lanes.get(w)
                    if lane is not None and lane.nbytes == self.nbytes:  # a misfit gets its header at publish
                        self._queue(lane, _Job(found, stream.seq, stream=stream))
                        stream.sent = True
            stream.ready = nbytes
            self.cond.notify_all()

    def deliver(self, buffer: Buffer, header: bytes, workers: Sequence[int]) -> None:
        """The core published ``buffer`` to ``workers``: a lane streaming it commits it once sent;
        the others get it whole, header first (called with ``cond`` held)."""
        if self.failure is not None:
            raise TransportError(f"distributed sender: {self.failure}")
        if len(header) > wire.MAX_HEADER:
            raise TransportError(f"distributed: a header of {len(header)} bytes exceeds this transport's limit of "
                                 f"{wire.MAX_HEADER} bytes (the store carries it)")
        stream = self.stream if self.stream is not None and self.stream.buffer is buffer else None
        seq = self.seqs[buffer.index]
        served = [w for w in workers if w in self.lanes]  # others are not connected (any more): Left, or never joined
        if served:
            marks = self.marks
            assert marks is not None  # (start made it; the core publishes only while the endpoint is open)
            try:  # before any lane may send it: a receiver that asks is told this one or a newer
                keys = [wire.published_key(w) for w in served]
                marks.multi_set(keys, [str(seq)] * len(served))  # type: ignore[attr-defined]  # (torch's stubs lack it)
            except RuntimeError as exc:
                raise TransportError(f"distributed: cannot write the published version's number to this "
                                     f"sender's own store: {wire.brief(exc)}") from exc
        for w in served:
            lane = self.lanes[w]
            if stream is not None and self._streams_to(lane, stream):
                stream.headers[w] = header
            else:
                self._queue(lane, _Job(buffer, seq, header=header, nbytes=buffer.used))
        self.acquired = None
        self.cond.notify_all()

    def poll(self, deadline: Deadline) -> list:
        with self.cond:
            if self.is_open:
                self._end_stream()
        return super().poll(deadline)

    def forget_in_child(self) -> None:
        """A forked child lets go of its copies of the store's sockets, so the parent's port is free
        once it closes (the child never uses them)."""
        close_inherited(ports=[self.cfg.port])

    def stop(self) -> None:
        with self.cond:
            self._end_stream()
            self.closing = True
            lanes = list(self.lanes.values())
            self.lanes.clear()
            for lane in lanes:
                lane.gone = True
            self.cond.notify_all()
        store = self.store
        if store is not None:
            bye = wire.encode_control(wire.Control(kind="bye"))
            try:
                for lane in lanes:
                    store.queue_push(wire.inbox_key(lane.inbox), bye)
                store.queue_push(wire.EVENTS, wire.encode_event(wire.STOP, 0))
            except (RuntimeError, OSError) as exc:
                log.warning("distributed sender: could not say goodbye to the workers: %s", wire.brief(exc))
        for thread in self.threads:
            thread.join(timeout=self.cfg.timeout + 5)
            if thread.is_alive():
                log.warning("distributed sender: thread %s did not stop", thread.name)
        for lane in lanes:  # a lane aborting a link to a peer that is gone ends on its own, later
            if lane.thread is not None:
                lane.thread.join(timeout=_LANE_JOIN_S)
        self.threads.clear()
        self.store = self.marks = None
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        forked.unwatch(self)  # last: a child forked while it closed lets go of what was still open

    # -- buffers and streams ---------------------------------------------------------------
    def _end_stream(self) -> None:
        """The core is done with the open stream: lanes waiting for its header stop waiting; one
        never published is dropped by its receivers once sent (caller holds ``cond``)."""
        stream, self.stream = self.stream, None
        if stream is None:
            return
        stream.over = True
        if stream.ready < self.nbytes and self.acquired is stream.buffer:
            self.acquired = None  # half-written: free to write again
        if not stream.headers:
            stream.abandoned = True
            if stream.sent:
                log.info("distributed sender: the snapshot numbered %d was abandoned before publish; its receivers "
                         "drop it", stream.seq)
        self.cond.notify_all()

    @staticmethod
    def _streams_to(lane: _Lane, stream: _Stream) -> bool:
        """Whether ``lane`` sends ``stream`` (queued or on its link), so it commits it itself
        (caller holds ``cond``)."""
        return any(job is not None and job.stream is stream for job in (lane.pending, lane.current))

    def _queue(self, lane: _Lane, job: _Job) -> None:
        """Make ``job`` the lane's next; it replaces one queued that has not started (caller holds ``cond``)."""
        self.hold(job.buffer, lane.worker)
        old, lane.pending = lane.pending, job
        if old is not None:
            self.let_go(old.buffer, lane.worker)
        self.cond.notify_all()

    # -- membership ------------------------------------------------------------------------
    def _join(self, w: int, inbox: str, nbytes: int) -> None:
        """Worker ``w`` (re)joined under ``inbox``: a fresh lane and link replace any old one, whose
        inbox is told it was replaced (a receiver still reading it stops; one that joined again
        reads it no more) (caller holds ``cond``)."""
        old = self.lanes.pop(w, None)
        if old is not None:
            self._retire(old)
            store = self.store
            assert store is not None  # (stop drops it only once closing, which the caller checked under cond)
            try:  # the store is this process's: the call does not wait on the worker
                store.queue_push(wire.inbox_key(old.inbox), wire.encode_control(wire.Control(kind="replaced")))
            except (RuntimeError, OSError) as exc:
                log.debug("distributed sender: could not tell worker %d's old inbox: %s", w, wire.brief(exc))
        self.links += 1
        lane = _Lane(w, inbox, nbytes, link=f"{self.links}")
        lane.thread = threading.Thread(target=self._run_lane, args=(lane,), name=f"wsync-distributed-lane-{w}",
                                       daemon=True)
        self.lanes[w] = lane
        self.running.setdefault(w, set()).add(lane)
        lane.thread.start()
        self.emit(Joined(w))

    def _retire(self, lane: _Lane) -> None:
        """Stop ``lane``: its queued job is dropped; its thread stops waiting for its current one,
        aborts its link (only that thread waits for gloo's abort) and ends (caller holds ``cond``)."""
        lane.gone = True
        job, lane.pending = lane.pending, None
        if job is not None:
            self.let_go(job.buffer, lane.worker)
        self.cond.notify_all()  # its thread sees ``gone``, ends its broadcast and aborts its link

    def _lose(self, lane: _Lane, reason: str, store: dist.Store | None) -> None:
        """Give ``lane``'s worker up: report it Left; with ``store`` (a failure, not a goodbye) tell
        it, if it runs and can hear, to join again.

        The ``evict`` key is set before ``Left`` is reported (and under ``cond``, so no join of the
        worker is handled in between): from then on the worker applies nothing more from its old
        inbox (it checks the key before each delivery), so a worker the core counts gone holds no
        version the core does not know of; it joins again and gets the newest."""
        with self.cond:
            if self.lanes.get(lane.worker) is not lane:
                return
            del self.lanes[lane.worker]
            self._retire(lane)
            evict = store if not self.closing else None
            if evict is not None:
                try:  # the store is this process's: the call does not wait on the worker
                    evict.set(wire.evict_key(lane.inbox), b"1")  # type: ignore[arg-type]  # (torch's stubs: str only)
                except (RuntimeError, OSError) as exc:
                    log.warning("distributed sender: could not mark worker %d given up: %s", lane.worker,
                                wire.brief(exc))
            if not self.closing:
                log.log(logging.WARNING if store is not None else logging.INFO,
                        "distributed sender: worker %d is given up: %s", lane.worker, reason)
                self.emit(Left(lane.worker, reason))
        if evict is not None:
            try:
                evict.queue_push(wire.inbox_key(lane.inbox), wire.encode_control(wire.Control(kind="evict")))
            except (RuntimeError, OSError) as exc:
                log.debug("distributed sender: could not evict worker %d: %s", lane.worker, wire.brief(exc))

    # -- the watcher -----------------------------------------------------------------------
    def _watch(self, store: dist.Store) -> None:
        """Give up every worker whose heartbeat stays silent for ``heartbeat_timeout``."""
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.closing, _HEARTBEAT_CHECK_S)
                if self.closing:
                    return
                lanes = list(self.lanes.values())
            if not lanes:
                continue
            try:
                values = _heartbeats(store, [wire.heartbeat_key(lane.worker) for lane in lanes])
            except RuntimeError as exc:
                log.warning("distributed sender: cannot read heartbeats: %s", wire.brief(exc))
                continue
            now = time.monotonic()
            for lane, value in zip(lanes, values):
                count = _count(value)  # None: no key, or something else wrote it (the store takes anyone's writes)
                if count is not None and count != lane.beats:
                    lane.beats, lane.seen = count, now
                elif now - lane.seen > self.cfg.heartbeat_timeout:
                    what = ("no heartbeat" if count is not None else "no heartbeat key" if value is None
                            else f"its heartbeat key holds {bytes(value)[:40]!r}, no count,")
                    self._lose(lane, f"{what} for {now - lane.seen:.1f} s (heartbeat_timeout="
                                     f"{self.cfg.heartbeat_timeout:g}); the worker died, hangs or is cut off", store)

    # -- the event reader --------------------------------------------------------------------
    def _read_events(self, store: dist.Store) -> None:
        """Read joins, acks and goodbyes until close; if it must stop before, give every worker up
        saying why (a send then fails at once, naming it, instead of waiting for acks never read)."""
        try:
            self._read_events_until_closed(store)
        except Exception as exc:  # noqa: BLE001 - reported to the user below, from every send
            log.exception("distributed sender: the event reader failed")
            self._reader_failed(f"{type(exc).__name__}: {wire.brief(exc)}", store)

    def _reader_failed(self, reason: str, store: dist.Store) -> None:
        with self.cond:
            if self.closing:
                return
            self.failure = f"its event reader stopped ({reason}): no join or ack can be read"
            lanes = list(self.lanes.values())
        for lane in lanes:
            self._lose(lane, self.failure, store)

    def _read_events_until_closed(self, store: dist.Store) -> None:
        while True:
            try:
                raw = store.queue_pop(wire.EVENTS, True)
            except RuntimeError as exc:
                if isinstance(exc, dist.DistStoreError) and "timeout" in str(exc).lower() and not self.closing:
                    continue
                if not self.closing:
                    self._reader_failed(wire.brief(exc), store)
                return
            try:
                kind, w, data = wire.decode_event(raw)
                if kind == wire.STOP:
                    if self.closing:
                        return
                    continue
                if w >= self.ctx.num_workers and kind != wire.JOIN:
                    raise TransportError(f"event from worker {w}, but num_workers={self.ctx.num_workers}")
                self._on_event(kind, w, data, store)
            except TransportError as exc:
                log.warning("distributed sender: ignoring a bad event: %s", exc)

    def _on_event(self, kind: bytes, w: int, data: bytes, store: dist.Store) -> None:
        if kind == wire.JOIN:
            obj = decode_json(data, f"join from worker {w}", 4096)
            try:
                inbox, nbytes, origin = obj["inbox"], obj["nbytes"], obj.get("origin", "")
                if not (isinstance(inbox, str) and 0 < len(inbox) <= 64 and inbox.isalnum()
                        and isinstance(nbytes, int) and not isinstance(nbytes, bool) and nbytes >= 0
                        and isinstance(origin, str) and len(origin) <= MAX_ORIGIN_BYTES):
                    raise ValueError(obj)
            except (ValueError, KeyError, TypeError) as exc:
                raise TransportError(f"malformed join from worker {w}: {exc}") from None
            why = index_refusal(w, self.ctx.num_workers) or origin_refusal(w, origin, self.ctx.origin)
            with self.cond:
                held = self.lanes.get(w)
                if why is None and held is not None and not held.gone and held.nbytes == self.ctx.layout.nbytes \
                        and nbytes != self.ctx.layout.nbytes:
                    why = claim_refusal(w, f"a payload of {nbytes} bytes; this sender's has {self.ctx.layout.nbytes}")
            if why is not None:  # told, so that it stops waiting
                log.warning("distributed sender refused a join: %s", why)
                try:  # (a stray worker's inbox: failing to tell it must not stop this reader)
                    store.queue_push(wire.inbox_key(inbox), wire.encode_control(wire.Control(kind="refused"),
                                                                                why.encode()))
                except (RuntimeError, OSError) as exc:
                    log.debug("distributed sender: could not tell worker %d it was refused: %s", w, wire.brief(exc))
                return
            with self.cond:
                if self.closing:
                    return
                if self._setups(w) >= _SETUPS_PER_WORKER:
                    if w not in self.waiting:
                        log.warning("distributed sender: worker %d joined again while %d of its links are being set "
                                    "up; the newest join waits for one (a flood of joins?)", w, self._setups(w))
                    self.waiting[w] = (inbox, nbytes)
                    return
                self._join(w, inbox, nbytes)
        elif kind in (wire.ACK, wire.LEAVE):
            inbox, data = wire.split_inbox(data)
            with self.cond:
                lane = self.lanes.get(w)
                if lane is not None and lane.inbox != inbox:  # from a receiver another one replaced
                    lane = None
                if lane is not None:  # an ack is a sign of life, as a heartbeat is (whose link may be slower to recover)
                    lane.seen = time.monotonic()
            if lane is not None and kind == wire.ACK:
                self.emit(Acked(w, data))
            elif lane is not None:
                self._lose(lane, data.decode("utf-8", "replace")[:200] or "receiver shut down", None)

    # -- a lane ----------------------------------------------------------------------------
    def _run_lane(self, lane: _Lane) -> None:
        """Send ``lane``'s jobs one at a time until it is retired; give its worker up if its link fails."""
        try:
            self._send_jobs(lane)
        finally:
            with self.cond:
                self.running[lane.worker].discard(lane)
                self._take_held(lane.worker)

    def _setups(self, w: int) -> int:
        """How many of worker ``w``'s lanes are setting up their link (caller holds ``cond``)."""
        return sum(lane.setting_up for lane in self.running.get(w, ()))

    def _take_held(self, w: int) -> None:
        """Take worker ``w``'s join held back (``_SETUPS_PER_WORKER``), if any, once fewer of its
        links are being set up (caller holds ``cond``)."""
        if w in self.waiting and not self.closing and self._setups(w) < _SETUPS_PER_WORKER:
            self._join(w, *self.waiting.pop(w))

    def _send_jobs(self, lane: _Lane) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        try:
            if self.store is None:  # closed meanwhile (stop cleared the lanes first: _lose does nothing then)
                raise RuntimeError("the sender is closed")
            store = wire.clone(self.store)
        except (RuntimeError, AttributeError) as exc:
            self._lose(lane, f"no store client for its lane: {wire.brief(exc)}", None)
            return
        while True:
            with self.cond:
                self.cond.wait_for(lambda: lane.pending is not None or lane.gone or self.closing)
                if lane.gone or self.closing:
                    break
                job, lane.pending = lane.pending, None
                assert job is not None  # (the wait ended on it: not gone, not closing)
                lane.current = job
            try:
                self._send(store, lane, job)
            except (RuntimeError, TransportError) as exc:
                self._lose(lane, f"its link failed: {wire.brief(exc)}", store)
            finally:
                with self.cond:
                    lane.current = None
                    self.let_go(job.buffer, lane.worker)
        wire.abort(lane.group)
        lane.group = None

    def _send(self, store: dist.Store, lane: _Lane, job: _Job) -> None:
        """Send ``job`` to ``lane``'s worker: ``data``, the bytes (as the stream has them), then the
        commit or abort. Raises TransportError or RuntimeError if the link or the store fails."""
        inbox = wire.inbox_key(lane.inbox)
        if lane.nbytes != self.nbytes:  # the core rejects it from the header; no broadcast it could not take part in
            if job.header is not None:
                ctl = wire.Control(None, self.nbytes, self.cfg.bucket_bytes, seq=job.seq)
                store.queue_push(inbox, wire.encode_control(ctl, job.header))
            return
        stream = job.stream
        header = job.header if stream is None else self._header(stream, lane, wait=False)
        nbytes = self.nbytes if job.nbytes < 0 else job.nbytes  # a prefix publish moves only those bytes
        ctl = wire.Control(lane.link, nbytes, self.cfg.bucket_bytes, seq=job.seq, first=self.first_bytes)
        store.queue_push(inbox, wire.encode_control(ctl, header or b""))
        deadline = Deadline(self.cfg.timeout)
        cuda = self.device.type == "cuda"
        tensor = job.buffer.tensor
        works = []
        try:
            if lane.group is None:
                t0 = time.monotonic()
                with self.cond:
                    lane.setting_up = True
                try:
                    group = wire.new_group(self.cfg, store, lane.link, 0)
                finally:
                    with self.cond:
                        lane.setting_up = False
                        self._take_held(lane.worker)
                with self.cond:
                    if lane.gone:  # given up while the link was being made
                        wire.abort(group)
                        raise TransportError("given up while its link was being made")
                    lane.group = group
                log.debug("distributed sender: link %s to worker %d ready in %.3f s", lane.link, lane.worker,
                          time.monotonic() - t0)
            for start, end in ctl.spans():
                if stream is not None:
                    self._await(stream, end, deadline, lane)
                works.append(wire.broadcast_part(lane.group, tensor[start:end]))
            if header is None and stream is not None:  # published meanwhile: the worker reads it after the bytes
                header = self._header(stream, lane, wait=False)
                if header is not None:
                    store.queue_push(inbox, wire.encode_control(wire.Control(kind="commit", seq=job.seq), header))
            wire.wait_works(works, deadline, f"sending to worker {lane.worker}", lambda: lane.gone or self.closing,
                            cuda)
        except Exception as exc:  # gloo's errors, and what a garbage rendezvous key in the store makes it
            broken, lane.group = lane.group, None  # raise (MemoryError: std::bad_alloc): the link failed
            wire.abort(broken)
            wire.settle(works, self.cfg.timeout)  # gloo may still read the buffer until its works end
            raise TransportError(f"link {lane.link}: {wire.brief(exc)}") from exc
        if header is None and stream is not None:
            header = self._header(stream, lane, wait=True)
            kind = "commit" if header is not None else "abort"
            store.queue_push(inbox, wire.encode_control(wire.Control(kind=kind, seq=job.seq), header or b""))

    def _header(self, stream: _Stream, lane: _Lane, wait: bool) -> bytes | None:
        """The header the core published ``stream`` with to ``lane``'s worker; None if it did not
        (yet, or with ``wait``: before it was done with the stream, or a newer job came)."""
        with self.cond:
            while wait and lane.worker not in stream.headers and not stream.over and lane.pending is None \
                    and not lane.gone and not self.closing:
                self.cond.wait(1.0)
            return None if stream.abandoned else stream.headers.get(lane.worker)

    def _await(self, stream: _Stream, end: int, deadline: Deadline, lane: _Lane) -> None:
        """Wait until the core has written bytes ``[0, end)`` of the stream (or abandoned it). If
        it neither writes nor publishes by the deadline, the stream counts as abandoned."""
        with self.cond:
            while stream.ready < end and not stream.over and not lane.gone and not self.closing:
                if deadline.expired():
                    log.warning("distributed sender: the snapshot numbered %d stalled at %d of %d bytes; "
                                "dropping it", stream.seq, stream.ready, self.nbytes)
                    if self.stream is stream:
                        self._end_stream()
                    stream.abandoned = True
                    return
                self.cond.wait(deadline.slice(1.0))


def _heartbeats(store: dist.Store, keys: list[str]) -> list[bytes | None]:
    """Each heartbeat key's value, None where the key does not exist (a lane whose worker never
    beat: e.g. a JOIN anyone pushed for an unused index). A store's ``get`` waits for a missing
    key, so only keys that exist are read. Raises RuntimeError if the store does not answer
    within the client's timeout."""
    if store.check(keys):  # the common case: every worker has beaten
        return list(store.multi_get(keys))
    return [store.get(key) if store.check([key]) else None for key in keys]


def _count(value: bytes | None) -> int | None:
    """A heartbeat key's value as the count a worker's ``store.add`` keeps, or None if it is not one."""
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None
