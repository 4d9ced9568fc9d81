"""The trainer's side of a scheme: snapshots, versions, deliveries and acks for one model.

``WeightSyncScheme`` builds one ``Sender`` at ``init_on_sender`` and calls it under its lock;
a service thread keeps answering the transport between calls (late joiners get the latest
version, acks of asynchronous sends are collected).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import operator
import secrets
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

import torch

from .deadline import POLL, Deadline
from .delta import Costs, Mirror, wire_layout
from .errors import SchemaMismatchError, StateError, TransportError, WorkerDiedError, WorkerTimeoutError, WsyncError
from .layout import ALIGN, Layout, clip_keys
from .protocol import Ack, Header, checksum
from .report import SendReport
from .transport import Acked, Buffer, Event, Joined, Left, SenderContext, SenderEndpoint, Transport, number
from .weights import Strategy, Weights, device_of, flatten, meta_keys, unwrap, warn_unsent

__all__ = ["Sender", "SendHandle"]

log = logging.getLogger("wsync")

#: how many unfinished sends a sender remembers (an ack for v also completes every send before v)
_MAX_PENDING = 256
#: how long a sender waits for a buffer to send a joiner the newest version in full (seconds)
_FULL_ACQUIRE_S = 5.0
#: how often a connected sender answers its transport between calls (seconds)
_SERVICE_INTERVAL = 0.01
#: how long a wait for acks polls before it lets in a thread that waits for the lock (seconds)
_LET_IN_S = 0.05
_ERROR_TYPES: dict[str, type[WsyncError]] = {
    "SchemaMismatchError": SchemaMismatchError,
    "TransportError": TransportError,
}


class SendHandle:
    """An unfinished send; ``wait`` blocks until every target has applied ``version``."""

    def __init__(self, sender: Sender, wait: Callable[[SendHandle, float | None], None], version: int,
                 targets: list[int]) -> None:
        self._sender = sender
        self._wait = wait
        self.version = version
        self.targets = targets

    def done(self) -> bool:
        """True once every target acked this version (collects waiting acks, never blocks: while
        another thread holds the scheme, e.g. waiting for acks, it answers from those collected)."""
        sender = self._sender
        if sender.lock.acquire(blocking=False):
            try:
                sender.serve_once()
                sender.raise_deferred()
            finally:
                sender.lock.release()
        return sender.applied(self.version, self.targets)

    def wait(self, timeout: float | None = None) -> int:
        """Return the version once all targets applied it or a newer one (which holds every key
        of it: a version a worker refused completes once it applied a newer one).

        Raises WorkerTimeoutError naming the targets that did not ack by the timeout (the
        scheme's by default), or the error a worker reported for this version.
        """
        self._wait(self, timeout)
        return self.version

    def __repr__(self) -> str:
        return f"SendHandle(version={self.version}, targets={self.targets})"


class Sender:
    """One model sent to ``num_workers`` workers through ``transport``; used under ``lock``."""

    def __init__(self, transport: Transport, source: Weights, *, num_workers: int, model_id: str, strategy: Strategy,
                 lock: threading.RLock, delta: bool | str = False, delta_bases: int = 2, wire_dtype: str | None = None,
                 delta_dense: float | None = None, origin: str | None = None) -> None:
        """Check ``source`` and build (not open) the endpoint. Raises ValueError for weights on
        the meta device or a bad ``num_workers``, TypeError for weights of another type."""
        num_workers = number("num_workers", num_workers, 1, integer=True)
        tensors = flatten(source, strategy)
        _refuse_meta(tensors, "init_on_sender()")
        warn_unsent(unwrap(source), tensors, "init_on_sender()")
        self.layout = Layout.of(tensors)
        #: what every copy of this sender's scheme carries (given, if the scheme was a copy of one already)
        self.origin = origin or secrets.token_hex(8)
        #: names this sender in every header (``Header.session``): its origin, then a part of its own
        self.session = self.origin + secrets.token_hex(8)
        self.endpoint: SenderEndpoint = transport.sender(SenderContext(num_workers, self.layout, model_id,
                                                                       device_of(tensors), self.origin))
        self.transport = transport
        self.source = unwrap(source)
        self.strategy = strategy
        self.model_id = model_id
        self.num_workers = num_workers
        self.lock = lock
        #: a wait collecting acks under ``lock`` lets the threads that want it in between polls (``take_turn``)
        self._turn = threading.Condition(lock)
        self._wanting = 0
        self._wanting_lock = threading.Lock()
        self.version = -1
        self.connected = False
        self.closing = False
        self.last_report: SendReport | None = None
        self.listeners: list[Callable[[SendReport], None]] = []
        #: the first error a report listener raised, until a call of the user's raises it
        self._deferred: Exception | None = None
        self._latest: tuple[Buffer, Header] | None = None  # what a joiner gets: the buffer as published
        self._acked = {w: -1 for w in range(num_workers)}
        self._joined: set[int] = set()
        self._left: dict[int, str] = {}  # worker -> how the transport knows it left
        self._rejected: dict[int, Ack] = {}
        #: each worker's last refusal since it last applied a version (named when it times out)
        self._refusals: dict[int, Ack] = {}
        self._layout_sent: set[int] = set()
        self._pending: OrderedDict[int, tuple[SendReport, float]] = OrderedDict()
        self._service: threading.Thread | None = None
        self.stop_service = threading.Event()
        #: floating tensors travel in this dtype (None: the model's)
        self.wire = wire_dtype
        self.wire_layout = wire_layout(self.layout, wire_dtype)
        #: delta=True: the newest version as sent, and what the last versions changed
        self.mirror = Mirror(self.layout, wire_dtype, delta_bases, device_of(tensors)) if delta else None
        #: delta=True on a zero-copy transport (a full send is one copy there): whether diffing pays,
        #: from the times of past sends (delta="always", or a transport that copies: deltas throughout)
        self.costs = Costs(self.wire_layout.nbytes) if delta is True and transport.capabilities.zero_copy else None
        self._timed: OrderedDict[int, str] = OrderedDict()  # version -> "delta" or "probe", until acked
        if delta_dense is None:  # on shared memory a full payload is one copy and is adopted as it is
            delta_dense = 0.1 if transport.capabilities.zero_copy else 0.5
        #: a delta larger than this share of a full payload is sent as a full one
        self.delta_dense = float(delta_dense)
        #: the newest version each worker acked since it (re)joined: the base of its next delta
        self._holds: dict[int, int] = {}
        self._numel = sum(t.numel() for t in tensors.values())

    # -- lifecycle ----------------------------------------------------------------------------
    def open(self, deadline: Deadline) -> None:
        """Open the endpoint; closes it again if that fails."""
        try:
            self.endpoint.open(deadline)
        except BaseException:
            self.endpoint.close()
            raise
        self.connected = True

    def start(self, deadline: Deadline, watch: Callable[[list[int]], Mapping[int, str]] | None) -> None:
        """Publish version 0, start the service thread, and wait until every worker applied it."""
        self._publish_new(flatten(self.source, self.strategy), list(range(self.num_workers)), deadline, version=0)
        self._pump(POLL)
        self._service = threading.Thread(target=_serve, args=(weakref.ref(self), self.stop_service),
                                         name="wsync-sender-service", daemon=True)
        self._service.start()
        if watch is not None:
            self._watch_connect(watch, deadline)
        self.finish(0, list(range(self.num_workers)), deadline)

    def stop(self) -> None:
        """Stop the service thread (from any thread but the service itself, without the lock)."""
        self.stop_service.set()
        if self._service is not None and self._service is not threading.current_thread():
            self._service.join()

    def close(self) -> None:
        """Stop the service thread and close the endpoint; idempotent."""
        self.stop_service.set()
        with self.lock:
            self.endpoint.close()
            self._latest = None
            if self.mirror is not None:
                self.mirror.release()
            self.connected = False

    # -- sending --------------------------------------------------------------------------------
    def send_async(self, weights: Weights | None, worker_ids: Iterable[int] | None, deadline: Deadline,
                   wait: Callable[[SendHandle, float | None], None], keys: Iterable[str] | None = None) -> SendHandle:
        """Snapshot ``weights`` (default: the source) and publish it as the next version (with
        ``keys``: the previous version with those tensors replaced). Raises first the error a
        report listener raised since the last call, if any (nothing is sent then)."""
        self.raise_deferred()
        targets = self._targets(worker_ids)
        chosen = self._keys(keys)
        tensors = flatten(self.source if weights is None else weights, self.strategy, detach=False)
        if chosen is not None:
            chosen = _with_aliases(chosen, tensors)
        plain = self.layout.ready(tensors, write=False)  # the common case in one pass
        if not plain and weights is None:
            self.layout.check_fits(tensors, mine="model at init_on_sender", theirs="model now",
                                   context="send(): the trainer's model changed since init_on_sender")
        elif not plain:
            self.layout.check_fits(tensors, mine="trainer's model", theirs="weights given to send()",
                                   context="send(weights=...)")
        if not plain:
            _refuse_meta(tensors, "send()")
        self._pump(POLL)
        version = self._publish_new(tensors, targets, deadline, version=self.version + 1, keys=chosen, plain=plain)
        return SendHandle(self, wait, version, targets)

    def _acquire(self, deadline: Deadline) -> Buffer:
        """The endpoint's ``acquire()``, checked: a buffer the layout can be packed into (a typed copy
        to a misaligned address can crash the process). Raises TransportError naming the transport,
        StateError if ``shutdown()`` from another thread ended the wait for a buffer."""
        try:
            buffer = self.endpoint.acquire(deadline)
        except WsyncError:
            if self.closing:
                raise StateError("send() was interrupted while waiting for a free buffer: shutdown() was called "
                                 "from another thread; build a new WeightSyncScheme") from None
            raise
        t = buffer.tensor
        if (not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous()
                or t.numel() < self.layout.nbytes or t.data_ptr() % ALIGN):
            what = (f"dtype {t.dtype}, shape {list(t.shape)}, strides {list(t.stride())}, address {t.data_ptr():#x}"
                    if isinstance(t, torch.Tensor) else f"a {type(t).__name__}")
            raise TransportError(f"{self.transport!r}: acquire() returned a buffer of {what}; it must be a flat "
                                 f"contiguous uint8 tensor of at least {self.layout.nbytes} bytes at an address "
                                 f"that is a multiple of {ALIGN}")
        return buffer

    def _keys(self, keys: Iterable[str] | None) -> list[str] | None:
        """``keys`` checked against the layout, sorted; raises ValueError for none or an unknown one."""
        if keys is None:
            return None
        if isinstance(keys, str):
            keys = [keys]
        chosen = sorted(set(keys))
        known = {e.key for e in self.layout.entries}
        if not chosen:
            raise ValueError("send(keys=...) names no key: give one of the model's keys or a non-empty list of them")
        unknown = [k for k in chosen if not isinstance(k, str) or k not in known]
        if unknown:
            raise ValueError(f"send(keys=...) needs keys of the model; unknown: "
                             f"{clip_keys([repr(k) if not isinstance(k, str) else k for k in unknown])}")
        return chosen

    def _targets(self, worker_ids: Iterable[int] | int | None) -> list[int]:
        """``worker_ids`` as a sorted list of indices (any integers: numpy's, a torch scalar); raises
        ValueError for an empty one, or anything not an index in ``[0, num_workers)``."""
        if worker_ids is None:
            return list(range(self.num_workers))
        one = _index(worker_ids)
        given: list[object]
        try:  # (an int is an index: refused below if a bool, which list() would refuse too)
            given = [worker_ids] if one is not None or isinstance(worker_ids, int) else list(worker_ids)
        except TypeError:
            given = []
        targets = [_index(w) for w in given]
        indices = [w for w in targets if w is not None and 0 <= w < self.num_workers]
        if not targets or len(indices) < len(targets):
            raise ValueError(f"worker_ids must be a non-empty list of ints in [0, {self.num_workers}), got {worker_ids!r}")
        return sorted(set(indices))

    def _publish_new(self, tensors: dict[str, torch.Tensor], targets: list[int], deadline: Deadline,
                     version: int, keys: list[str] | None = None, plain: bool = False) -> int:
        """Snapshot ``tensors`` and publish them as ``version`` to the joined ``targets``;
        ``plain``: ``layout.ready(tensors, write=False)`` said so."""
        costs = self.costs
        choice = costs.next_send() if costs is not None and keys is None and version > 0 else "delta"
        if choice == "full":  # a full send is cheaper here than a diff: stop diffing (and free the mirror)
            # (only Costs says "full", once it timed a probe; a sender has Costs only beside a mirror)
            assert costs is not None and costs.full is not None and self.mirror is not None
            log.info("delta=True: a full send (%.1f ms) beats a delta (%.1f ms) on this transport; sending full "
                     "payloads from now on", costs.full * 1e3, min(t for t, _ in costs.delta) * 1e3)
            self.mirror.release()
            self.mirror = self.costs = None
        if self.mirror is not None or self.wire is not None or keys is not None:
            return self._publish_encoded(tensors, targets, deadline, version, keys, probe=choice == "probe")
        endpoint = self.endpoint
        t0 = time.perf_counter()
        buffer = self._acquire(deadline)
        tensor = buffer.tensor
        step = endpoint.stream_bytes
        if step > 0 and not self.transport.checksum:  # a checksum needs the whole payload first
            joined = [w for w in targets if w in self._joined]
            self.layout.pack_stream(tensors, tensor, step, lambda n: endpoint.ready(buffer, n, joined))
        else:
            self.layout.pack(tensors, tensor, ready=plain)
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()
        buffer.used = tensor.numel()
        sums = checksum(tensor) if self.transport.checksum else None
        header = Header(version, self.model_id, self.layout.digest, self.layout.nbytes, sums, session=self.session)
        t1 = time.perf_counter()
        self.version = version
        self._latest = (buffer, header)
        report = SendReport(version, self.layout.nbytes, targets, snapshot_s=t1 - t0,
                            worker_nbytes={w: self.layout.nbytes for w in targets if w in self._joined},
                            full_nbytes=self.layout.nbytes, changed=None)
        self._record(report, t0)
        self._deliver([w for w in targets if w in self._joined])
        report.publish_s = time.perf_counter() - t1
        log.debug("version %d: %d bytes to %s, snapshot %.3f ms", version, report.nbytes, targets,
                  report.snapshot_s * 1e3)
        return version

    # -- encoded payloads (wsync_core.delta) ---------------------------------------------------
    def _publish_encoded(self, tensors: dict[str, torch.Tensor], targets: list[int], deadline: Deadline,
                         version: int, keys: list[str] | None, probe: bool = False) -> int:
        """Publish ``version`` with a wire dtype, a key subset or deltas: each joined target gets
        what changed since the version it holds where that is known, kept and small enough, else
        a full payload; targets at the same version share one payload. ``probe``: no diff, the
        mirror is reset to ``tensors`` and everyone gets it in full (timed for ``Costs``)."""
        t0 = time.perf_counter()
        mirror = self.mirror
        joined = [w for w in targets if w in self._joined]
        report = SendReport(version, 0, targets, full_nbytes=self.wire_layout.nbytes)
        payloads: list[tuple[list[int], Callable[[torch.Tensor], tuple[Header, int]]]] = []
        if mirror is None:  # a wire dtype or a key subset, without delta: a full payload
            previous = None
            if keys is not None:
                latest = self._latest
                if latest is None:
                    raise StateError("send(keys=...) before version 0 was published")
                previous = latest[0].tensor
            payloads.append((joined, lambda buf: self._pack_full(buf, version, tensors, keys, previous)))
            t1 = t0
        else:
            if mirror.version < 0 or probe:
                mirror.reset(tensors, version)
                changed = None if probe else self._numel
            else:
                changed = mirror.update(tensors, version, keys)
            self.version = version  # the mirror holds it now: a later failure leaves it unsent, not lost
            t1 = time.perf_counter()
            report.diff_s = 0.0 if probe else t1 - t0
            report.changed = None if changed is None else changed / self._numel if self._numel else 0.0
            groups: dict[int | None, list[int]] = {}
            for w in joined:
                groups.setdefault(self._holds.get(w), []).append(w)
            for base, ws in sorted(groups.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
                changes = mirror.since(base) if base is not None else None
                if (base is not None and changes is not None  # (changes is None without a base)
                        and mirror.delta_nbytes(changes) <= self.delta_dense * mirror.wire.nbytes):
                    payloads.append((ws, functools.partial(self._pack_delta, mirror, version=version, changes=changes,
                                                           base=base)))
                    report.delta_workers += ws
                else:
                    payloads.append((ws, lambda buf: self._pack_mirror(mirror, buf, version)))
            if not payloads:
                self._latest = None
            if self.costs is not None and keys is None and version > 0 and joined:
                kind = "probe" if probe else "delta" if len(report.delta_workers) == len(joined) else None
                if kind is not None:
                    self._timed[version] = kind
                    while len(self._timed) > _MAX_PENDING:
                        self._timed.popitem(last=False)
        published: list[tuple[Buffer, Header, list[int]]] = []
        for ws, pack in payloads:
            buffer = self._acquire(deadline)
            header, used = pack(buffer.tensor)
            if buffer.tensor.is_cuda:
                torch.cuda.current_stream(buffer.tensor.device).synchronize()
            published.append((self._publish_to(buffer, used, header, ws), header, ws))
            for w in ws:
                report.worker_nbytes[w] = self._wire_nbytes(buffer, used)
        t2 = time.perf_counter()
        report.snapshot_s = t2 - t1
        report.nbytes = max(report.worker_nbytes.values(), default=0)
        self.version = version
        full = [(b, h) for b, h, _ in published if h.table is None]
        if full or mirror is None:
            self._latest = full[-1] if full else None
        elif published:
            self._latest = None  # a joiner gets the mirror in full
        self._record(report, t0)
        report.publish_s = time.perf_counter() - t2
        log.debug("version %d: %s bytes to %s (%s deltas), diff %.3f ms", version, report.worker_nbytes, targets,
                  report.delta_workers, report.diff_s * 1e3)
        return version

    def _moves_prefix(self) -> bool:
        """Whether only the used bytes of a payload move (the rest of the buffer stays behind)."""
        return bool(getattr(self.endpoint, "prefix_publish", False)) or self.transport.capabilities.zero_copy

    def _wire_nbytes(self, buffer: Buffer, used: int) -> int:
        """The bytes a worker gets when ``buffer`` is published with ``used`` bytes in it."""
        return used if self._moves_prefix() else buffer.tensor.numel()

    def _header(self, version: int, buffer: torch.Tensor, used: int, table: list[list[int]] | None = None,
                base: int | None = None) -> Header:
        sums = checksum(buffer[:used]) if self.transport.checksum else None
        return Header(version, self.model_id, self.layout.digest, used, sums, wire=self.wire, table=table, base=base,
                      session=self.session)

    def _pack_full(self, buffer: torch.Tensor, version: int, tensors: dict[str, torch.Tensor],
                   keys: list[str] | None, previous: torch.Tensor | None) -> tuple[Header, int]:
        """A full payload in the wire layout: ``tensors`` cast (only ``keys`` over ``previous``)."""
        wire = self.wire_layout
        wanted = None if keys is None else set(keys)
        with torch.no_grad():
            if previous is not None and previous.data_ptr() != buffer.data_ptr():
                buffer[:wire.nbytes].copy_(previous[:wire.nbytes])
            for e in wire.entries:
                if e.nbytes and (wanted is None or e.key in wanted):
                    Layout.view(buffer, e).copy_(tensors[e.key])
        return self._header(version, buffer, wire.nbytes), wire.nbytes

    def _pack_mirror(self, mirror: Mirror, buffer: torch.Tensor, version: int) -> tuple[Header, int]:
        mirror.pack(buffer)
        used = mirror.wire.nbytes
        return self._header(version, buffer, used), used

    def _pack_delta(self, mirror: Mirror, buffer: torch.Tensor, version: int, changes: dict,
                    base: int) -> tuple[Header, int]:
        encoded = mirror.encode(changes, buffer)
        return self._header(version, buffer, encoded.nbytes, encoded.table, base), encoded.nbytes

    def _publish_to(self, buffer: Buffer, used: int, header: Header, workers: list[int]) -> Buffer:
        """Publish the first ``used`` bytes of ``buffer`` (all of it unless the endpoint has
        ``prefix_publish``) to ``workers``; a worker's first delivery carries the layout. Returns ``buffer``."""
        whole = buffer.tensor.numel()
        # never an empty payload: a 0-byte tensor is a corner no transport needs to handle
        buffer.used = max(used, 1) if used < whole and getattr(self.endpoint, "prefix_publish", False) else whole
        self._publish(buffer, header, workers)
        return buffer

    def _publish(self, buffer: Buffer, header: Header, workers: list[int]) -> None:
        """Publish ``buffer`` under ``header`` to ``workers``; a worker's first delivery carries the layout."""
        known = [w for w in workers if w in self._layout_sent]
        fresh = [w for w in workers if w not in self._layout_sent]
        if known:
            self.endpoint.publish(buffer, header.encode(self.transport.checksum), known)
        if fresh:
            full = dataclasses.replace(header, layout=json.loads(self.layout.to_json()))
            self.endpoint.publish(buffer, full.encode(self.transport.checksum), fresh)
            self._layout_sent.update(fresh)

    def _deliver_full(self, workers: list[int]) -> None:
        """Publish the newest version in full (from the mirror) to ``workers``: a joiner, or a worker
        that refused a delta. A worker that cannot get it now gets a full payload at the next send."""
        mirror = self.mirror
        if not workers or mirror is None or mirror.version != self.version or self.version < 0:
            return
        try:
            buffer = self._acquire(Deadline(_FULL_ACQUIRE_S))
        except WorkerTimeoutError as exc:
            log.warning("workers %s get version %d at the next send: %s", workers, self.version, exc)
            return
        header, used = self._pack_mirror(mirror, buffer.tensor, self.version)
        if buffer.tensor.is_cuda:
            torch.cuda.current_stream(buffer.tensor.device).synchronize()
        self._latest = (self._publish_to(buffer, used, header, workers), header)
        entry = self._pending.get(self.version)
        if entry is not None:  # the version's report counts what these workers got now
            report = entry[0]
            for w in workers:
                if w in report.targets:
                    report.worker_nbytes[w] = self._wire_nbytes(buffer, used)
                    if w in report.delta_workers:
                        report.delta_workers.remove(w)
            report.nbytes = max(report.worker_nbytes.values(), default=0)

    def _record(self, report: SendReport, t0: float) -> None:
        """Make ``report`` the newest send, waited on by its acks; its targets' old rejections go."""
        self._pending[report.version] = (report, t0)
        while len(self._pending) > _MAX_PENDING:
            self._pending.popitem(last=False)
        self.last_report = report
        for w in report.targets:
            self._rejected.pop(w, None)

    def _deliver(self, workers: list[int]) -> None:
        """Publish the latest snapshot to ``workers``; a worker's first delivery carries the layout."""
        if workers and self._latest is None and self.mirror is not None:
            return self._deliver_full(workers)
        if workers and self._latest is not None:  # (a full payload: the latest never has a table)
            self._publish(*self._latest, workers)

    # -- events and acks ------------------------------------------------------------------------
    def _pump(self, deadline: Deadline) -> None:
        """Handle the transport's events, waiting for some until ``deadline``."""
        for event in self.endpoint.poll(deadline):
            self._handle(event)

    def serve_once(self) -> None:
        """Answer the transport without waiting (the service thread, between calls)."""
        if self.connected:
            self._pump(POLL)

    def _handle(self, event: Event) -> None:
        w = event.worker
        if not (isinstance(w, int) and 0 <= w < self.num_workers):
            log.warning("ignoring %s from unknown worker %r (num_workers=%d)", type(event).__name__, w,
                        self.num_workers)
            return
        if isinstance(event, Joined):
            log.info("worker %d joined", w)
            self._joined.add(w)
            self._left.pop(w, None)
            self._acked[w] = -1
            self._holds.pop(w, None)
            self._layout_sent.discard(w)
            self._deliver([w])
        elif isinstance(event, Left):
            log.info("worker %d left: %s", w, event.reason)
            self._joined.discard(w)
            self._holds.pop(w, None)
            self._left[w] = str(event.reason)
        elif isinstance(event, Acked):
            try:
                ack = Ack.decode(event.data, self.transport.checksum)
                if ack.worker != w or ack.version > self.version:
                    raise TransportError(f"ack names worker {ack.worker}, version {ack.version}")
            except TransportError as exc:
                log.warning("worker %d sent a malformed ack: %s", w, exc)
                self._rejected[w] = self._refusals[w] = Ack(w, self.version, f"malformed ack: {exc}", "TransportError")
                return
            if ack.error_type == "BaseMismatch":  # it holds less than a delta needed: send it the newest in full
                log.info("worker %d: %s", w, ack.error)
                self._holds.pop(w, None)
                self._deliver_full([w]) if self.mirror is not None else self._deliver([w])
                return
            if ack.error_type == "UnreadableHeader":  # (naming the version it holds): it fails what was sent to it
                ack = Ack(w, self.version, f"a header it could not read: {ack.error}", "TransportError")
            if ack.error is not None:
                log.warning("worker %d rejected version %d: %s", w, ack.version, ack.error)
                self._rejected[w] = self._refusals[w] = ack
                return
            if ack.version >= 0:
                self._holds[w] = max(self._holds.get(w, -1), ack.version)
            if ack.version > self._acked[w]:
                self._refusals.pop(w, None)
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
                            kind = self._timed.pop(version, None)
                            if kind is not None and self.costs is not None:
                                self.costs.record(kind, report.total_s, report.diff_s)
                            self._notify(report)

    def _notify(self, report: SendReport) -> None:
        """Call the report listeners. An error one raises is kept for the user's call
        (``raise_deferred``): the events polled with the report are still handled, and
        wsync's service thread, which may be the caller, goes on serving."""
        for listener in self.listeners:
            try:
                listener(report)
            except Exception as exc:  # raised from the user's call, not from wsync's thread
                self.defer(exc, "a report listener")

    def defer(self, exc: Exception, who: str) -> None:
        """Keep ``exc`` for the user's next call (``raise_deferred``): raised where the user is not
        (a report listener run by wsync's service thread, or that thread's poll of the transport,
        whose error a transport may give only once). A second one is added to the first as a note."""
        if self._deferred is None:
            self._deferred = exc
        else:
            self._deferred.add_note(f"({who} then raised {exc!r} too)")

    def raise_deferred(self) -> None:
        """Raise the first error kept by ``defer`` since this was last called, if any."""
        exc, self._deferred = self._deferred, None
        if exc is not None:
            raise exc

    def take_turn(self) -> None:
        """Take ``lock`` for a call (the caller releases it); a wait for acks that holds it in another
        thread lets this one in between two of its polls (at most ``_LET_IN_S`` later), not at its end."""
        if self.lock.acquire(blocking=False):  # the common case: no one holds it
            return
        with self._wanting_lock:
            self._wanting += 1
        try:
            self.lock.acquire()
        finally:
            with self._wanting_lock:
                self._wanting -= 1
        self._turn.notify_all()

    def applied(self, version: int, targets: list[int]) -> bool:
        """Whether every one of ``targets`` acked ``version`` or a newer one (from the acks collected)."""
        return all(self._acked[w] >= version for w in targets)

    def outstanding(self, version: int, targets: list[int], deadline: Deadline) -> tuple[list[int], dict[int, Ack]]:
        """Collect events until every target acked ``version`` or failed, or the deadline passes,
        letting threads that wait for the lock in between polls.

        Returns (targets still missing, rejections by worker).
        """
        while True:
            # a rejection of v fails the sends up to v that the worker has not applied: it only
            # ever gets the newest version, so it will not apply those any more
            rejected = {w: a for w in targets
                        if self._acked[w] < version and (a := self._rejected.get(w)) and a.version >= version}
            missing = [w for w in targets if self._acked[w] < version and w not in rejected]
            alive = [w for w in missing if w not in self._left]
            if not alive or deadline.expired():
                return missing, rejected
            if self.closing:
                raise StateError(f"waiting for version {version} was interrupted: shutdown() was called from "
                                 f"another thread; build a new WeightSyncScheme")
            self._pump(Deadline(deadline.slice(_LET_IN_S)))
            if self._wanting:  # a send_async() beside this wait, say: the lock is its until it notifies
                self._turn.wait(_LET_IN_S)

    def finish(self, version: int, targets: list[int], deadline: Deadline) -> None:
        """Wait until every target applied ``version``. Raises the error a worker reported for it,
        or WorkerTimeoutError naming the targets that did not apply it by the deadline, or else the
        error a report listener raised (before the wait, or during it)."""
        self.raise_deferred()
        missing, rejected = self.outstanding(version, targets, deadline)
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
            which = f"version {version}" if ack.version == version else f"version {ack.version} (before applying {version})"
            raise cls(f"worker {w} rejected {which}: {ack.error}{others}")
        if missing:
            gone = [w for w in missing if w in self._left]
            updated = [w for w in targets if w not in missing and w not in rejected]
            why = "".join(f"; worker {w}: {self._left[w][:300]}" for w in gone if self._left[w])
            refused = ""
            for w in missing:  # a worker whose last word was a refusal: say it (it may be why)
                if (before := self._refusals.get(w)) is not None and before.error is not None:  # (a refusal has one)
                    refused += f"; worker {w} last rejected version {before.version}: {before.error[:300]}"
            if gone == missing and not deadline.expired():  # no wait for them: it is not a matter of time
                raise WorkerTimeoutError(f"workers {gone} disconnected before applying version {version}{why}"
                                         f"{refused}; updated: {updated}", missing)
            detail = f"; workers {gone} disconnected{why}" if gone else ""
            raise WorkerTimeoutError(
                f"workers {missing} did not apply version {version} within {deadline.timeout:g} s{detail}{refused}; "
                f"updated: {updated}", missing)
        self.raise_deferred()

    def _watch_connect(self, watch: Callable[[list[int]], Mapping[int, str]], deadline: Deadline) -> None:
        """Wait for version 0's acks in short slices, asking ``watch`` about the missing workers
        between them; raise WorkerDiedError as soon as it names dead ones."""
        targets = list(range(self.num_workers))
        while True:
            missing, rejected = self.outstanding(0, targets, Deadline(deadline.slice(0.1)))
            missing = [w for w in missing if w not in rejected]
            if not missing or deadline.expired():
                return
            named = watch(missing)
            if not isinstance(named, Mapping):
                raise TypeError(f"connect(watch=...): watch returned a {type(named).__name__}; it must return a "
                                f"mapping of the dead workers among those it was given to why (empty if none)")
            dead = {w: why for w, why in named.items() if w in missing}
            if dead:
                detail = "\n".join(f"--- worker {w}: {why}" for w, why in sorted(dead.items()))
                raise WorkerDiedError(f"workers {sorted(dead)} died before applying version 0 "
                                      f"(updated: {[w for w in targets if w not in missing]}):\n{detail}", dead)


def _refuse_meta(tensors: Mapping[str, torch.Tensor], call: str) -> None:
    """Raise ValueError naming the tensors on the meta device: they hold no data to send."""
    meta = meta_keys(tensors)
    if meta:
        raise ValueError(f"{call}: the weights to send are on the meta device and hold no data ({clip_keys(meta)}); "
                         f"materialize them (e.g. module.to_empty(device=...) and load real values) before sending")


def _with_aliases(keys: list[str], tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """``keys`` and every key whose memory overlaps theirs, and so on (a tie, a view, a slice):
    sorted. A worker writes a payload's entries one after another, so an entry left out would
    write its previous bytes over memory a sent one shares."""
    spans: dict[tuple[torch.device, int], list[tuple[str, int, int]]] = {}
    for key, t in tensors.items():
        if t.numel():
            start = cast(int, t.storage_offset()) * t.element_size()  # (a SymInt only while traced)
            reach = sum((n - 1) * abs(step) for n, step in zip(t.shape, t.stride())) + 1
            spans.setdefault((t.device, t.untyped_storage().data_ptr()), []).append(
                (key, start, start + reach * t.element_size()))
    chosen = set(keys)
    for group in spans.values():
        grown = len(group) > 1
        while grown:
            grown = False
            for key, a, b in group:
                if key not in chosen and any(k in chosen and a < y and x < b for k, x, y in group):
                    chosen.add(key)
                    grown = True
    return sorted(chosen)


def _index(value: Any) -> int | None:
    """``value`` as an index (an int, or any integer that says it is one: numpy's, a 0-d torch
    tensor), or None; a bool is not one."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _serve(ref: weakref.ref[Sender], stop: threading.Event) -> None:
    """Between calls, keep answering the transport: late joiners get the latest version and
    acks of asynchronous sends are collected, without waiting for the next send()."""
    last_error = ""
    while not stop.wait(_SERVICE_INTERVAL):
        sender = ref()
        if sender is None:
            return
        if sender.lock.acquire(blocking=False):
            try:
                sender.serve_once()
                last_error = ""
            except WsyncError as exc:  # the next call on the scheme raises it (a transport may say it once)
                if str(exc) != last_error:
                    log.warning("sender service: %s", exc)
                    sender.defer(exc, "the service thread's poll")
                last_error = str(exc)
            finally:
                sender.lock.release()
        del sender
