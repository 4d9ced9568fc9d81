"""The trainer's side: hosts the store, broadcasts each version in buckets over a private group.

Three threads touch the store, each through its own client: the caller's (``poll``, heartbeat
checks), an event reader (joins, acks, leaves) and a broadcaster (control messages, groups,
broadcasts). A group holds the sender (rank 0) and exactly the targets of a delivery; groups are
cached by membership and rebuilt without a worker that fails.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
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
from wsync_core.transport import Event

from . import wire
from .receiver import HEARTBEAT_S
from .transport import Config

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


@dataclass
class _Peer:
    inbox: str
    nbytes: int
    beats: int = -1
    seen: float = field(default_factory=time.monotonic)


@dataclass
class _Job:
    slot: int
    header: bytes
    workers: list[int]


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
        self.cond = threading.Condition()
        self.peers: dict[int, _Peer] = {}
        self.events: deque[Event] = deque()
        self.jobs: deque[_Job] = deque()
        self.pool: list[torch.Tensor] = []
        self.busy: dict[int, int] = {}
        self.latest: int | None = None
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
        self.store.set_timeout(wire._POP_TIMEOUT)
        for target, name in ((self._read_events, "events"), (self._broadcast_jobs, "broadcast")):
            thread = threading.Thread(target=target, args=(wire.clone(self.store),),
                                      name=f"wsync-distributed-{name}", daemon=True)
            thread.start()
            self.threads.append(thread)

    def acquire(self, deadline: Deadline) -> torch.Tensor:
        with self.cond:
            while True:
                for i, buffer in enumerate(self.pool):
                    if i != self.latest and not self.busy.get(i):
                        return buffer
                if len(self.pool) < _POOL:
                    self.pool.append(torch.empty(self.nbytes, dtype=torch.uint8, device=self.device))
                    return self.pool[-1]
                if deadline.expired():
                    busy = sorted({w for job in self.jobs for w in job.workers})
                    raise WorkerTimeoutError(f"distributed: no send buffer freed up within {deadline.timeout:g} s; "
                                             f"broadcasts to workers {busy} are still in flight", busy)
                self.cond.wait(deadline.slice(1.0))

    def publish(self, buffer: torch.Tensor, header: bytes, workers: Sequence[int]) -> None:
        if len(header) > wire.MAX_HEADER:
            raise TransportError(f"distributed: a header of {len(header)} bytes exceeds this transport's limit of "
                                 f"{wire.MAX_HEADER} bytes (the store carries it)")
        with self.cond:
            slot = next((i for i, b in enumerate(self.pool) if b is buffer), None)
            if slot is None:
                raise TransportError("distributed: publish() got a buffer that acquire() did not return")
            self.busy[slot] = self.busy.get(slot, 0) + 1
            self.latest = slot
            self.jobs.append(_Job(slot, bytes(header), list(workers)))
            self.cond.notify_all()

    def poll(self, deadline: Deadline) -> list[Event]:
        while True:
            self._check_heartbeats()
            with self.cond:
                if self.events or deadline.expired():
                    events = list(self.events)
                    self.events.clear()
                    return events
                self.cond.wait(deadline.slice(_HEARTBEAT_CHECK_S))

    def close(self) -> None:
        with self.cond:
            if self.closing:
                return
            self.closing = True
            peers = dict(self.peers)
            self.cond.notify_all()
        store = self.store
        if store is not None:
            bye = wire.encode_control(wire.Control(None, (), 0, 1, (), kind="bye"))
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
            try:
                obj = json.loads(data)
                inbox, nbytes = obj["inbox"], obj["nbytes"]
                if not (isinstance(inbox, str) and 0 < len(inbox) <= 64 and inbox.isalnum()
                        and isinstance(nbytes, int) and nbytes >= 0):
                    raise ValueError(obj)
            except (ValueError, KeyError, TypeError) as exc:
                raise TransportError(f"malformed join from worker {w}: {exc}") from None
            self.peers[w] = _Peer(inbox, nbytes)
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
                self._deliver(store, job)
            except (RuntimeError, TransportError) as exc:  # the store connection itself failed
                log.warning("distributed sender: delivery to workers %s failed: %s", job.workers, wire.brief(exc))
                try:
                    store = wire.clone(self.store)
                except (RuntimeError, AttributeError) as again:
                    log.warning("distributed sender: cannot reconnect to the store: %s", wire.brief(again))
            finally:
                with self.cond:
                    self.busy[job.slot] -= 1
                    self.cond.notify_all()

    def _deliver(self, store: dist.Store, job: _Job) -> None:
        with self.cond:
            peers = {w: self.peers[w] for w in job.workers if w in self.peers}
            buffer = self.pool[job.slot]
        misfit = [w for w, p in peers.items() if p.nbytes != self.nbytes]
        for w in misfit:  # the core rejects it from the header; no broadcast it could not take part in
            ctl = wire.Control(None, (), self.nbytes, self.cfg.bucket_bytes, self._live(w))
            store.queue_push(wire.inbox_key(peers[w].inbox), wire.encode_control(ctl, job.header))
        targets = sorted(w for w in peers if w not in misfit)
        suspects: list[int] = []
        error = ""
        for _ in range(_ATTEMPTS):
            if not targets or self.closing:
                break
            try:
                self._broadcast(store, buffer, job.header, targets, peers)
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
                    self._broadcast(store, buffer, job.header, revived, peers)
                except TransportError as exc:
                    _drop(self.groups.pop(tuple(revived), (None, None))[1])
                    with self.cond:
                        for w in revived:
                            self._lose(w, f"broadcast failed twice: {wire.brief(exc)}")

    def _live(self, w: int) -> tuple[str, ...]:
        return tuple(name for members, (name, _) in self.groups.items() if w in members)

    def _broadcast(self, store: dist.Store, buffer: torch.Tensor, header: bytes, targets: list[int],
                   peers: dict[int, _Peer]) -> None:
        key = tuple(targets)
        if key not in self.groups:
            while len(self.groups) >= _GROUPS:
                _drop(self.groups.popitem(last=False)[1][1])
            self.group_count += 1
            self.groups[key] = (f"{self.group_count}", None)
        self.groups.move_to_end(key)
        name, group = self.groups[key]
        for w in targets:
            ctl = wire.Control(name, key, self.nbytes, self.cfg.bucket_bytes, self._live(w))
            store.queue_push(wire.inbox_key(peers[w].inbox), wire.encode_control(ctl, header))
        deadline = Deadline(self.cfg.timeout)
        try:
            if group is None:
                t0 = time.monotonic()
                group = wire.new_group(self.cfg, store, name, 0, len(targets) + 1)
                self.groups[key] = (name, group)
                log.debug("distributed sender: group %s with workers %s ready in %.3f s", name, targets,
                          time.monotonic() - t0)
            if buffer.numel():
                works = wire.broadcast(group, buffer, self.cfg.bucket_bytes)
                wire.wait_works(works, deadline, f"broadcast to workers {targets}", lambda: self.closing)
        except RuntimeError as exc:
            raise TransportError(f"group {name} with workers {targets}: {exc}") from exc


def _drop(group: dist.ProcessGroup | None) -> None:
    if group is None:
        return
    try:
        group.abort()
    except RuntimeError as exc:
        log.debug("distributed: aborting a group: %s", wire.brief(exc))

