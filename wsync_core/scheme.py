"""``WeightSyncScheme``: one state machine for the trainer (sender) and each worker (receiver).

States and the calls that move between them (any other call raises StateError)::

    NEW --init_on_sender--> SENDER --connect--> SENDER_CONNECTED --send/send_async--> (same)
    NEW --init_on_receiver--> RECEIVER --connect--> RECEIVER_CONNECTED --receive--> (same)
    any --shutdown--> CLOSED

The scheme owns snapshots, versions, acks, timeouts, schema and checksum checks; its transport
only moves bytes (see ``wsync_core.transport``).
"""

from __future__ import annotations

import enum
import json
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .deadline import Deadline
from .errors import SchemaMismatchError, StateError, TransportError, WorkerTimeoutError, WsyncError
from .layout import Layout
from .lease import LeaseBook
from .protocol import Ack, Header, crc32
from .registry import resolve_transport
from .report import SendReport
from .transport import (
    Acked,
    Delivery,
    Event,
    Joined,
    Left,
    ReceiverContext,
    ReceiverEndpoint,
    SenderContext,
    SenderEndpoint,
    Transport,
)
from .weights import Weights, check_strategy, flatten, materialize, meta_keys

__all__ = ["WeightSyncScheme", "SendHandle"]

log = logging.getLogger("wsync")

#: how many unfinished sends a sender remembers (an ack for v also completes every send before v)
_MAX_PENDING = 256
#: how often a connected sender answers its transport between calls (seconds)
_SERVICE_INTERVAL = 0.01
_ERROR_TYPES: dict[str, type[WsyncError]] = {
    "SchemaMismatchError": SchemaMismatchError,
    "TransportError": TransportError,
}


class _State(enum.Enum):
    NEW = "new"
    SENDER = "initialized as sender"
    SENDER_CONNECTED = "connected sender"
    RECEIVER = "initialized as receiver"
    RECEIVER_CONNECTED = "connected receiver"
    CLOSED = "shut down"


class SendHandle:
    """An unfinished send; ``wait`` blocks until every target has applied ``version``."""

    def __init__(self, scheme: WeightSyncScheme, version: int, targets: list[int]) -> None:
        self._scheme = scheme
        self.version = version
        self.targets = targets

    def done(self) -> bool:
        """True once every target acked this version (collects waiting acks, never blocks)."""
        return self._scheme._outstanding(self.version, self.targets, Deadline(0.0)) == ([], {})

    def wait(self, timeout: float | None = None) -> int:
        """Return the version once all targets applied it.

        Raises WorkerTimeoutError naming the targets that did not ack by the timeout (the
        scheme's by default), or the error a worker reported for this version.
        """
        with self._scheme._lock:
            self._scheme._expect(_State.SENDER_CONNECTED, "wait")
            self._scheme._finish(self.version, self.targets, self._scheme._deadline(timeout))
        return self.version

    def __repr__(self) -> str:
        return f"SendHandle(version={self.version}, targets={self.targets})"


class WeightSyncScheme:
    """Keeps one model's weights in sync between a trainer and ``num_workers`` workers.

    ``transport`` is an entry-point name (see ``list_transports()``) or a Transport object;
    ``options`` go to the transport. ``timeout`` (seconds) bounds every blocking call unless the
    call says otherwise; ``math.inf`` waits forever.
    """

    def __init__(
        self,
        transport: str | Transport = "inproc",
        *,
        strategy: str = "tensordict",
        sync: bool = True,
        timeout: float = 60.0,
        **options: Any,
    ) -> None:
        Deadline(timeout)  # validates
        self._transport: Transport = resolve_transport(transport, options)
        self._config = {"strategy": check_strategy(strategy), "sync": bool(sync),
                        "timeout": float(timeout), "model_id": None}
        self._reset()

    # -- configuration and pickling -------------------------------------------------------------
    def _reset(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.RLock()
        self._state = _State.NEW
        self._version = -1
        self._endpoint: SenderEndpoint | ReceiverEndpoint | None = None  # opened by connect()
        self._unopened: SenderEndpoint | ReceiverEndpoint | None = None
        self._finalizer: weakref.finalize | None = None
        self._source: Any = None
        self._layout: Layout | None = None
        self._model_id: str = self._config["model_id"] or "policy"
        self._listeners: list[Callable[[SendReport], None]] = []
        # sender side
        self._num_workers = 0
        self._latest: tuple[torch.Tensor, Header] | None = None
        self._acked: dict[int, int] = {}
        self._joined: set[int] = set()
        self._left: set[int] = set()
        self._rejected: dict[int, Ack] = {}
        self._layout_sent: set[int] = set()
        self._pending: OrderedDict[int, tuple[SendReport, float]] = OrderedDict()
        self.last_report: SendReport | None = None
        self._service: threading.Thread | None = None
        self._stop_service = threading.Event()
        # receiver side
        self._worker_idx: int | None = None
        self._leases = LeaseBook()
        self._adopted = _Adopted()

    def __getstate__(self) -> dict[str, Any]:
        return {"transport": self._transport, "config": dict(self._config)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._transport = state["transport"]
        self._config = state["config"]
        self._reset()

    @property
    def transport(self) -> Transport:
        return self._transport

    @property
    def strategy(self) -> str:
        return self._config["strategy"]

    @property
    def sync(self) -> bool:
        return self._config["sync"]

    @property
    def timeout(self) -> float:
        return self._config["timeout"]

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def version(self) -> int:
        """Sender: the last version sent (0 after connect). Receiver: the last version applied.

        -1 before connect.
        """
        return self._version

    @property
    def worker_idx(self) -> int | None:
        return self._worker_idx

    @property
    def state(self) -> str:
        return self._state.value

    def __repr__(self) -> str:
        return f"WeightSyncScheme({self._transport!r}, state={self._state.value!r}, version={self._version})"

    # -- helpers ----------------------------------------------------------------------------
    def _deadline(self, timeout: float | None) -> Deadline:
        return Deadline(self.timeout if timeout is None else timeout)

    def _adopt_fork(self) -> None:
        """In a child made by fork, this object is the parent's: start over as a fresh copy (like
        an unpickled one), leaving the parent's endpoint, threads and buffers alone."""
        if self._pid != os.getpid():
            if self._finalizer is not None:
                self._finalizer.detach()
            self._reset()  # what the model views stays pinned by the parent while this child lives

    def _expect(self, state: _State, call: str) -> None:
        self._adopt_fork()
        if self._state is state:
            return
        if self._state is _State.CLOSED:
            raise StateError(f"{call}() called on a scheme that was shut down; build a new WeightSyncScheme")
        need = {
            _State.NEW: "a new scheme (before init_on_sender() or init_on_receiver())",
            _State.SENDER: "a scheme after init_on_sender() and before connect()",
            _State.SENDER_CONNECTED: "a sender after init_on_sender() and connect()",
            _State.RECEIVER: "a scheme after init_on_receiver() and before connect()",
            _State.RECEIVER_CONNECTED: "a receiver after init_on_receiver() and connect()",
        }[state]
        hint = {
            (_State.NEW, _State.SENDER_CONNECTED): "call init_on_sender() first",
            (_State.SENDER, _State.SENDER_CONNECTED): "call connect() first",
            (_State.NEW, _State.RECEIVER_CONNECTED): "call init_on_receiver() first",
            (_State.RECEIVER, _State.RECEIVER_CONNECTED): "call connect() first",
        }.get((self._state, state))
        if hint is None and self._state in (_State.SENDER, _State.SENDER_CONNECTED):
            hint = "this scheme is a sender; receivers call init_on_receiver() on their own copy"
        if hint is None and self._state in (_State.RECEIVER, _State.RECEIVER_CONNECTED):
            hint = "this scheme is a receiver"
        raise StateError(f"{call}() needs {need}, but this scheme is {self._state.value}; {hint}")

    def _open(self, endpoint: SenderEndpoint | ReceiverEndpoint, deadline: Deadline) -> None:
        try:
            endpoint.open(deadline)
        except BaseException:
            endpoint.close()
            raise
        self._endpoint = endpoint
        self._finalizer = weakref.finalize(self, _close, endpoint, self._stop_service, self._lock, self._pid,
                                           self._adopted, self._leases)

    def add_report_listener(self, listener: Callable[[SendReport], None]) -> None:
        """Call ``listener(report)`` when a send completes or fails (sender side; not pickled)."""
        self._listeners.append(listener)

    # -- sender ------------------------------------------------------------------------------
    def init_on_sender(
        self,
        *,
        model: Weights | None = None,
        weights: Weights | None = None,
        num_workers: int,
        model_id: str = "policy",
    ) -> None:
        """Make this scheme the sender of ``model`` (or ``weights``) to ``num_workers`` workers.

        Nothing is sent and no resource is taken until ``connect()``. Raises StateError if the
        scheme was already initialized, ValueError/TypeError for bad arguments.
        """
        self._adopt_fork()
        with self._lock:
            self._expect(_State.NEW, "init_on_sender")
            if (model is None) == (weights is None):
                raise ValueError("init_on_sender() needs exactly one of model= or weights=")
            if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
                raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
            source = model if model is not None else weights
            tensors = flatten(source, self.strategy)
            meta = meta_keys(tensors)
            if meta:
                raise ValueError(f"init_on_sender(): the weights to send are on the meta device and hold no data "
                                 f"({_clip(meta)}); materialize them (e.g. module.to_empty(device=...) and load "
                                 f"real values) before sending")
            layout = Layout.of(tensors)
            ctx = SenderContext(num_workers, layout, model_id, _device_of(tensors))
            endpoint = self._transport.sender(ctx)
            self._source, self._layout, self._num_workers = source, layout, num_workers
            self._model_id = model_id
            self._config["model_id"] = model_id
            self._acked = {w: -1 for w in range(num_workers)}
            self._unopened = endpoint
            self._state = _State.SENDER

    def _connect_sender(self, deadline: Deadline) -> None:
        self._open(self._unopened, deadline)
        self._unopened = None
        self._state = _State.SENDER_CONNECTED
        self._publish_new(flatten(self._source, self.strategy), list(range(self._num_workers)), deadline, version=0)
        self._pump(Deadline(0.0))
        self._service = threading.Thread(target=self._serve, args=(weakref.ref(self), self._stop_service),
                                         name="wsync-sender-service", daemon=True)
        self._service.start()
        self._finish(0, list(range(self._num_workers)), deadline)

    @staticmethod
    def _serve(ref: weakref.ref, stop: threading.Event) -> None:
        """Between calls, keep answering the transport: late joiners get the latest version and
        acks of asynchronous sends are collected, without waiting for the next send()."""
        last_error = ""
        while not stop.wait(_SERVICE_INTERVAL):
            scheme = ref()
            if scheme is None:
                return
            if scheme._lock.acquire(blocking=False):
                try:
                    if scheme._state is _State.SENDER_CONNECTED:
                        scheme._pump(Deadline(0.0))
                        last_error = ""
                except WsyncError as exc:  # the next call on the scheme raises it; say it once here
                    if str(exc) != last_error:
                        log.warning("sender service: %s", exc)
                    last_error = str(exc)
                finally:
                    scheme._lock.release()
            del scheme

    def send(self, weights: Weights | None = None, worker_ids: Iterable[int] | None = None,
             timeout: float | None = None) -> int:
        """Snapshot ``weights`` (default: the model given to init_on_sender) and send it.

        Returns the new version. With ``sync=True`` it returns once every target applied it;
        raises WorkerTimeoutError naming the targets that did not (the others are updated).
        Raises SchemaMismatchError if ``weights`` does not match, before anything is sent.
        """
        deadline = self._deadline(timeout)  # one deadline for the snapshot and the acks
        handle = self._send_async(weights, worker_ids, deadline)
        if self.sync:
            with self._lock:
                self._expect(_State.SENDER_CONNECTED, "send")
                self._finish(handle.version, handle.targets, deadline)
        return handle.version

    def send_async(self, weights: Weights | None = None, worker_ids: Iterable[int] | None = None,
                   timeout: float | None = None) -> SendHandle:
        """Snapshot and send like ``send``, but return at once with a handle to ``wait`` on."""
        return self._send_async(weights, worker_ids, self._deadline(timeout))

    def _send_async(self, weights: Weights | None, worker_ids: Iterable[int] | None, deadline: Deadline) -> SendHandle:
        self._adopt_fork()
        with self._lock:
            self._expect(_State.SENDER_CONNECTED, "send")
            targets = self._targets(worker_ids)
            if weights is None:
                tensors = flatten(self._source, self.strategy, detach=False)
            else:
                tensors = flatten(weights, self.strategy, detach=False)
            self._layout.check_fits(tensors, mine="trainer's model", theirs="weights given to send()",
                                    context="send(weights=...)")
            self._pump(Deadline(0.0))
            version = self._publish_new(tensors, targets, deadline, version=self._version + 1)
            return SendHandle(self, version, targets)

    def _targets(self, worker_ids: Iterable[int] | None) -> list[int]:
        if worker_ids is None:
            return list(range(self._num_workers))
        if isinstance(worker_ids, int):
            worker_ids = [worker_ids]
        targets = sorted(set(worker_ids))
        bad = [w for w in targets if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w < self._num_workers]
        if bad or not targets:
            raise ValueError(f"worker_ids must be a non-empty list of ints in [0, {self._num_workers}), got {worker_ids!r}")
        return targets

    def _publish_new(self, tensors: dict[str, torch.Tensor], targets: list[int], deadline: Deadline,
                     version: int) -> int:
        endpoint = self._endpoint
        t0 = time.perf_counter()
        buffer = endpoint.acquire(deadline)
        step = endpoint.stream_bytes
        if step > 0 and not self._transport.checksum:  # a checksum needs the whole payload first
            joined = [w for w in targets if w in self._joined]
            self._layout.pack_stream(tensors, buffer, step, lambda n: endpoint.ready(buffer, n, joined))
        else:
            self._layout.pack(tensors, buffer)
        if buffer.is_cuda:
            torch.cuda.current_stream(buffer.device).synchronize()
        crc = crc32(buffer) if self._transport.checksum else None
        header = Header(version, self._model_id, self._layout.digest, self._layout.nbytes, crc)
        t1 = time.perf_counter()
        self._version = version
        self._latest = (buffer, header)
        report = SendReport(version, self._layout.nbytes, targets, snapshot_s=t1 - t0)
        self._pending[version] = (report, t0)
        while len(self._pending) > _MAX_PENDING:
            self._pending.popitem(last=False)
        self.last_report = report
        for w in targets:
            self._rejected.pop(w, None)
        self._deliver([w for w in targets if w in self._joined])
        report.publish_s = time.perf_counter() - t1
        log.debug("version %d: %d bytes to %s, snapshot %.3f ms", version, report.nbytes, targets,
                  report.snapshot_s * 1e3)
        return version

    def _deliver(self, workers: list[int]) -> None:
        """Publish the latest snapshot to ``workers``; a worker's first delivery carries the layout."""
        if not workers or self._latest is None:
            return
        buffer, header = self._latest
        fresh = [w for w in workers if w not in self._layout_sent]
        known = [w for w in workers if w in self._layout_sent]
        if known:
            self._endpoint.publish(buffer, header.encode(), known)
        if fresh:
            full = Header(header.version, header.model_id, header.digest, header.nbytes, header.crc,
                          layout=_layout_wire(self._layout))
            self._endpoint.publish(buffer, full.encode(), fresh)
            self._layout_sent.update(fresh)

    def _pump(self, deadline: Deadline) -> None:
        """Handle the transport's events, waiting for some until ``deadline``."""
        for event in self._endpoint.poll(deadline):
            self._handle(event)

    def _handle(self, event: Event) -> None:
        w = event.worker
        if not (isinstance(w, int) and 0 <= w < self._num_workers):
            log.warning("ignoring %s from unknown worker %r (num_workers=%d)", type(event).__name__, w,
                        self._num_workers)
            return
        if isinstance(event, Joined):
            log.info("worker %d joined", w)
            self._joined.add(w)
            self._left.discard(w)
            self._acked[w] = -1
            self._layout_sent.discard(w)
            self._deliver([w])
        elif isinstance(event, Left):
            log.info("worker %d left: %s", w, event.reason)
            self._joined.discard(w)
            self._left.add(w)
        elif isinstance(event, Acked):
            try:
                ack = Ack.decode(event.data)
                if ack.worker != w or ack.version > self._version:
                    raise TransportError(f"ack names worker {ack.worker}, version {ack.version}")
            except TransportError as exc:
                log.warning("worker %d sent a malformed ack: %s", w, exc)
                self._rejected[w] = Ack(w, self._version, f"malformed ack: {exc}", "TransportError")
                return
            if ack.error is not None:
                log.warning("worker %d rejected version %d: %s", w, ack.version, ack.error)
                self._rejected[w] = ack
                return
            if ack.version > self._acked[w]:
                previous, self._acked[w] = self._acked[w], ack.version
                now = time.perf_counter()
                for version in reversed(self._pending):  # newest first: older ones were done by `previous`
                    if version <= previous:
                        break
                    report, t0 = self._pending[version]
                    if version <= ack.version and w in report.targets and w not in report.ack_latency:
                        report.ack_latency[w] = now - t0
                        if report.complete:
                            report.total_s = now - t0
                            report.missing = []
                            self._notify(report)

    def _notify(self, report: SendReport) -> None:
        for listener in self._listeners:
            listener(report)

    def _outstanding(self, version: int, targets: list[int], deadline: Deadline) -> tuple[list[int], dict[int, Ack]]:
        """Collect events until every target acked ``version`` or failed, or the deadline passes.

        Returns (targets still missing, rejections by worker).
        """
        while True:
            rejected = {w: a for w in targets if (a := self._rejected.get(w)) and a.version >= version}
            missing = [w for w in targets if self._acked[w] < version and w not in rejected]
            alive = [w for w in missing if w not in self._left]
            if not alive or deadline.expired():
                return missing, rejected
            self._pump(deadline)

    def _finish(self, version: int, targets: list[int], deadline: Deadline) -> None:
        missing, rejected = self._outstanding(version, targets, deadline)
        entry = self._pending.get(version)
        if entry is not None:
            report = entry[0]
            report.missing = missing + sorted(rejected)
            if report.missing:
                self._notify(report)
        if rejected:
            w, ack = min(rejected.items())
            cls = _ERROR_TYPES.get(ack.error_type or "", TransportError)
            others = f" (also failed: {sorted(set(rejected) - {w})})" if len(rejected) > 1 else ""
            raise cls(f"worker {w} rejected version {version}: {ack.error}{others}")
        if missing:
            gone = [w for w in missing if w in self._left]
            detail = f"; workers {gone} disconnected" if gone else ""
            updated = [w for w in targets if w not in missing and w not in rejected]
            raise WorkerTimeoutError(
                f"workers {missing} did not apply version {version} within {deadline.timeout:g} s{detail}; "
                f"updated: {updated}", missing)

    # -- receiver ----------------------------------------------------------------------------
    def init_on_receiver(self, *, model: Weights, worker_idx: int, model_id: str | None = None) -> None:
        """Make this scheme worker ``worker_idx``'s receiver into ``model`` (updated in place).

        Raises StateError if the scheme was already initialized, ValueError/TypeError for bad
        arguments.
        """
        self._adopt_fork()
        with self._lock:
            self._expect(_State.NEW, "init_on_receiver")
            if isinstance(worker_idx, bool) or not isinstance(worker_idx, int) or worker_idx < 0:
                raise ValueError(f"worker_idx must be an int >= 0, got {worker_idx!r}")
            tensors = flatten(model, self.strategy)
            layout = Layout.of(tensors)
            model_id = model_id or self._model_id
            device = _device_of(tensors)
            if device.type == "meta":  # materialized on the CPU from the first payload
                device = torch.device("cpu")
            endpoint = self._transport.receiver(ReceiverContext(worker_idx, layout, model_id, device))
            self._source, self._layout, self._worker_idx, self._model_id = model, layout, worker_idx, model_id
            self._unopened = endpoint
            self._state = _State.RECEIVER

    def _connect_receiver(self, deadline: Deadline) -> None:
        if self._endpoint is None:
            self._open(self._unopened, deadline)
            self._unopened = None
        while True:
            if self._receive(deadline) is not None:
                break
            if deadline.expired():
                raise WorkerTimeoutError(
                    f"worker {self._worker_idx} got no weights from the sender within {deadline.timeout:g} s; "
                    f"is the sender connecting with the same transport options?", [])
        self._state = _State.RECEIVER_CONNECTED

    def receive(self, timeout: float = 0.0) -> int | None:
        """Apply the newest version that arrived, waiting up to ``timeout`` seconds for one.

        Returns the version applied, or None if nothing new came. A damaged or mismatched
        payload raises TransportError or SchemaMismatchError and leaves the model untouched.
        """
        self._adopt_fork()
        with self._lock:
            self._expect(_State.RECEIVER_CONNECTED, "receive")
            return self._receive(Deadline(timeout))

    def _receive(self, deadline: Deadline) -> int | None:
        endpoint: ReceiverEndpoint = self._endpoint  # type: ignore[assignment]
        self._leases.drain()  # memory the worker stopped viewing since the last call
        best: tuple[Delivery, Header] | None = None
        stale = False
        delivery = endpoint.recv(deadline)
        try:
            while delivery is not None:
                try:
                    header = Header.decode(delivery.header)
                except TransportError as exc:
                    _release(delivery)
                    self._reject(self._version, exc)
                    raise
                if header.version > (best[1].version if best else self._version):
                    if best is not None:
                        _release(best[0])
                    best = (delivery, header)
                else:
                    stale = True
                    _release(delivery)
                delivery = endpoint.recv(Deadline(0.0))
        except BaseException:
            if best is not None:
                _release(best[0])
            raise
        if best is None:
            if stale and self._version >= 0:
                # a re-delivery of what this worker holds (e.g. after a reconnect): the sender may
                # still wait for that ack
                endpoint.ack(Ack(self._worker_idx, self._version).encode())
            return None
        delivery, header = best
        try:
            self._apply(delivery, header)
        except (SchemaMismatchError, TransportError) as exc:
            _release(delivery)
            self._reject(header.version, exc)
            raise
        finally:
            _release(delivery)  # a no-op for memory the model now views: its lease gives it back
        self._version = header.version
        del delivery, best
        self._leases.drain()  # before the ack: the sender may reuse what the model stopped viewing
        endpoint.ack(Ack(self._worker_idx, header.version).encode())
        return header.version

    def _reject(self, version: int, exc: WsyncError) -> None:
        log.warning("worker %s rejected version %d: %s", self._worker_idx, version, exc)
        self._endpoint.ack(Ack(self._worker_idx, version, str(exc), type(exc).__name__).encode())

    def _apply(self, delivery: Delivery, header: Header) -> None:
        """Check everything about a delivery, then copy it into the model, or make the model's
        tensors views of it where the delivery is adoptable (the model's memory then is leased:
        ``delivery.release`` runs once nothing views it). Nothing is written on error."""
        layout = self._layout
        where = f"worker {self._worker_idx}, version {header.version}"
        if header.model_id != self._model_id:
            raise SchemaMismatchError(f"{where}: payload is for model {header.model_id!r}, this receiver "
                                      f"holds {self._model_id!r}")
        if header.digest != layout.digest:
            if header.layout is not None:
                try:
                    theirs = Layout.from_wire(header.layout)
                except ValueError as exc:
                    raise TransportError(f"{where}: malformed layout in header: {exc}") from None
                theirs.check_matches(layout, context=where)
            raise SchemaMismatchError(f"{where}: sender layout {header.digest[:12]} differs from this "
                                      f"model's {layout.digest[:12]}")
        payload = delivery.payload
        if (header.nbytes != layout.nbytes or not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8
                or payload.dim() != 1 or payload.numel() != layout.nbytes):
            size = payload.numel() if isinstance(payload, torch.Tensor) else "no tensor"
            raise TransportError(f"{where}: payload has {size} bytes (header says {header.nbytes}), "
                                 f"expected {layout.nbytes}")
        if header.crc is not None and crc32(payload) != header.crc:
            raise TransportError(f"{where}: payload checksum mismatch (damaged in transit)")
        targets = flatten(self._source, self.strategy, detach=False)
        layout.check_fits(targets, mine="model at init_on_receiver()", theirs="model now", context=where)
        if meta_keys(targets):  # a model built on the meta device gets real memory from its first payload
            materialize(self._source, payload.device if payload.device.type != "meta" else torch.device("cpu"))
            targets = flatten(self._source, self.strategy, detach=False)
        layout.check_writable(targets, context=where)
        if delivery.adoptable and payload.device.type == "cpu":
            release, delivery.release = delivery.release, None
            payload = self._leases.wrap(payload, release)
            self._adopted.add(layout.adopt(payload, targets))
        else:
            layout.unpack(payload, targets)
        if payload.is_cuda or any(t.is_cuda for t in targets.values()):
            torch.cuda.synchronize()

    # -- both --------------------------------------------------------------------------------
    def connect(self, timeout: float | None = None) -> None:
        """Sender: publish version 0 and wait until every worker holds it. Receiver: wait for
        the current version and apply it.

        Raises WorkerTimeoutError on expiry (a sender stays connected and usable for the
        workers that answered), SchemaMismatchError if the two sides' weights differ.
        """
        self._adopt_fork()
        with self._lock:
            deadline = self._deadline(timeout)
            if self._state is _State.SENDER:
                self._connect_sender(deadline)
            elif self._state is _State.RECEIVER:
                self._connect_receiver(deadline)
            else:
                self._expect(_State.RECEIVER if self._worker_idx is not None else _State.SENDER, "connect")

    def shutdown(self) -> None:
        """Free every resource this scheme holds. Idempotent; the scheme is unusable afterwards."""
        self._adopt_fork()
        self._stop_service.set()
        if self._service is not None and self._service is not threading.current_thread():
            self._service.join()
        self._adopt_fork()
        with self._lock:
            if self._layout is not None:
                self._layout.drop_views()
            if self._finalizer is not None:
                self._finalizer()
            elif self._unopened is not None:
                self._unopened.close()
            self._leases.close()
            self._unopened = None
            self._endpoint = None
            self._source = None
            self._latest = None
            self._state = _State.CLOSED


def _close(endpoint: SenderEndpoint | ReceiverEndpoint, stop_service: threading.Event, lock: threading.RLock,
           pid: int, adopted: _Adopted, leases: LeaseBook) -> None:
    """Close an endpoint once no one uses it: the service thread is stopped first and the lock held,
    and a model that views a transport's memory gets its own copy first (a closed transport may
    reuse that memory). A forked child never closes its parent's endpoint."""
    if os.getpid() != pid:
        return
    stop_service.set()
    with lock:
        adopted.materialize()
        leases.close()
        endpoint.close()


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


def _release(delivery: Delivery) -> None:
    """Give a delivery back to its transport, once: later calls do nothing."""
    release, delivery.release = delivery.release, None
    if release is not None:
        release()


def _device_of(tensors: dict[str, torch.Tensor]) -> torch.device:
    for t in tensors.values():
        return t.device
    return torch.device("cpu")


def _layout_wire(layout: Layout) -> Any:
    return json.loads(layout.to_json())


def _clip(keys: list[str], n: int = 6) -> str:
    shown = ", ".join(repr(k) for k in keys[:n])
    return shown + (f" and {len(keys) - n} more" if len(keys) > n else "")
