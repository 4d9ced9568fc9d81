"""The trainer's side: hosts the store, broadcasts each version in buckets over a private group.

Three threads touch the store, each through its own client: the caller's (``poll``, heartbeat
checks), an event reader (joins, acks, leaves) and a broadcaster (control messages, groups,
broadcasts). A group holds the sender (rank 0) and exactly the targets of a delivery; groups are
cached by membership and rebuilt without a worker that fails.

Protocol (see ``wire``): a buffer's contents get a number (``seq``) when ``acquire`` hands it out.
The broadcaster tells each target ``data(seq)``, broadcasts the bytes, and sends ``commit(seq,
header)`` only for a buffer the core published; receivers deliver nothing before the commit. The
endpoint streams: the core's ``ready`` calls start the broadcast while it still copies the
snapshot (bucket k travels while bucket k+1 is copied), and the commit follows ``publish``. A
stream the core abandons (it calls ``acquire``, ``poll`` or ``close`` without publishing it) is
broadcast to the end, so every receiver's collective completes, then ``abort(seq)`` drops it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from wsync_core import (
    Acked,
    Deadline,
    Joined,
    Left,
    SenderContext,
    SenderEndpoint,
    TransportError,
    WorkerTimeoutError,
)
from wsync_core.forked import close_inherited
from wsync_core.protocol import decode_json
from wsync_core.transport import Event

from . import wire
from .config import Config
from .receiver import HEARTBEAT_S

#: senders open in this process (a forked child lets go of their sockets)
_live: weakref.WeakSet[DistributedSender] = weakref.WeakSet()

__all__ = ["DistributedSender"]

log = logging.getLogger("wsync.distributed")

#: send buffers kept at most (the latest, one being written, one still in flight)
_POOL = 3
#: groups kept at most (each holds connections to its members)
_GROUPS = 8
#: how often the caller's thread reads the heartbeats
_HEARTBEAT_CHECK_S = 0.25
#: attempts per delivery (each without the workers found dead)
_ATTEMPTS = 3
#: the core reports progress (``ready``) at least this many times per bucket
_READY_PER_BUCKET = 2
#: the first bucket's size at most: a stream starts sending once this much is copied (later
#: buckets are ``bucket_mb``; many small collectives cost CPU that a busy host lacks)
_FIRST_BUCKET = 8 << 20


@dataclass
class _Peer:
    inbox: str
    nbytes: int
    beats: int = -1
    seen: float = field(default_factory=time.monotonic)


@dataclass
class _Publish:
    """One ``publish`` call: the header for ``todo``, the workers not yet sent a commit for it."""

    seq: int
    header: bytes
    todo: set[int]


@dataclass
class _Stream:
    """A snapshot being written (bytes ``[0, ready)`` final) and broadcast to ``workers``."""

    slot: int
    seq: int
    workers: list[int]
    ready: int = 0
    published: bool = False
    abandoned: bool = False
    finished: bool = False
    publishes: list[_Publish] = field(default_factory=list)


@dataclass
class _Job:
    """Work for the broadcaster: a stream, a publish, or (``slot`` None) the abort of ``seq``."""

    slot: int | None
    seq: int
    stream: _Stream | None = None
    publish: _Publish | None = None


class DistributedSender(SenderEndpoint):
    def __init__(self, cfg: Config, ctx: SenderContext) -> None:
        self.cfg = cfg
        self.nbytes = ctx.layout.nbytes
        self.num_workers = ctx.num_workers
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
        self.cond = threading.Condition()
        self.peers: dict[int, _Peer] = {}
        self.events: deque[Event] = deque()
        self.jobs: deque[_Job] = deque()
        self.pool: list[torch.Tensor] = []
        self.busy: dict[int, int] = {}
        self.seqs: dict[int, int] = {}  # slot -> seq of its contents
        self.seq = 0
        self.latest: int | None = None  # the slot last published
        self.written: int | None = None  # the slot last written in full (the core's latest, published or not)
        self.acquired: int | None = None  # the slot last acquired, unless abandoned
        self.stream: _Stream | None = None  # ready() called, publish() not yet
        self.live: dict[int, _Stream] = {}  # seq -> stream whose broadcast has not finished
        # worker -> (seq, inbox) of bytes it holds in full but was not told to deliver (mirrors its
        # receiver's state; dropped when anything else is sent to it)
        self.waiting: dict[int, tuple[int, str]] = {}
        self.stale: set[int] = set()
        self.closing = False
        self.store: dist.Store | None = None
        self.sock: socket.socket | None = None
        self.threads: list[threading.Thread] = []
        self.groups: OrderedDict[tuple[int, ...], tuple[str, dist.ProcessGroup | None]] = OrderedDict()
        self.group_count = 0
        self.checked = 0.0

    # -- the core's calls ------------------------------------------------------------------
    def open(self, deadline: Deadline) -> None:
        self.store, self.sock = wire.listen(self.cfg)
        _live.add(self)
        self.store.set_timeout(wire._POP_TIMEOUT)
        for target, name in ((self._read_events, "events"), (self._broadcast_jobs, "broadcast")):
            thread = threading.Thread(target=target, args=(wire.clone(self.store),),
                                      name=f"wsync-distributed-{name}", daemon=True)
            thread.start()
            self.threads.append(thread)

    def acquire(self, deadline: Deadline) -> torch.Tensor:
        """A buffer no broadcast reads and that is not the core's latest; raises WorkerTimeoutError."""
        with self.cond:
            self._abandon()
            while True:
                keep = {self.latest, self.written, self.acquired}
                slot = next((i for i in range(len(self.pool)) if i not in keep and not self.busy.get(i)), None)
                if slot is None and len(self.pool) < _POOL:
                    self.pool.append(torch.empty(self.nbytes, dtype=torch.uint8, device=self.device))
                    slot = len(self.pool) - 1
                if slot is not None:
                    self.seq += 1
                    self.seqs[slot] = self.seq
                    self.acquired = slot
                    return self.pool[slot]
                if deadline.expired():
                    busy = sorted({w for s in self.live.values() for w in s.workers})
                    raise WorkerTimeoutError(f"distributed: no send buffer freed up within {deadline.timeout:g} s; "
                                             f"broadcasts to workers {busy} are still in flight", busy)
                self.cond.wait(deadline.slice(1.0))

    def ready(self, buffer: torch.Tensor, nbytes: int, workers: Sequence[int]) -> None:
        """Bytes ``[0, nbytes)`` of ``buffer`` are final: the broadcaster may send them to ``workers``
        (the first call starts the stream). A CUDA buffer (NCCL) is final on the device too: the
        core synchronizes its stream before each call, so the broadcast's stream needs no event."""
        with self.cond:
            slot = self._slot_of(buffer, "ready")
            stream = self.stream
            if stream is None or stream.slot != slot:
                self._abandon()
                stream = self.stream = _Stream(slot, self.seqs[slot], sorted(set(workers)))
                if stream.workers:
                    self.busy[slot] = self.busy.get(slot, 0) + 1
                    self.live[stream.seq] = stream
                    self.jobs.append(_Job(slot, stream.seq, stream=stream))
            stream.ready = nbytes
            if nbytes >= self.nbytes:
                self.written = slot
            self.cond.notify_all()

    def publish(self, buffer: torch.Tensor, header: bytes, workers: Sequence[int]) -> None:
        if len(header) > wire.MAX_HEADER:
            raise TransportError(f"distributed: a header of {len(header)} bytes exceeds this transport's limit of "
                                 f"{wire.MAX_HEADER} bytes (the store carries it)")
        with self.cond:
            slot = self._slot_of(buffer, "publish")
            stream = self.stream
            if stream is not None and stream.slot == slot:
                stream.published, self.stream = True, None
            elif stream is not None:
                self._abandon()
            seq = self.seqs[slot]
            item = _Publish(seq, bytes(header), set(workers))
            live = self.live.get(seq)
            if live is not None and not live.abandoned:  # its broadcast may commit at once, before this job's turn
                live.publishes.append(item)
            self.busy[slot] = self.busy.get(slot, 0) + 1
            self.latest = self.written = slot
            self.jobs.append(_Job(slot, seq, publish=item))
            self.cond.notify_all()

    def poll(self, deadline: Deadline) -> list[Event]:
        with self.cond:
            self._abandon()
        while True:
            self._check_heartbeats()
            with self.cond:
                if self.events or deadline.expired():
                    events = list(self.events)
                    self.events.clear()
                    return events
                self.cond.wait(deadline.slice(_HEARTBEAT_CHECK_S))

    def close(self) -> None:
        _live.discard(self)
        with self.cond:
            if self.closing:
                return
            self._abandon()
            self.closing = True
            peers = dict(self.peers)
            self.cond.notify_all()
        store = self.store
        if store is not None:
            bye = wire.encode_control(wire.Control(kind="bye"))
            try:
                for peer in peers.values():
                    store.queue_push(wire.inbox_key(peer.inbox), bye)
                store.queue_push(wire.EVENTS, wire.encode_event(wire.STOP, 0))
            except (RuntimeError, OSError) as exc:
                log.warning("distributed sender: could not say goodbye to the workers: %s", wire.brief(exc))
        for thread in self.threads:
            thread.join(timeout=self.cfg.timeout + 5)
            if thread.is_alive():
                log.warning("distributed sender: thread %s did not stop", thread.name)
        self.threads.clear()
        for _, group in self.groups.values():
            _drop(group)
        self.groups.clear()
        self.pool.clear()
        self.store = None
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    # -- streams ---------------------------------------------------------------------------
    def _slot_of(self, buffer: torch.Tensor, call: str) -> int:
        slot = next((i for i, b in enumerate(self.pool) if b is buffer), None)
        if slot is None:
            raise TransportError(f"distributed: {call}() got a buffer that acquire() did not return")
        return slot

    def _abandon(self) -> None:
        """The core left the open stream unpublished (it failed while writing it): its broadcast is
        finished with whatever bytes are there, then its receivers are told to drop them (caller
        holds ``cond``)."""
        stream = self.stream
        if stream is None:
            return
        self.stream = None
        if stream.ready < self.nbytes and self.acquired == stream.slot:
            self.acquired = None  # half-written: free to write again
        if not stream.workers:  # nothing was sent
            return
        stream.abandoned = True
        log.info("distributed sender: the snapshot numbered %d was abandoned before publish; its receivers "
                 "drop it", stream.seq)
        self.jobs.append(_Job(None, stream.seq))
        self.cond.notify_all()

    # -- liveness --------------------------------------------------------------------------
    def _beats(self, store: dist.Store, workers: list[int]) -> dict[int, int]:
        if not workers:
            return {}
        values = store.multi_get([wire.heartbeat_key(w) for w in workers])
        return {w: int(v) for w, v in zip(workers, values)}

    def _check_heartbeats(self) -> None:
        now = time.monotonic()
        if now - self.checked < _HEARTBEAT_CHECK_S or self.store is None:
            return
        self.checked = now
        with self.cond:
            workers = sorted(self.peers)
        try:
            beats = self._beats(self.store, workers)
        except RuntimeError as exc:
            log.warning("distributed sender: cannot read heartbeats: %s", wire.brief(exc))
            return
        now = time.monotonic()
        with self.cond:
            for w, count in beats.items():
                peer = self.peers.get(w)
                if peer is None:
                    continue
                if count != peer.beats:
                    peer.beats, peer.seen = count, now
                elif now - peer.seen > self.cfg.heartbeat_timeout:
                    self._lose(w, f"no heartbeat for {now - peer.seen:.1f} s (heartbeat_timeout="
                                  f"{self.cfg.heartbeat_timeout:g}); the worker died or hangs")

    def _lose(self, w: int, reason: str) -> None:
        """Forget worker ``w`` and report it Left (caller holds ``cond``)."""
        if self.peers.pop(w, None) is not None:
            self.stale.add(w)
            self.events.append(Left(w, reason))
            self.cond.notify_all()

    def _find_dead(self, store: dist.Store, workers: list[int], wait: float) -> list[int]:
        """Which of ``workers`` show no heartbeat within ``wait`` seconds (or are gone already)."""
        gone = [w for w in workers if w not in self.peers]
        workers = [w for w in workers if w not in gone]
        end = time.monotonic() + wait
        first = self._beats(store, workers)
        alive: set[int] = set()
        while time.monotonic() < end and len(alive) < len(workers) and not self.closing:
            time.sleep(HEARTBEAT_S / 4)
            now = self._beats(store, [w for w in workers if w not in alive])
            alive.update(w for w, c in now.items() if c != first[w])
        return gone + [w for w in workers if w not in alive]

    # -- the event reader --------------------------------------------------------------------
    def _read_events(self, store: dist.Store) -> None:
        while True:
            try:
                raw = store.queue_pop(wire.EVENTS, True)
            except dist.DistStoreError as exc:
                if "timeout" in str(exc).lower() and not self.closing:
                    continue
                if not self.closing:
                    log.warning("distributed sender: event reader stopped: %s", wire.brief(exc))
                return
            except RuntimeError as exc:
                if not self.closing:
                    log.warning("distributed sender: event reader stopped: %s", wire.brief(exc))
                return
            try:
                kind, w, data = wire.decode_event(raw)
                if kind == wire.STOP:
                    if self.closing:
                        return
                    continue
                if w >= self.num_workers:
                    raise TransportError(f"event from worker {w}, but num_workers={self.num_workers}")
                with self.cond:
                    self._on_event(kind, w, data)
            except TransportError as exc:
                log.warning("distributed sender: ignoring a bad event: %s", exc)

    def _on_event(self, kind: bytes, w: int, data: bytes) -> None:
        if kind == wire.JOIN:
            obj = decode_json(data, f"join from worker {w}", 4096)
            try:
                inbox, nbytes = obj["inbox"], obj["nbytes"]
                if not (isinstance(inbox, str) and 0 < len(inbox) <= 64 and inbox.isalnum()
                        and isinstance(nbytes, int) and nbytes >= 0):
                    raise ValueError(obj)
            except (ValueError, KeyError, TypeError) as exc:
                raise TransportError(f"malformed join from worker {w}: {exc}") from None
            self.peers[w] = _Peer(inbox, nbytes)
            self.waiting.pop(w, None)
            self.stale.add(w)
            self.events.append(Joined(w))
        elif kind == wire.ACK:
            if w in self.peers:
                self.events.append(Acked(w, data))
        elif kind == wire.LEAVE:
            self._lose(w, data.decode("utf-8", "replace")[:200] or "receiver shut down")
        self.cond.notify_all()

    # -- the broadcaster -------------------------------------------------------------------
    def _broadcast_jobs(self, store: dist.Store) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.jobs or self.closing)
                if self.closing:
                    return
                job = self.jobs.popleft()
                stale, self.stale = self.stale, set()
            for members in [m for m in self.groups if stale.intersection(m)]:
                _drop(self.groups.pop(members)[1])
            try:
                if job.stream is not None:
                    self._run_stream(store, job.stream)
                elif job.publish is not None:
                    self._run_publish(store, job.slot, job.publish)
                else:
                    self._run_abort(store, job.seq)
            except (RuntimeError, TransportError) as exc:  # the store connection itself failed
                log.warning("distributed sender: a delivery failed: %s", wire.brief(exc))
                try:
                    store = wire.clone(self.store)
                except (RuntimeError, AttributeError) as again:
                    log.warning("distributed sender: cannot reconnect to the store: %s", wire.brief(again))
            finally:
                with self.cond:
                    if job.stream is not None:
                        job.stream.finished = True
                        self.live.pop(job.seq, None)
                    if job.slot is not None:
                        self.busy[job.slot] -= 1
                    self.cond.notify_all()

    def _run_stream(self, store: dist.Store, stream: _Stream) -> None:
        """Broadcast a snapshot as the core writes it; commit it to the workers it was published to."""
        with self.cond:
            if stream.abandoned:  # before anything was sent
                return
            peers = {w: self.peers[w] for w in stream.workers if w in self.peers}
            buffer = self.pool[stream.slot]
        # a worker whose model does not fit gets its header with the publish job
        targets = sorted(w for w, p in peers.items() if p.nbytes == self.nbytes)
        self._attempts(store, buffer, stream.seq, targets, peers, stream)
        if stream.abandoned:
            self._run_abort(store, stream.seq)

    def _run_publish(self, store: dist.Store, slot: int, item: _Publish) -> None:
        """Send ``item``'s header: a commit where the worker holds the bytes already (a stream), else
        the whole buffer first."""
        with self.cond:
            peers = {w: self.peers[w] for w in sorted(item.todo) if w in self.peers}
            now = [w for w, p in peers.items() if self.waiting.get(w) == (item.seq, p.inbox)]
            for w in now:
                del self.waiting[w]
            item.todo.difference_update(now)
            rest = {w: p for w, p in peers.items() if w in item.todo}
            item.todo.clear()
            buffer = self.pool[slot]
        commit = wire.encode_control(wire.Control(kind="commit", seq=item.seq), item.header)
        for w in now:
            store.queue_push(wire.inbox_key(peers[w].inbox), commit)
        misfit = [w for w, p in rest.items() if p.nbytes != self.nbytes]
        for w in misfit:  # the core rejects it from the header; no broadcast it could not take part in
            ctl = wire.Control(None, (), self.nbytes, self.cfg.bucket_bytes, self._live(w), seq=item.seq)
            store.queue_push(wire.inbox_key(rest[w].inbox), wire.encode_control(ctl, item.header))
        targets = sorted(w for w in rest if w not in misfit)
        self._attempts(store, buffer, item.seq, targets, rest, None, _Publish(item.seq, item.header, set(targets)))

    def _run_abort(self, store: dist.Store, seq: int) -> None:
        """Tell the workers holding the bytes of ``seq`` to drop them."""
        with self.cond:
            victims = {w: inbox for w, (s, inbox) in self.waiting.items() if s == seq}
            for w in victims:
                del self.waiting[w]
        abort = wire.encode_control(wire.Control(kind="abort", seq=seq))
        for inbox in victims.values():
            store.queue_push(wire.inbox_key(inbox), abort)

    def _named(self, seq: int, workers: list[int], stream: _Stream | None,
               item: _Publish | None) -> dict[int, bytes]:
        """The header a publish gave each of ``workers`` for the bytes of ``seq``, where one did
        (never for an abandoned stream). Caller holds ``cond``."""
        if stream is not None:
            publishes = [] if stream.abandoned else stream.publishes
        else:
            publishes = [item] if item is not None else []
        named: dict[int, bytes] = {}
        for w in workers:
            found = next((p for p in publishes if p.seq == seq and w in p.todo), None)
            if found is not None:
                named[w] = found.header
        return named

    def _commit(self, store: dist.Store, seq: int, done: list[int], peers: dict[int, _Peer],
                stream: _Stream | None, item: _Publish | None, told: set[int]) -> None:
        """``done`` hold the bytes of ``seq`` in full, and ``told`` of them their header already:
        commit those a publish named, remember the others."""
        pushes: list[tuple[str, bytes]] = []
        with self.cond:
            named = self._named(seq, done, stream, item)
            publishes = (stream.publishes if stream is not None else [item] if item is not None else [])
            for w in done:
                if w in named:
                    for p in publishes:
                        p.todo.discard(w)
                    self.waiting.pop(w, None)
                    if w not in told:
                        pushes.append((peers[w].inbox, named[w]))
                elif w not in told:
                    self.waiting[w] = (seq, peers[w].inbox)
        for inbox, header in pushes:
            store.queue_push(wire.inbox_key(inbox), wire.encode_control(wire.Control(kind="commit", seq=seq), header))

    def _attempts(self, store: dist.Store, buffer: torch.Tensor, seq: int, targets: list[int],
                  peers: dict[int, _Peer], stream: _Stream | None, item: _Publish | None = None) -> None:
        """Broadcast to ``targets``, retrying without workers whose heartbeat stopped; commit each
        success at once. Workers that fail for good are reported Left."""
        suspects: list[int] = []
        error = ""
        for _ in range(_ATTEMPTS):
            if not targets or self.closing:
                break
            try:
                told = self._broadcast(store, buffer, seq, targets, peers, stream, item)
                self._commit(store, seq, targets, peers, stream, item, told)
                targets = []
                break
            except TransportError as exc:
                error = wire.brief(exc)  # a string: the traceback would keep the failed group alive
                log.warning("distributed sender: broadcast to workers %s failed: %s", targets, error)
                _drop(self.groups.pop(tuple(targets), (None, None))[1])
                # retry at once with the workers whose heartbeat moves; judge the others at leisure
                quiet = self._find_dead(store, targets, min(3 * HEARTBEAT_S, self.cfg.heartbeat_timeout))
                suspects += quiet
                targets = [w for w in targets if w not in quiet]
        with self.cond:
            for w in targets:
                self._lose(w, f"broadcast failed {_ATTEMPTS} times: {error}")
        if suspects and not self.closing:
            dead = self._find_dead(store, suspects, self.cfg.heartbeat_timeout)
            with self.cond:
                for w in dead:
                    self._lose(w, f"broadcast failed ({error}) and no heartbeat within "
                                  f"{self.cfg.heartbeat_timeout:g} s")
                revived = [w for w in suspects if w not in dead and w in self.peers]
            if revived:
                try:
                    told = self._broadcast(store, buffer, seq, revived, peers, stream, item)
                    self._commit(store, seq, revived, peers, stream, item, told)
                except TransportError as exc:
                    _drop(self.groups.pop(tuple(revived), (None, None))[1])
                    with self.cond:
                        for w in revived:
                            self._lose(w, f"broadcast failed twice: {wire.brief(exc)}")

    def _live(self, w: int) -> tuple[str, ...]:
        return tuple(name for members, (name, _) in self.groups.items() if w in members)

    def _await(self, stream: _Stream, end: int, deadline: Deadline) -> None:
        """Wait until the core has written bytes ``[0, end)`` of the stream (or abandoned it).
        If it neither writes nor publishes by the deadline, the stream counts as abandoned."""
        with self.cond:
            while stream.ready < end and not stream.abandoned and not self.closing:
                if deadline.expired():
                    log.warning("distributed sender: the snapshot numbered %d stalled at %d of %d bytes; "
                                "dropping it", stream.seq, stream.ready, self.nbytes)
                    if self.stream is stream:
                        self._abandon()
                    stream.abandoned = True
                    return
                self.cond.wait(deadline.slice(1.0))

    def _broadcast(self, store: dist.Store, buffer: torch.Tensor, seq: int, targets: list[int],
                   peers: dict[int, _Peer], stream: _Stream | None, item: _Publish | None) -> set[int]:
        """Tell ``targets`` to expect ``seq``, then broadcast ``buffer`` in buckets, each as soon as
        the stream (if any) has it; returns once every bucket has left, with the workers that were
        sent their header on the way. Raises TransportError.

        A header known when the broadcast starts (a complete buffer, or a small stream already
        published) rides in the ``data`` message; one published while buckets still go out is
        committed right then (the receiver reads it after its broadcast); a failed broadcast
        leaves these unused, since the receiver delivers only bytes it received in full."""
        key = tuple(targets)
        if key not in self.groups:
            while len(self.groups) >= _GROUPS:
                _drop(self.groups.popitem(last=False)[1][1])
            self.group_count += 1
            self.groups[key] = (f"{self.group_count}", None)
        self.groups.move_to_end(key)
        name, group = self.groups[key]
        with self.cond:
            told = self._named(seq, targets, stream, item)
            for w in targets:
                self.waiting.pop(w, None)
        for w in targets:
            ctl = wire.Control(name, key, self.nbytes, self.cfg.bucket_bytes, self._live(w), seq=seq,
                               first=self.first_bytes)
            store.queue_push(wire.inbox_key(peers[w].inbox), wire.encode_control(ctl, told.get(w, b"")))
        deadline = Deadline(self.cfg.timeout)
        cuda = self.device.type == "cuda"
        try:
            if group is None:
                t0 = time.monotonic()
                group = wire.new_group(self.cfg, store, name, 0, len(targets) + 1)
                self.groups[key] = (name, group)
                log.debug("distributed sender: group %s with workers %s ready in %.3f s", name, targets,
                          time.monotonic() - t0)
            works = []
            for start, end in wire.spans(self.nbytes, self.cfg.bucket_bytes, self.first_bytes):
                if stream is not None:
                    self._await(stream, end, deadline)
                works.append(wire.broadcast_part(group, buffer[start:end]))
            if len(told) < len(targets):
                with self.cond:
                    late = self._named(seq, [w for w in targets if w not in told], stream, item)
                for w, header in late.items():
                    store.queue_push(wire.inbox_key(peers[w].inbox),
                                     wire.encode_control(wire.Control(kind="commit", seq=seq), header))
                told.update(late)
            wire.wait_works(works, deadline, f"broadcast to workers {targets}", lambda: self.closing, cuda)
        except RuntimeError as exc:
            raise TransportError(f"group {name} with workers {targets}: {exc}") from exc
        return set(told)


def _drop(group: dist.ProcessGroup | None) -> None:
    if group is None:
        return
    try:
        group.abort()
    except RuntimeError as exc:
        log.debug("distributed: aborting a group: %s", wire.brief(exc))



def _after_fork_in_child() -> None:
    """A forked child lets go of its copies of every live sender's store sockets, so the parent's
    port is free once it closes (the child never uses them)."""
    ports = [sender.cfg.port for sender in list(_live)]
    _live.clear()
    close_inherited(ports=ports)


os.register_at_fork(after_in_child=_after_fork_in_child)
