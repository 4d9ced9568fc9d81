"""A worker's side of a scheme: take the newest delivery, check it, apply it, ack it.

``WeightSyncScheme`` builds one ``Receiver`` at ``init_on_receiver`` and calls it under its
lock. Applying is a copy into the model or, for an adoptable delivery, re-pointing the model's
tensors at the transport's memory, which is then leased (``wsync_core.lease``).
"""

from __future__ import annotations

import _signal  # signal's own functions: signal.signal() converts handlers to enums, 6 us a receive
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from .deadline import POLL, Deadline
from .errors import SchemaMismatchError, StateError, TransportError, WorkerTimeoutError
from .delta import INDEX_BYTES, WIRE_DTYPES, Op, apply_ops, check_indices, decode_table, unpack_wire, wire_layout
from .layout import Layout
from .lease import LeaseBook
from .protocol import Ack, Header, checksum
from .transport import Delivery, ReceiverContext, ReceiverEndpoint, Transport, number
from .weights import (EXTRA_STATE, Strategy, Weights, check_holds_writes, device_of, flatten, materialize, meta_keys,
                      restore_extra_state, stranded_meta, unwrap, warn_unsent)

__all__ = ["Receiver"]

log = logging.getLogger("wsync")
#: give up the core to a waiting thread, where the system has the call (not on Windows)
_yield_core = getattr(os, "sched_yield", lambda: None)
_SIGINT = int(signal.SIGINT)
#: the most deliveries one receive() takes from its endpoint to find the newest (a newest-only
#: mailbox holds one or two; a transport whose recv() never runs dry must not hold a receive forever)
_MAX_DRAIN = 256


class Receiver:
    """Worker ``worker_idx``'s receiver into ``model`` (updated in place); used under ``lock``."""

    def __init__(self, transport: Transport, model: Weights, *, worker_idx: int, model_id: str, strategy: Strategy,
                 lock: threading.RLock, origin: str | None = None) -> None:
        """Check ``model`` and build (not open) the endpoint. ``origin``: what the scheme this one was
        pickled from carried once it was a sender's (``Sender.origin``): before its first version it
        takes only those whose session begins with it (None: any sender's). Raises ValueError for a
        bad ``worker_idx``, TypeError for a model of another type."""
        worker_idx = number("worker_idx", worker_idx, 0, integer=True)
        model = unwrap(model)
        check_holds_writes(model)
        tensors = flatten(model, strategy)
        warn_unsent(model, tensors, "init_on_receiver()")
        self.layout = Layout.of(tensors)
        #: whether some module has extra state (handed back through ``set_extra_state`` after each version)
        self._extra = any(EXTRA_STATE in key for key in tensors)
        device = device_of(tensors)
        if device.type == "meta":  # materialized on the CPU from the first payload
            device = torch.device("cpu")
        stranded = stranded_meta(model, tensors)
        if stranded:
            shown = ", ".join(repr(k) for k in stranded[:5]) + (f" and {len(stranded) - 5} more" if len(stranded) > 5 else "")
            raise ValueError(f"init_on_receiver(): {shown} of the model are on the meta device and do not travel "
                             f"with strategy {strategy!r} (not in its keys: a buffer outside the state_dict), so no "
                             f"version would give them values; give them real ones first (e.g. to_empty(), then "
                             f"compute them), or use strategy='tensordict', which sends every buffer")
        self._ctx = ReceiverContext(worker_idx, self.layout, model_id, device, origin or "")
        self._transport = transport
        self.endpoint: ReceiverEndpoint = transport.receiver(self._ctx)
        self.source = model
        self.strategy = strategy
        self.worker_idx = worker_idx
        self.model_id = model_id
        self.lock = lock
        #: whether acks are sealed and headers must be (``protocol.seal``): where the transport
        #: checksums what it moves
        self.sealed = transport.checksum
        self.version = -1
        #: the sender that numbered ``version`` (``Header.session``): another one's numbers start over
        self.session: str | None = None
        self.origin = origin
        self.opened = False
        self.closing = False
        self.apply_listeners: list[Callable[[int], None]] = []
        self.guard: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
        self._leases = LeaseBook()
        self._adopted = _Adopted()
        #: each tensor's identity, version counter and address right after the last apply: a partial
        #: payload (a delta, a key subset) holds only if the worker has not written its model since
        self._as_applied: list[tuple[int, int, int]] | None = None
        #: the newest version the sender announced to this worker (applied or not)
        self.announced = -1
        #: the keys that are one tensor in the model (``_tie_groups``), and those whose memory
        #: overlaps in part (``_overlaps``), found at the first full payload of the sender
        #: ``_ties_of`` and again whenever a tensor is not the one the last version left (the worker
        #: tied two since, or replaced one); every version is checked against them (``_check_ties``)
        self._ties: list[list[str]] = []
        self._overlaps: list[list[str]] = []
        self._ties_of: str | None = None
        #: the delivery (and its header) a receive took but could not apply because the apply guard
        #: raised: the next receive applies it, or a newer one
        self._kept: tuple[Delivery, Header] | None = None
        #: a receive() waiting to enter ``guard``, and the rest of a shutdown() left to it (``hand_over``)
        self._parked = False
        self._guard_busy = False  # the last receive kept its version: the apply guard (a lock) was not free in time
        self._handed: Callable[[], None] | None = None
        self._handover = threading.Lock()
        #: threads waiting in ``take_lock``: a thread that just let the lock go does not take it back first
        self._wanting = 0

    @property
    def versions_behind(self) -> int:
        """How many versions the newest one announced to this worker (as of its last receive) is
        ahead of the one it holds: 0 when up to date."""
        return max(0, self.announced - self.version)

    # -- lifecycle ----------------------------------------------------------------------------
    def open(self, deadline: Deadline) -> None:
        """Open the endpoint (once: a connect() that timed out keeps it); closes it if that fails."""
        if self.opened:
            return
        try:
            self.endpoint.open(deadline)
        except BaseException:
            self.endpoint.close()
            raise
        self.opened = True

    def _leave(self) -> None:
        """Close the endpoint (the sender sees this worker go) and make a new, unopened one, which
        the next connect() opens."""
        self.endpoint.close()
        self.endpoint, self.opened = self._transport.receiver(self._ctx), False

    def connect(self, deadline: Deadline) -> None:
        """Wait for the sender's current version and apply it. Raises WorkerTimeoutError if none
        comes by the deadline, StateError if shutdown() began meanwhile."""
        while self.receive(deadline) is None:
            self.check_closing("connect()")
            if deadline.expired():
                why = self.endpoint.last_error()
                raise WorkerTimeoutError(
                    f"worker {self.worker_idx} got no weights from the sender within {deadline.timeout:g} s"
                    + (f": {why}" if why else "; is the sender connecting with the same transport options?"), [])

    def close(self) -> None:
        """Give the model its own copy of what it views, give back what fell due, close the endpoint."""
        with self.lock:
            if self._kept is not None:
                _release(self._kept[0])
                self._kept = None
            self._adopted.materialize()
            self._leases.close()
            self.endpoint.close()
            self.source = None

    def hand_over(self, finish: Callable[[], None]) -> bool:
        """If a receive() in another thread waits to enter the apply guard (which the thread shutting
        down may hold: it would wait for that receive forever), leave ``finish``, the rest of the
        shutdown, to it and return True: it applies nothing, and calls ``finish`` once it has the
        guard and has left it. False if no receive() waits there."""
        with self._handover:
            if self._parked:
                self._handed = finish
            return self._parked

    def check_closing(self, what: str) -> None:
        """Raise StateError if ``shutdown()`` began in another thread while ``what`` waited."""
        if self.closing:
            raise StateError(f"{what} was interrupted: shutdown() was called from another thread; "
                             f"build a new WeightSyncScheme")

    # -- receiving ------------------------------------------------------------------------------
    def receive(self, deadline: Deadline) -> int | None:
        """Apply the newest delivery that arrived by ``deadline``; the version applied, or None."""
        if torch.is_inference_mode_enabled():  # a receive in a rollout's inference mode: tensors made
            with torch.inference_mode(False):  # there (views the model adopts) would be inference
                return self._receive(deadline)  # tensors, which it could never train with after
        return self._receive(deadline)

    def _receive(self, deadline: Deadline) -> int | None:
        self._leases.drain()  # memory the worker stopped viewing since the last call
        best, self._kept = self._kept, None  # what the last receive took, if its guard raised
        stale = False
        drained = 0
        try:
            delivery = self._poll(deadline if best is None else POLL, best is not None)
            while delivery is not None:
                drained += 1
                try:
                    header = Header.decode(delivery.header, self.sealed)
                except TransportError as exc:  # which version it was is unknown: the sender fails what it sent
                    _release(delivery)
                    self._reject(self.version, exc, "UnreadableHeader")
                    raise
                held = best[1] if best is not None else None
                session, version = (held.session, held.version) if held else (self.session, self.version)
                fresh = header.session != session  # another sender's numbering: it supersedes what came before
                self.announced = header.version if fresh else max(self.announced, header.version)
                if fresh or header.version > version:
                    if best is not None:
                        _release(best[0])
                    best = (delivery, header)
                else:
                    stale = True
                    _release(delivery)
                delivery = self._poll(POLL, best is not None) if drained < _MAX_DRAIN else None
        except BaseException:
            if best is not None:
                _release(best[0])
            raise
        if best is None:
            if stale and self.version >= 0:
                # a re-delivery of what this worker holds (e.g. after a reconnect): the sender may
                # still wait for that ack
                self._ack(self.version)
            return None
        delivery, header = best
        if self.session is None and self.origin is not None and not (header.session or self.origin).startswith(self.origin):
            _release(delivery)
            foreign = TransportError(
                f"worker {self.worker_idx}: version {header.version} comes from another sender (session "
                f"{header.session}) than the one this scheme was pickled from (sessions {self.origin}...): another "
                f"job's trainer at the same address? Nothing applied, and this worker left that sender; give "
                f"each job its own address")
            self._reject(header.version, foreign)
            self._leave()
            raise foreign
        if header.base is not None and header.session != self.session:
            self._refuse_delta(delivery, header, "holds no version of this sender's")
            return None
        if header.base is not None and not header.base <= self.version:
            self._refuse_delta(delivery, header, f"holds version {self.version}")
            return None
        retired: list[torch.Tensor] = []  # the memory adopted tensors had: freed after the ack
        try:
            safe_point = _SafePoint(self, delivery, header, deadline)
            safe_point.__enter__()
        except _GuardBusy:  # kept for the next receive (``_SafePoint``): nothing applied within the timeout
            self._guard_busy = True
            return None
        self._guard_busy = False
        with safe_point, _interrupts_held():  # its model is not in use in here
            # a Ctrl-C in here lands once the version is whole, numbered and acked (a model half
            # written when it came kept the other half of the version before, unnumbered, unacked)
            try:
                adopted = self._apply(delivery, header, retired)
            except _WroteSince as exc:
                self._refuse_delta(delivery, header, str(exc) or f"wrote its model since version {self.version}")
                return None
            except Exception as exc:  # a mismatch, damage, or the model's own code (a set_extra_state that
                _release(delivery)      # raised): the sender is told at once, not left to its timeout
                self._reject(header.version, exc)
                raise
            finally:
                _release(delivery)  # a no-op for memory the model now views: its lease gives it back
            self.version, self.session = header.version, header.session
            warm = delivery.warm if adopted else None
            del delivery, best
            try:
                for listener in self.apply_listeners:  # before the ack: a sync send() returns after them
                    listener(header.version)
            finally:
                self._ack(header.version)
        # the ack has woken the sender; on few cores it would wait for the rest of this worker's
        # turn (the rest of this call, the worker's own work after it): let it, and any other
        # worker of this send not yet woken, run first (and before the page-table work of warming)
        _yield_core()
        retired.clear()
        self._leases.drain()
        if warm is not None:
            warm()
        return header.version

    def _poll(self, deadline: Deadline, holding: bool) -> Delivery | None:
        """The endpoint's next delivery by ``deadline``. Where one is in hand (``holding``), a
        TransportError (the endpoint failed behind it: a sender gone, a link cut) ends the draining
        instead, so what arrived before the failure is applied and the next call raises; raised as
        it is while shutting down."""
        try:
            return self.endpoint.recv(deadline)
        except TransportError:
            if not holding or self.closing:
                raise
            return None

    def wait_for_version(self, version: int, deadline: Deadline, expect: Callable[[], None]) -> int:
        """Apply versions as they arrive until this worker holds ``version`` or newer; ``expect()``
        checks the scheme is still connected each time the lock is taken again."""
        while True:
            if self.version >= version:  # (another thread's receive() applied it: no need of the lock)
                expect()
                return self.version
            if self.take_lock(Deadline(deadline.slice(0.05))):
                try:
                    expect()
                    if self.version < version:
                        self.receive(Deadline(deadline.slice(0.05)))  # lets other threads in between
                finally:
                    self.lock.release()
                if self.version >= version:
                    return self.version
            if deadline.expired():
                parked = (" (a newer one waits for the apply guard: is it held by the thread waiting?)"
                          if self._parked or self._guard_busy else "")
                raise WorkerTimeoutError(
                    f"worker {self.worker_idx} holds version {self.version}, not {version}, after "
                    f"{deadline.timeout:g} s{parked}", [self.worker_idx])

    def take_lock(self, deadline: Deadline) -> bool:
        """Take the scheme's lock by ``deadline``. False if the deadline passes first, or if the
        thread holding it waits to enter the apply guard (which may be this thread's: waiting for
        it would never end)."""
        if not self._wanting and self.lock.acquire(blocking=False):  # the common case: no one holds it
            return True
        with self._handover:
            self._wanting += 1  # a receive() loop in another thread waits its turn behind this one
        try:
            while not self.lock.acquire(timeout=deadline.slice(0.05)):
                if self._parked or deadline.expired():
                    return False
            return True
        finally:
            with self._handover:
                self._wanting -= 1

    def rebind(self, model: Weights, connected: bool) -> None:
        """Apply future versions to ``model`` (same layout); a connected worker copies the version
        it holds into it first. Raises SchemaMismatchError if its layout differs, TypeError if it
        cannot hold writes (``check_holds_writes``)."""
        model = unwrap(model)
        check_holds_writes(model)
        targets = flatten(model, self.strategy, detach=False)
        self.layout.check_fits(targets, mine="model at init_on_receiver()", theirs="model given to rebind()",
                               context=f"worker {self.worker_idx}")
        if model is self.source:
            return
        with self.guard():
            if connected:
                held = flatten(self.source, self.strategy)
                if meta_keys(targets):  # built on the meta device: memory first, then the version held
                    materialize(model, device_of(held))
                    targets = flatten(model, self.strategy, detach=False)
                with torch.no_grad():
                    for key, t in targets.items():
                        if t.data_ptr() != held[key].data_ptr():
                            t.copy_(held[key])
                if self._extra:
                    restore_extra_state(model, held)  # (through set_extra_state, as a version lands)
            self.source = model

    def _refuse_delta(self, delivery: Delivery, header: Header, state: str) -> None:
        """A delta for a base this worker does not hold as it received it (``state`` says why): apply
        nothing, and ask for a full payload (an ack of type BaseMismatch, which the sender answers
        with the newest version in full)."""
        _release(delivery)
        why = (f"worker {self.worker_idx} {state}; version {header.version} came as a delta "
               f"from version {header.base}: asking for a full payload")
        log.info("%s", why)
        held = self.version if header.session == self.session else -1  # (another sender's numbers mean nothing here)
        self._ack(held, why, "BaseMismatch")

    def _reject(self, version: int, exc: Exception, error_type: str | None = None) -> None:
        log.warning("worker %s rejected version %d: %s", self.worker_idx, version, exc)
        self._ack(version, str(exc), error_type or type(exc).__name__)

    def _ack(self, version: int, error: str | None = None, error_type: str | None = None) -> None:
        """Tell the sender this worker holds ``version`` (or, with ``error``, why it took none)."""
        self.endpoint.ack(Ack(self.worker_idx, version, error, error_type).encode(self.sealed))

    def _apply(self, delivery: Delivery, header: Header, retired: list[torch.Tensor]) -> bool:
        """Check everything about a delivery, then copy it into the model, or make the model's
        tensors views of it where the delivery is adoptable (the model's memory then is leased:
        ``delivery.release`` runs once nothing views it; the memory they had goes to ``retired``).
        Nothing is written on error. True if some tensor now views the payload."""
        layout = self.layout
        where = f"worker {self.worker_idx}, version {header.version}"
        if header.model_id != self.model_id:
            raise SchemaMismatchError(f"{where}: payload is for model {header.model_id!r}, this receiver "
                                      f"holds {self.model_id!r}")
        if header.digest != layout.digest:
            if header.layout is not None:
                try:
                    theirs = Layout.from_wire(header.layout)
                except ValueError as exc:
                    raise TransportError(f"{where}: malformed layout in header: {exc}") from None
                theirs.check_matches(layout, context=where)
            raise SchemaMismatchError(f"{where}: sender layout {header.digest[:12]} differs from this "
                                      f"model's {layout.digest[:12]}")
        if header.encoded:
            return self._apply_encoded(delivery, header, where)
        payload = _checked_payload(delivery, where)
        if header.nbytes != layout.nbytes or payload.numel() != layout.nbytes:
            raise TransportError(f"{where}: payload has {payload.numel()} bytes (header says {header.nbytes}), "
                                 f"expected {layout.nbytes}")
        if header.checksum is not None and checksum(payload) != header.checksum:
            raise TransportError(f"{where}: payload checksum mismatch (damaged in transit)")
        adoptable = delivery.adoptable
        if payload.data_ptr() % layout.alignment:
            payload, adoptable = _realigned(payload, delivery), False
        targets = flatten(self.source, self.strategy, detach=False)
        on_cpu = layout.ready(targets)  # the common case in one pass; else the checks that name what is wrong
        if not on_cpu:
            layout.check_fits(targets, mine="model at init_on_receiver()", theirs="model now", context=where)
            if meta_keys(targets):  # a model built on the meta device gets real memory from its first payload
                materialize(self.source, payload.device if payload.device.type != "meta" else torch.device("cpu"))
                targets = flatten(self.source, self.strategy, detach=False)
            layout.check_writable(targets, context=where)
        self._check_ties(header, targets, payload, layout, where)
        if self._extra:  # the model's own code first: a set_extra_state that raises leaves every weight as it was
            _stage_extra_state(self.source, layout, payload, targets)
        if adoptable and payload.device.type == "cpu":
            release, delivery.release = delivery.release, None
            payload = self._leases.wrap(payload, release)
            adopted = layout.adopt(payload, targets, retired)
            self._adopted.add(adopted)
        else:
            adopted = []
            layout.unpack(payload, targets, ready=on_cpu)
        if payload.is_cuda or not on_cpu and any(t.is_cuda for t in targets.values()):
            torch.cuda.synchronize()
        self._as_applied = _as_applied(targets)
        return bool(adopted)

    def _apply_encoded(self, delivery: Delivery, header: Header, where: str) -> bool:
        """Apply an encoded payload (``wsync_core.delta``: a wire dtype, a table, a base): check the
        header's table and every index first, then write into the model's tensors in place (those
        that view adopted memory too: an adoptable delivery's memory is this worker's own). Never
        adopts (returns False). Nothing is written on error."""
        layout = self.layout
        if header.wire is not None and header.wire not in WIRE_DTYPES:
            raise TransportError(f"{where}: unknown wire dtype {header.wire!r}")
        wire = wire_layout(layout, header.wire)
        payload = _checked_payload(delivery, where)
        size = payload.numel()
        if payload.device.type == "meta" or not header.nbytes <= size <= layout.nbytes:
            raise TransportError(f"{where}: payload has {size} bytes (header says {header.nbytes}, at most "
                                 f"{layout.nbytes})")
        payload = payload[:header.nbytes]
        if header.checksum is not None and checksum(payload) != header.checksum:
            raise TransportError(f"{where}: payload checksum mismatch (damaged in transit)")
        if payload.data_ptr() % max(layout.alignment, INDEX_BYTES):
            payload = _realigned(payload, delivery)
        if header.table is None:
            if header.base is not None or header.nbytes != wire.nbytes:
                raise TransportError(f"{where}: a full payload in {header.wire} has {header.nbytes} bytes, "
                                     f"expected {wire.nbytes}")
            ops, indices = None, []
        elif header.base is None:
            raise TransportError(f"{where}: a partial payload names no base version")
        else:
            ops = decode_table(header.table, layout, wire, header.nbytes, where)
            indices = check_indices(ops, payload, where)
        targets = flatten(self.source, self.strategy, detach=False)
        layout.check_fits(targets, mine="model at init_on_receiver()", theirs="model now", context=where)
        if meta_keys(targets):
            if ops is not None:
                raise TransportError(f"{where}: a partial payload for a model that holds no data yet")
            materialize(self.source, payload.device if payload.device.type != "meta" else torch.device("cpu"))
            targets = flatten(self.source, self.strategy, detach=False)
        layout.check_writable(targets, context=where)
        if ops is None:
            self._check_ties(header, targets, payload, wire, where)
            unpack_wire(wire, payload, targets)
        else:
            if self._as_applied is None or _as_applied(targets) != self._as_applied:
                raise _WroteSince()  # what the worker wrote would stay where the trainer changed nothing
            if self._ties:
                _check_tied_ops(self._ties, ops, payload, where)
            if self._overlaps:  # (rare: what a delta writes where two keys overlap is not checked)
                raise _WroteSince("has keys whose memory overlaps (one views part of another)")
            apply_ops(ops, indices, payload, targets)
        if self._extra:
            restore_extra_state(self.source, targets)
        if payload.is_cuda or any(t.is_cuda for t in targets.values()):
            torch.cuda.synchronize()
        self._as_applied = _as_applied(targets)
        return False

    def _check_ties(self, header: Header, targets: Mapping[str, torch.Tensor], payload: torch.Tensor,
                    layout: Layout, where: str) -> None:
        """Raise SchemaMismatchError if two keys that are one tensor in the worker's model (tied:
        found at each sender's first full payload) come with different bytes in this one: the
        model could hold only one of them (the sender's are not tied, and no longer equal); the
        same for keys whose memory overlaps otherwise (one a slice or a transposed view of
        another), where they overlap (``_check_overlap``)."""
        applied = self._as_applied  # the tensors as the last version left them: ties found then still hold
        if header.session != self._ties_of or applied is None or len(applied) != len(targets) or not all(
                i == id(t) and p == t.data_ptr() for (i, _, p), t in zip(applied, targets.values())):
            # (a new sender, or the worker re-tied or replaced a tensor since: ``b.weight = a.weight``)
            self._ties, self._overlaps, self._ties_of = _tie_groups(targets), _overlaps(targets), header.session
        for keys in self._ties:
            first = layout.entry(keys[0])
            for key in keys[1:]:
                e = layout.entry(key)
                if not torch.equal(payload[first.offset:first.offset + first.nbytes],
                                   payload[e.offset:e.offset + e.nbytes]):
                    raise _tie_broken(where, keys[0], key)
        for keys in self._overlaps:
            _check_overlap(keys, targets, payload, layout, where)


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """Hold a SIGINT (Ctrl-C) that comes during the block and deliver it at the block's end, to the
    handler that was there. Only the main thread runs signal handlers: elsewhere, and where no
    Python handler is set, nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = _signal.getsignal(_SIGINT)
    if not callable(handler):  # SIG_IGN, SIG_DFL, or one set outside Python
        yield
        return
    came: list[Any] = []
    _signal.signal(_SIGINT, lambda signum, frame: came.append(frame))
    try:
        yield
    finally:
        _signal.signal(_SIGINT, handler)
        if came:
            handler(_SIGINT, came[0])  # Python's default raises KeyboardInterrupt here


class _SafePoint:
    """The worker's apply guard, entered to apply a delivery. If shutdown() began meanwhile, the
    delivery is released, the guard left, the shutdown finished if it was left to this thread
    (``Receiver.hand_over``), and entering raises StateError. If the guard raises, the delivery is
    kept for the next receive (``Receiver._kept``), or released and the shutdown finished if one
    began, and the error raised."""

    __slots__ = ("_receiver", "_delivery", "_header", "_deadline", "_guard", "_entered")

    def __init__(self, receiver: Receiver, delivery: Delivery, header: Header, deadline: Deadline) -> None:
        self._receiver, self._delivery, self._header, self._deadline = receiver, delivery, header, deadline
        self._entered = False

    def __enter__(self) -> None:
        if self._entered:  # (entered by ``_receive`` first, to tell a busy guard apart)
            return
        self._entered = True
        r = self._receiver
        with r._handover:
            r._parked = True
        try:
            guard = r.guard()
            if not (hasattr(guard, "__enter__") and hasattr(guard, "__exit__")):
                raise TypeError(f"the apply guard (set_apply_guard) returned a {type(guard).__name__}, not a context "
                                f"manager: give it a function that returns one, e.g. lambda: lock")
            if isinstance(guard, _LOCKS):  # a lock: waited for within the receive's timeout, never past it
                # (a receive() by the thread that holds it would wait for itself); once shutting down, for
                # as long as it takes (closing gives adopted tensors memory of their own: under the guard)
                while not guard.acquire(timeout=0.05 if r.closing else self._deadline.slice(0.05)):
                    if self._deadline.expired() and not r.closing:
                        raise _GuardBusy()
            else:
                guard.__enter__()
        except BaseException:
            finish = self._unpark()
            if r.closing:
                _release(self._delivery)
                if finish is not None:  # the rest of a shutdown() left to this call: the guard's error
                    finish()            # says why no version came, the scheme is closed all the same
            else:  # nothing applied: the next receive applies this version (or a newer one)
                r._kept = (self._delivery, self._header)
            raise
        finish = self._unpark()
        if not r.closing:
            self._guard = guard
            return
        guard.__exit__(None, None, None)
        _release(self._delivery)
        if finish is not None:
            finish()
        r.check_closing("receive()")

    def __exit__(self, *exc: Any) -> bool | None:
        return self._guard.__exit__(*exc)

    def _unpark(self) -> Callable[[], None] | None:
        """No longer waiting for the guard: the rest of a shutdown() handed over meanwhile, if any."""
        r = self._receiver
        with r._handover:
            r._parked = False
            finish, r._handed = r._handed, None
        return finish


#: apply guards waited for with the receive's deadline (``acquire(timeout=...)``, released by ``__exit__``)
_LOCKS = (type(threading.Lock()), type(threading.RLock()), threading.Condition, threading.Semaphore)


class _GuardBusy(Exception):
    """The apply guard (a lock) was not free within the receive's timeout: the delivery is kept
    for the next receive, which applies it (or a newer one) once the guard is free."""


class _WroteSince(Exception):
    """The worker wrote its model (an in-place op on one of its tensors) since the last apply, or
    replaced a tensor: a partial payload would keep what it wrote. Its message, if any, says
    another reason a partial payload cannot be applied."""


def _stage_extra_state(source: Weights, layout: Layout, payload: torch.Tensor,
                       targets: Mapping[str, torch.Tensor]) -> None:
    """Hand the model's modules their extra state from ``payload`` (``restore_extra_state``) before
    any weight is written: if one's ``set_extra_state`` raises, those already given theirs get back
    what they held (``targets``, not written yet) and the error is raised, the model whole."""
    staged = {e.key: Layout.view(payload, e) for e in layout.entries if EXTRA_STATE in e.key}
    try:
        restore_extra_state(source, staged)
    except BaseException:
        restore_extra_state(source, targets)
        raise


def _as_applied(targets: Mapping[str, torch.Tensor]) -> list[tuple[int, int, int]]:
    """Each tensor's identity, version counter (in-place writes move it on; one through
    ``.data`` does not) and address (``p.data = ...`` swaps the memory under the same object)."""
    return [(id(t), t._version, t.data_ptr()) for t in targets.values()]


class _Adopted:
    """The model's tensors that view leased memory, with the address each was given."""

    __slots__ = ("tensors",)

    def __init__(self) -> None:
        self.tensors: dict[int, tuple[torch.Tensor, int]] = {}

    def add(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            self.tensors[id(t)] = (t, t.data_ptr())

    def materialize(self) -> None:
        """Give each tensor that still views what it was given its own memory (a copy). One the
        user moved since (``share_memory_()``, a new ``.data``) is left as it is."""
        with torch.no_grad():
            for t, ptr in self.tensors.values():
                if t.data_ptr() == ptr:
                    t.data = t.data.clone()
        self.tensors = {}


def _tie_groups(targets: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """The keys that are one tensor in the model (the same memory, dtype, shape and strides), in
    groups of two or more."""
    tied: dict[tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...]], list[str]] = {}
    for key, t in targets.items():
        if t.numel() and t.device.type != "meta":
            tied.setdefault(_identity(t), []).append(key)
    return [keys for keys in tied.values() if len(keys) > 1]


def _overlaps(targets: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """The keys whose memory overlaps without their being one tensor (``_tie_groups``): one a
    slice, a transposed or reinterpreted view of another, in groups of two or more."""
    spans = sorted((t.data_ptr(), t.data_ptr() + _extent(t), key) for key, t in targets.items()
                   if t.numel() and t.device.type != "meta")
    groups: list[list[str]] = []
    group: list[str] = []
    reach = 0
    for lo, hi, key in spans:
        if group and lo < reach:
            group.append(key)
            reach = max(reach, hi)
            continue
        groups.append(group)
        group, reach = [key], hi
    groups.append(group)
    return [g for g in groups if len({_identity(targets[k]) for k in g}) > 1]


def _extent(t: torch.Tensor) -> int:
    """How many bytes from ``t``'s first element its last one ends."""
    return (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def _identity(t: torch.Tensor) -> tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...]]:
    """What makes two keys one tensor (tied): the same memory, dtype, shape and strides."""
    return t.data_ptr(), t.dtype, tuple(t.shape), t.stride()


def _check_overlap(keys: list[str], targets: Mapping[str, torch.Tensor], payload: torch.Tensor, layout: Layout,
                   where: str) -> None:
    """Raise SchemaMismatchError unless writing each of ``keys`` (whose memory overlaps in the
    worker's model) from ``payload`` leaves every one of them holding its own values: the
    writes are made in a scratch copy of the memory they share, then each key read back."""
    tensors = [targets[k] for k in keys]
    lo = min(t.data_ptr() for t in tensors)
    scratch = torch.empty(max(t.data_ptr() + _extent(t) for t in tensors) - lo, dtype=torch.uint8,
                          device=tensors[0].device)
    written = []
    with torch.no_grad():
        for key, t in zip(keys, tensors):
            size, at = t.element_size(), t.data_ptr() - lo
            if at % size:
                raise SchemaMismatchError(f"{where}: {key!r} shares memory with {keys[0]!r} in this worker's model "
                                          f"at an offset its dtype cannot be read from; give the worker separate "
                                          f"tensors (e.g. clone one of them)")
            typed = scratch[:scratch.numel() // size * size].view(t.dtype)
            view = typed.as_strided(t.shape, t.stride(), at // size)
            values = Layout.view(payload, layout.entry(key)).to(device=t.device, dtype=t.dtype)
            view.copy_(values)
            written.append((key, view, values))
        for key, view, values in written:
            if not torch.equal(_bytes_of(view), _bytes_of(values)):
                others = ", ".join(repr(k) for k in keys if k != key)
                raise SchemaMismatchError(
                    f"{where}: {key!r} shares memory with {others} in this worker's model (one views part of "
                    f"another) but the sender's values differ where they overlap: the model cannot hold them all; "
                    f"give the worker separate tensors (e.g. clone one of them), or share them alike in the trainer")


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as raw bytes, in order (NaNs compared bit for bit)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _check_tied_ops(ties: list[list[str]], ops: Sequence[Op], payload: torch.Tensor, where: str) -> None:
    """Raise SchemaMismatchError unless a delta changes the keys of each tied group alike (the
    same elements to the same values, or none): else the sender's have come apart."""
    by_key = {op.entry.key: op for op in ops}
    for keys in ties:
        first = by_key.get(keys[0])
        for key in keys[1:]:
            op = by_key.get(key)
            if first is None and op is None:
                continue
            if first is None or op is None or first.count != op.count or not all(
                    torch.equal(a, b) for a, b in zip(_op_parts(first, payload), _op_parts(op, payload))):
                raise _tie_broken(where, keys[0], key)


def _op_parts(op: Op, payload: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A delta section's bytes: its values, whole, or its indices and their values."""
    if op.count < 0:
        return (payload[op.offset:op.offset + op.wire.nbytes],)
    return (payload[op.offset:op.offset + op.count * INDEX_BYTES],
            payload[op.values_at:op.values_at + op.count * op.wire.torch_dtype.itemsize])


def _tie_broken(where: str, key: str, other: str) -> SchemaMismatchError:
    return SchemaMismatchError(f"{where}: {key!r} and {other!r} are one tensor in this worker's model (tied) but "
                               f"the sender's differ; tie them in the trainer's model too, or untie them in the "
                               f"worker's")


def _checked_payload(delivery: Delivery, where: str) -> torch.Tensor:
    """The delivery's payload if it is what the interface says, a flat contiguous uint8 tensor;
    else TransportError naming what it is (the transport's fault)."""
    payload = delivery.payload
    if not isinstance(payload, torch.Tensor):
        raise TransportError(f"{where}: the transport delivered a {type(payload).__name__} as the payload, "
                             f"not a tensor")
    if payload.dtype != torch.uint8 or payload.dim() != 1 or not payload.is_contiguous():
        raise TransportError(f"{where}: the transport delivered a payload of dtype {payload.dtype}, shape "
                             f"{list(payload.shape)}, strides {list(payload.stride())}: a payload is a flat "
                             f"contiguous uint8 tensor")
    return payload


def _realigned(payload: torch.Tensor, delivery: Delivery) -> torch.Tensor:
    """A copy of ``payload`` at an address torch aligns for every dtype, for a payload at one the
    layout's dtypes cannot be read from (a transport's frame right after its header: a typed copy
    from there may crash the process); ``delivery`` goes back to its transport at once."""
    copy = torch.empty_like(payload, memory_format=torch.contiguous_format)
    copy.copy_(payload)
    _release(delivery)
    return copy


def _release(delivery: Delivery) -> None:
    """Give a delivery back to its transport, once: later calls do nothing."""
    release, delivery.release = delivery.release, None
    if release is not None:
        release()
