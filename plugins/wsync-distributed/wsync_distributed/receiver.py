"""A worker's side: a background thread takes part in the sender's broadcasts into the worker's
own receive buffers (never the model), so the sender never waits for ``receive()``; a buffer is
handed to the core only once the sender's ``commit`` for it arrives (never for an aborted or
half-received one), and ``recv`` gives the core the newest.

Deliveries are adoptable: the core makes the model's tensors views of the buffer instead of
copying it, and releases it once the model moved on to a newer version. A buffer the core holds
is never written; the pool grows to at most ``_POOL`` = 4 buffers (the one the model views, one
the core is applying, one delivered but not yet taken, one being filled), enough for every order
of events the core produces, and usually holds 2. Were all 4 held, the thread would wait for a
release, and after ``collective_timeout`` receive into a scratch buffer it drops (the collective
must complete; the sender then sees no ack).
"""

from __future__ import annotations

import json
import logging
import threading
import uuid

import torch
import torch.distributed as dist
from wsync_core import Deadline, Delivery, ReceiverContext, ReceiverEndpoint, TransportError

from . import wire
from .config import Config

__all__ = ["DistributedReceiver"]

log = logging.getLogger("wsync.distributed")

#: seconds between two heartbeats
HEARTBEAT_S = 0.2
#: receive buffers kept at most (see the module's docstring); usually 2: the model's and the next
_POOL = 4


class DistributedReceiver(ReceiverEndpoint):
    def __init__(self, cfg: Config, ctx: ReceiverContext) -> None:
        self.cfg = cfg
        self.worker = ctx.worker_idx
        self.nbytes = ctx.layout.nbytes
        if cfg.backend == "nccl":
            if ctx.device.type != "cuda":
                raise TransportError(f"distributed: backend='nccl' needs a model on CUDA, got {ctx.device}")
            self.device = ctx.device
        else:
            self.device = torch.device("cpu")
        self.inbox = uuid.uuid4().hex
        self.cond = threading.Condition()
        self.pool: list[torch.Tensor] = []
        self.held: set[int] = set()
        self.ready: tuple[int | None, bytes] | None = None  # (slot or None for header-only, header)
        self.filled: tuple[int, int] | None = None  # (seq, slot): received in full, not yet committed
        self.error: str | None = None
        self.bye = False
        self.closing = False
        self.woken = False  # the scheme is shutting down: recv returns at once
        self.stopped = threading.Event()
        self.store: dist.Store | None = None
        self.threads: list[threading.Thread] = []
        self.groups: dict[str, dist.ProcessGroup] = {}

    # -- the core's calls ------------------------------------------------------------------
    def open(self, deadline: Deadline) -> None:
        self.store = wire.connect(self.cfg, deadline)
        self.store.add(wire.heartbeat_key(self.worker), 1)
        for target, name in ((self._beat, "heartbeat"), (self._receive, "receive")):
            thread = threading.Thread(target=target, args=(wire.clone(self.store),),
                                      name=f"wsync-distributed-{name}-{self.worker}", daemon=True)
            thread.start()
            self.threads.append(thread)
        join = json.dumps({"inbox": self.inbox, "nbytes": self.nbytes}).encode()
        self.store.queue_push(wire.EVENTS, wire.encode_event(wire.JOIN, self.worker, join))

    def recv(self, deadline: Deadline) -> Delivery | None:
        with self.cond:
            while self.ready is None:
                if self.error is not None:
                    raise TransportError(f"distributed worker {self.worker}: {self.error}")
                if deadline.expired() or self.bye or self.woken:
                    return None
                self.cond.wait(deadline.slice(1.0))
            slot, header = self.ready
            self.ready = None
            if slot is None:
                return Delivery(header, torch.empty(0, dtype=torch.uint8))
            self.held.add(slot)
            return Delivery(header, self.pool[slot], lambda: self._release(slot), adoptable=True)

    def wake(self) -> None:
        with self.cond:
            self.woken = True
            self.cond.notify_all()

    def ack(self, data: bytes) -> None:
        if self.store is None:
            raise TransportError(f"distributed worker {self.worker}: ack() after close()")
        try:
            self.store.queue_push(wire.EVENTS, wire.encode_event(wire.ACK, self.worker, bytes(data)))
        except RuntimeError as exc:
            raise TransportError(f"distributed worker {self.worker}: cannot reach the sender's store at "
                                 f"{self.cfg.host}:{self.cfg.port}: {wire.brief(exc)}") from exc

    def close(self) -> None:
        with self.cond:
            if self.closing:
                return
            self.closing = True
            self.cond.notify_all()
        self.stopped.set()
        store = self.store
        if store is not None and not self.bye:  # after "bye" the store is gone (its client would log errors)
            try:
                store.queue_push(wire.EVENTS, wire.encode_event(wire.LEAVE, self.worker, b"receiver shut down"))
                stop = wire.encode_control(wire.Control(kind="stop"))
                store.queue_push(wire.inbox_key(self.inbox), stop)
            except RuntimeError as exc:  # the sender is gone: the threads stop on their own
                log.debug("distributed worker %d: goodbye failed: %s", self.worker, wire.brief(exc))
        for thread in self.threads:
            thread.join(timeout=self.cfg.timeout + 5)
            if thread.is_alive():
                log.warning("distributed worker %d: thread %s did not stop", self.worker, thread.name)
        self.threads.clear()
        for group in self.groups.values():
            _abort(group)
        self.groups.clear()
        self.pool.clear()
        self.store = None

    # -- buffers ---------------------------------------------------------------------------
    def _release(self, slot: int) -> None:
        with self.cond:
            self.held.discard(slot)
            self.cond.notify_all()

    def _slot(self) -> int | None:
        """A buffer to fill: free, else new (up to ``_POOL``), else the undelivered ready one (dropped:
        only the newest counts), else one the core releases in time. None: no buffer freed up."""
        deadline = Deadline(self.cfg.timeout)
        with self.cond:
            self.filled = None  # the sender moved on: what it left uncommitted is dead
            while True:
                ready = self.ready[0] if self.ready is not None else None
                for i in range(len(self.pool)):
                    if i not in self.held and i != ready:
                        return i
                if len(self.pool) < _POOL:
                    self.pool.append(torch.empty(self.nbytes, dtype=torch.uint8, device=self.device))
                    return len(self.pool) - 1
                if ready is not None:
                    self.ready = None
                    return ready
                if deadline.expired() or self.closing:
                    return None
                self.cond.wait(deadline.slice(1.0))

    def _deliver(self, slot: int | None, header: bytes) -> None:
        with self.cond:
            self.ready = (slot, header)
            self.cond.notify_all()

    def _commit(self, seq: int, header: bytes) -> None:
        """Deliver the bytes of ``seq`` with ``header``, if this worker received all of them."""
        with self.cond:
            filled, self.filled = self.filled, None
            if filled is None or filled[0] != seq:
                log.debug("distributed worker %d: commit of %d, but this worker holds %s", self.worker, seq, filled)
                return
            self.ready = (filled[1], header)
            self.cond.notify_all()

    # -- threads ---------------------------------------------------------------------------
    def _beat(self, store: dist.Store) -> None:
        key = wire.heartbeat_key(self.worker)
        while not self.stopped.wait(HEARTBEAT_S):
            try:
                store.add(key, 1)
            except RuntimeError as exc:
                log.debug("distributed worker %d: heartbeat stopped: %s", self.worker, wire.brief(exc))
                return

    def _fail(self, message: str) -> None:
        with self.cond:
            if not self.closing:
                self.error = message
            self.cond.notify_all()

    def _receive(self, store: dist.Store) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        key = wire.inbox_key(self.inbox)
        while not self.closing:
            try:
                raw = store.queue_pop(key, True)
            except RuntimeError as exc:
                if isinstance(exc, dist.DistStoreError) and "timeout" in str(exc).lower():
                    continue
                self._fail(f"lost the sender's store at {self.cfg.host}:{self.cfg.port}: {wire.brief(exc)}")
                return
            try:
                ctl, header = wire.decode_control(raw)
            except TransportError as exc:
                log.warning("distributed worker %d: ignoring a bad control message: %s", self.worker, exc)
                continue
            if ctl.kind == "bye":  # the sender's store closes next: stop using it
                with self.cond:
                    self.bye = True
                    self.cond.notify_all()
                self.stopped.set()
                return
            if ctl.kind == "stop":
                continue
            if ctl.kind == "commit":
                self._commit(ctl.seq, header)
                continue
            if ctl.kind == "abort":
                with self.cond:
                    if self.filled is not None and self.filled[0] == ctl.seq:
                        self.filled = None
                continue
            for name in [n for n in self.groups if n not in ctl.live and n != ctl.group]:
                _abort(self.groups.pop(name))
            if ctl.group is None or ctl.nbytes != self.nbytes:
                with self.cond:
                    self.filled = None
                self._deliver(None, header)  # header only: the core reports the mismatch
                continue
            self._take_part(store, ctl, header)

    def _take_part(self, store: dist.Store, ctl: wire.Control, header: bytes) -> None:
        """Receive the broadcast of ``ctl.seq`` into a free buffer; deliver it once complete if
        ``header`` came with it, else it waits there for its commit."""
        if self.worker not in ctl.members:
            log.warning("distributed worker %d: group %s does not list this worker", self.worker, ctl.group)
            with self.cond:
                self.filled = None
            return
        rank = ctl.members.index(self.worker) + 1
        slot = self._slot()
        if slot is None:  # the collective must still complete: receive into scratch, deliver nothing
            log.warning("distributed worker %d: all %d receive buffers are held; dropping version seq %d",
                        self.worker, _POOL, ctl.seq)
            buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        else:
            buffer = self.pool[slot]
        try:
            group = self.groups.get(ctl.group)
            if group is None:
                group = self.groups[ctl.group] = wire.new_group(self.cfg, store, ctl.group, rank,
                                                                len(ctl.members) + 1)
            if self.nbytes:
                works = wire.broadcast(group, buffer, ctl.spans())
                wire.wait_works(works, Deadline(self.cfg.timeout), f"group {ctl.group}", lambda: self.closing,
                                self.device.type == "cuda")
        except (RuntimeError, TransportError) as exc:
            log.warning("distributed worker %d: broadcast in group %s failed: %s", self.worker, ctl.group, wire.brief(exc))
            group = self.groups.pop(ctl.group, None)
            if group is not None:
                _abort(group)
            return
        if slot is None:
            return
        if header:
            self._deliver(slot, header)
        else:
            with self.cond:
                self.filled = (ctl.seq, slot)


def _abort(group: dist.ProcessGroup) -> None:
    try:
        group.abort()
    except RuntimeError as exc:
        log.debug("distributed: aborting a group: %s", wire.brief(exc))
