"""``WeightSyncScheme``: what users call, on the trainer (sender) and on each worker (receiver).

States and the calls that move between them (any other call raises StateError)::

    NEW --init_on_sender--> SENDER --connect--> SENDER_CONNECTED --send/send_async--> (same)
    NEW --init_on_receiver--> RECEIVER --connect--> RECEIVER_CONNECTED --receive--> (same)
    any --shutdown--> CLOSED

This module is the facade: configuration, pickling, the state machine, the lock, fork. The
work of each role is in ``sender.Sender`` and ``receiver.Receiver``; the transport only moves
bytes (see ``wsync_core.transport``).
"""

from __future__ import annotations

import contextlib
import enum
import operator
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypedDict

import torch

from . import forked
from .deadline import Deadline
from .delta import check_wire_dtype
from .errors import StateError
from .receiver import Receiver
from .registry import resolve_transport
from .report import SendReport
from .sender import Sender, SendHandle
from .transport import Transport, flag
from .weights import Strategy, Weights, check_strategy

__all__ = ["WeightSyncScheme", "SendHandle"]


class _State(enum.Enum):
    NEW = "new"
    SENDER = "initialized as sender"
    SENDER_CONNECTED = "connected sender"
    RECEIVER = "initialized as receiver"
    RECEIVER_CONNECTED = "connected receiver"
    CLOSED = "shut down"


class _Config(TypedDict):
    """A scheme's configuration: what it pickles (beside its transport)."""

    strategy: Strategy
    sync: bool
    timeout: float
    model_id: str | None
    origin: str | None
    delta: bool | str
    delta_bases: int
    delta_dense: float | None
    wire_dtype: str | None


class WeightSyncScheme:
    """Keeps one model's weights in sync between a trainer and ``num_workers`` workers.

    ``transport`` is an entry-point name (see ``list_transports()``) or a Transport object;
    ``options`` go to the transport. ``timeout`` (seconds) bounds every blocking call unless the
    call says otherwise; ``math.inf`` waits forever.

    Sending less (docs/api.md): ``delta=True`` sends each worker only the elements that changed
    since the version it holds (values, compared bit for bit), or a full payload when that is
    cheaper or its version is unknown or older than the last ``delta_bases`` versions; the
    sender then keeps one copy of the model (in the wire dtype) and the changed indices of the
    last ``delta_bases`` versions. ``delta_dense``: a delta over this share of a full payload
    goes full (default 0.5; 0.1 on zero-copy transports). On a zero-copy transport (shm, mp,
    inproc: a full send is one copy, while the comparison reads the model twice) whether diffing
    pays is measured for a model of 16 MiB or more: after a whole-model delta whose comparison
    took 5 ms or more, one send goes full without a comparison (the probe, timed to its last
    ack; the copy stays the base of later deltas); if 1.2 times the probe's time is below the
    fastest delta send, every later send is a full one (no comparison; the copy is freed).
    ``delta="always"``: deltas every time, for the fewest bytes. ``wire_dtype`` (torch.bfloat16,
    torch.float16 or torch.float32): floating tensors wider than it travel in it and arrive as
    ``x.to(wire_dtype).to(model_dtype)``; the others travel as they are.
    """

    def __init__(
        self,
        transport: str | Transport = "inproc",
        *,
        strategy: str = "tensordict",
        sync: bool = True,
        timeout: float = 60.0,
        delta: bool | str = False,
        delta_bases: int = 2,
        delta_dense: float | None = None,
        wire_dtype: torch.dtype | None = None,
        **options: Any,
    ) -> None:
        Deadline(timeout)  # validates
        if not (isinstance(delta, bool) or delta == "always"):  # (1 == True: a number is refused, as for sync)
            raise ValueError(f"delta must be True, False or 'always', got {delta!r}")
        if isinstance(delta_bases, bool) or not isinstance(delta_bases, int) or delta_bases < 1:
            raise ValueError(f"delta_bases must be an int >= 1, got {delta_bases!r}")
        if delta_dense is not None and (isinstance(delta_dense, bool) or not isinstance(delta_dense, (int, float))
                                        or not 0 <= delta_dense <= 1):
            raise ValueError(f"delta_dense must be a number in [0, 1] or None, got {delta_dense!r}")
        wire = check_wire_dtype(wire_dtype)
        self._transport: Transport = resolve_transport(transport, options)
        self._config: _Config = {"strategy": check_strategy(strategy), "sync": flag("sync", sync),
                        "timeout": float(timeout), "model_id": None, "origin": None,
                        "delta": delta,
                        "delta_bases": delta_bases, "delta_dense": delta_dense, "wire_dtype": wire}
        self._reset()

    # -- configuration and pickling -------------------------------------------------------------
    def _reset(self) -> None:
        self._pid = forked.pid()
        self._lock = threading.RLock()
        self._state = _State.NEW
        self._role: Sender | Receiver | None = None
        self._finalizer: weakref.finalize | None = None
        self._last_version = -1  # the role's, once shut down

    def __getstate__(self) -> dict[str, Any]:
        return {"transport": self._transport, "config": dict(self._config)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._transport = state["transport"]
        self._config = state["config"]
        self._reset()

    @property
    def transport(self) -> Transport:
        """The Transport object this scheme moves weights with."""
        return self._transport

    @property
    def strategy(self) -> Strategy:
        """How the model's tensors are read: "tensordict" or "state_dict"."""
        return self._config["strategy"]

    @property
    def sync(self) -> bool:
        """Whether ``send()`` waits for every target's ack."""
        return self._config["sync"]

    @property
    def timeout(self) -> float:
        """Seconds ``connect()``, ``send()`` and ``wait()`` take unless given their own."""
        return self._config["timeout"]

    @property
    def model_id(self) -> str:
        """The name both sides give the model; a payload for another is refused."""
        return self._role.model_id if self._role is not None else self._config["model_id"] or "policy"

    @property
    def version(self) -> int:
        """Sender: the last version sent (0 after connect). Receiver: the last version applied
        (the one its model keeps after ``shutdown()``). -1 before connect."""
        return self._role.version if self._role is not None else self._last_version

    @property
    def delta(self) -> bool | str:
        """True, False or "always" (see the class docstring)."""
        return self._config.get("delta", False)

    @property
    def wire_dtype(self) -> torch.dtype | None:
        """The dtype floating tensors travel in, or None for the model's own."""
        from .delta import WIRE_DTYPES

        wire = self._config.get("wire_dtype")
        return None if wire is None else WIRE_DTYPES[wire]

    @property
    def versions_behind(self) -> int:
        """Receiver: how many versions the newest one announced to this worker (as of its last
        receive) is ahead of the one it holds; 0 when up to date (and on a sender)."""
        return self._role.versions_behind if isinstance(self._role, Receiver) else 0

    @property
    def worker_idx(self) -> int | None:
        """Receiver: this worker's index; None on a sender or before init_on_receiver()."""
        return self._role.worker_idx if isinstance(self._role, Receiver) else None

    @property
    def last_report(self) -> SendReport | None:
        """Sender: the report of the last send (bytes, snapshot time, per-worker ack latency)."""
        return self._role.last_report if isinstance(self._role, Sender) else None

    @property
    def state(self) -> str:
        """Where the scheme is: "new", "initialized as sender", "connected sender", "initialized as
        receiver", "connected receiver" or "shut down"."""
        return self._state.value

    def __repr__(self) -> str:
        return f"WeightSyncScheme({self._transport!r}, state={self._state.value!r}, version={self.version})"

    # -- helpers ----------------------------------------------------------------------------
    def _deadline(self, timeout: float | None) -> Deadline:
        return Deadline(self.timeout if timeout is None else timeout)

    def _adopt_fork(self) -> None:
        """In a child made by fork, this object is the parent's: start over as a fresh copy (like
        an unpickled one), leaving the parent's endpoint, threads and buffers alone."""
        if self._pid != forked.pid():
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
        if hint is None and self._state is _State.NEW:
            hint = "call init_on_sender() (the trainer) or init_on_receiver() (a worker) first"
        raise StateError(f"{call}() needs {need}, but this scheme is {self._state.value}"
                         + (f"; {hint}" if hint else ""))

    def _opened(self, role: Sender | Receiver) -> None:
        """Once the role's endpoint is open: close it when this scheme is collected unshut."""
        if self._finalizer is None:
            self._finalizer = weakref.finalize(self, _close, role, self._pid)

    def _sender(self) -> Sender:
        """The role, in a state that has a Sender (``_expect`` said so)."""
        role = self._role
        assert isinstance(role, Sender)
        return role

    def _receiver(self) -> Receiver:
        """The role, in a state that has a Receiver (``_expect`` said so)."""
        role = self._role
        assert isinstance(role, Receiver)
        return role

    def add_report_listener(self, listener: Callable[[SendReport], None]) -> None:
        """Call ``listener(report)`` when a send completes or fails (sender side; not pickled).
        Raises TypeError if ``listener`` is not callable."""
        _check_callable(listener, "add_report_listener", "a function of one SendReport")
        with self._lock:
            if not isinstance(self._role, Sender):
                self._expect(_State.SENDER, "add_report_listener")
            self._sender().listeners.append(listener)

    def add_apply_listener(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(version)`` each time this receiver applied a version (the initial one
        at connect included), from the thread that applied it, before its ack (a sync send()
        returns after every worker's listeners ran); an error it raises comes out of the call
        that applied, the ack is sent anyway. Not pickled. Raises TypeError if ``listener`` is not
        callable."""
        _check_callable(listener, "add_apply_listener", "a function of one version number")
        with self._lock:
            if not isinstance(self._role, Receiver):
                self._expect(_State.RECEIVER, "add_apply_listener")
            self._receiver().apply_listeners.append(listener)

    def set_apply_guard(self, guard: Callable[[], contextlib.AbstractContextManager[Any]]) -> None:
        """Receiver: enter ``guard()`` around every change to the model's tensors, so a version is
        applied only at the worker's safe point (e.g. a lock its step loop holds while it uses
        the model). Not pickled; default: no guard. If entering it raises, the receive raises that
        error and the next one applies the version. Raises TypeError if ``guard`` is not callable
        (a lock itself: pass ``lambda: lock``)."""
        _check_callable(guard, "set_apply_guard", "a function that returns a context manager, e.g. lambda: lock")
        with self._lock:
            if not isinstance(self._role, Receiver):
                self._expect(_State.RECEIVER, "set_apply_guard")
            self._receiver().guard = guard

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
        scheme was already initialized, ValueError/TypeError for bad arguments (weights on the
        meta device among them).
        """
        self._adopt_fork()
        with self._lock:
            self._expect(_State.NEW, "init_on_sender")
            if (model is None) == (weights is None):
                raise ValueError("init_on_sender() needs exactly one of model= or weights=")
            _check_model_id(model_id, "init_on_sender()")
            self._role = Sender(self._transport, model if model is not None else weights, num_workers=num_workers,
                                model_id=model_id, strategy=self.strategy, lock=self._lock,
                                delta=self._config.get("delta", False), delta_bases=self._config.get("delta_bases", 2),
                                wire_dtype=self._config.get("wire_dtype"), delta_dense=self._config.get("delta_dense"),
                                origin=self._config.get("origin"))
            self._config["model_id"] = model_id
            # what every copy pickled from here carries: their receivers take only versions whose session
            # begins with it (this sender's, or one of a copy of this scheme's) before their first one
            self._config["origin"] = self._role.origin
            self._state = _State.SENDER

    def send(self, weights: Weights | None = None, worker_ids: Iterable[int] | None = None,
             timeout: float | None = None, *, keys: Iterable[str] | None = None) -> int:
        """Snapshot ``weights`` (default: the model given to init_on_sender) and send it.

        With ``keys``, the new version is the previous one with only those tensors taken from
        ``weights`` (e.g. an adapter), applied atomically like any version; ValueError for an
        unknown key. Returns the new version. With ``sync=True`` it returns once every target applied it;
        raises WorkerTimeoutError naming the targets that did not (the others are updated).
        Raises SchemaMismatchError if ``weights`` does not match, before anything is sent.
        """
        deadline = self._deadline(timeout)  # one deadline for the snapshot and the acks
        handle = self._send_async(weights, worker_ids, deadline, keys, "send")
        if self.sync:
            self._take_turn()
            try:
                self._expect(_State.SENDER_CONNECTED, "send")
                self._sender().finish(handle.version, handle.targets, deadline)
            finally:
                self._lock.release()
        return handle.version

    def send_async(self, weights: Weights | None = None, worker_ids: Iterable[int] | None = None,
                   timeout: float | None = None, *, keys: Iterable[str] | None = None) -> SendHandle:
        """Snapshot and send like ``send``, but return at once with a handle to ``wait`` on."""
        return self._send_async(weights, worker_ids, self._deadline(timeout), keys, "send_async")

    def _send_async(self, weights: Weights | None, worker_ids: Iterable[int] | None, deadline: Deadline,
                    keys: Iterable[str] | None, call: str) -> SendHandle:
        self._adopt_fork()
        self._take_turn()
        try:
            self._expect(_State.SENDER_CONNECTED, call)
            return self._sender().send_async(weights, worker_ids, deadline, self._wait, keys)
        finally:
            self._lock.release()

    def _wait(self, handle: SendHandle, timeout: float | None) -> None:
        self._take_turn()
        try:
            self._expect(_State.SENDER_CONNECTED, "wait")
            self._sender().finish(handle.version, handle.targets, self._deadline(timeout))
        finally:
            self._lock.release()

    def _take_turn(self) -> None:
        """Take the lock for a sender's call (the caller releases it): one waiting for acks in
        another thread lets it in between its polls (``Sender.take_turn``)."""
        role = self._role
        if isinstance(role, Sender):
            role.take_turn()
        else:
            self._lock.acquire()

    # -- receiver ----------------------------------------------------------------------------
    def init_on_receiver(self, *, model: Weights, worker_idx: int, model_id: str | None = None) -> None:
        """Make this scheme worker ``worker_idx``'s receiver into ``model`` (updated in place).

        Raises StateError if the scheme was already initialized, ValueError/TypeError for bad
        arguments.
        """
        self._adopt_fork()
        with self._lock:
            self._expect(_State.NEW, "init_on_receiver")
            if model_id is not None:
                _check_model_id(model_id, "init_on_receiver()")
            self._role = Receiver(self._transport, model, worker_idx=worker_idx,
                                  model_id=self.model_id if model_id is None else model_id, strategy=self.strategy,
                                  lock=self._lock,
                                  origin=self._config.get("origin"))
            self._state = _State.RECEIVER

    def receive(self, timeout: float = 0.0) -> int | None:
        """Apply the newest version that arrived, waiting up to ``timeout`` seconds for one.

        Returns the version applied, or None if nothing new came. A damaged or mismatched
        payload raises TransportError or SchemaMismatchError and leaves the model untouched.
        If ``shutdown()`` is called from another thread meanwhile, the wait ends at once and
        this raises StateError (like any call on a scheme that was shut down).
        """
        self._adopt_fork()
        deadline, role = Deadline(timeout), self._role
        if not isinstance(role, Receiver):
            self._lock.acquire()  # (to say, under it, that this is no connected receiver)
        elif not role.take_lock(deadline):  # another thread's receive() outlasted the timeout, or it waits
            return None                     # for the apply guard with a newer version (this thread may hold it)
        try:
            self._expect(_State.RECEIVER_CONNECTED, "receive")
            receiver = self._receiver()
            version = receiver.receive(deadline)
            if version is None:
                receiver.check_closing("receive()")
            return version
        finally:
            self._lock.release()

    def wait_for_version(self, version: int, timeout: float | None = None) -> int:
        """Block until this receiver holds ``version`` or a newer one, applying versions as they
        arrive; returns the version held (another thread's receive() counts too).

        Raises WorkerTimeoutError (naming this worker) if it does not by the timeout (the
        scheme's by default), or what receive() raises for a bad payload; TypeError if
        ``version`` is not an int.
        """
        if isinstance(version, bool) or not hasattr(version, "__index__"):
            raise TypeError(f"wait_for_version() takes a version number (an int), got {version!r}")
        version = operator.index(version)
        self._adopt_fork()
        receiver = self._role
        if not isinstance(receiver, Receiver) or self._state is not _State.RECEIVER_CONNECTED:
            with self._lock:  # (checked again under the lock each time it is taken)
                self._expect(_State.RECEIVER_CONNECTED, "wait_for_version")
                receiver = self._receiver()
        return receiver.wait_for_version(version, self._deadline(timeout),
                                         lambda: self._expect(_State.RECEIVER_CONNECTED, "wait_for_version"))

    def rebind(self, model: Weights) -> None:
        """Receiver: apply future versions to ``model`` (same layout) instead of the model given
        to init_on_receiver(), e.g. a copy moved to another device; once connected, the version
        held is copied into it first. Raises SchemaMismatchError if its layout differs."""
        self._adopt_fork()
        with self._lock:
            if self._state not in (_State.RECEIVER, _State.RECEIVER_CONNECTED):
                self._expect(_State.RECEIVER, "rebind")
            self._receiver().rebind(model, connected=self._state is _State.RECEIVER_CONNECTED)

    # -- both --------------------------------------------------------------------------------
    def connect(self, timeout: float | None = None, *,
                watch: Callable[[list[int]], Mapping[int, str]] | None = None) -> None:
        """Sender: publish version 0 and wait until every worker holds it. Receiver: wait for
        the current version and apply it.

        ``watch`` (sender only) is called every 0.1 s with the workers that have not applied
        version 0 yet, and returns ``{worker: why}`` for those known to be dead (e.g. their
        process exited, with its error); connect then raises WorkerDiedError at once, naming
        them and quoting ``why``, instead of waiting out the timeout.

        Raises WorkerTimeoutError on expiry (a sender stays connected and usable for the
        workers that answered), SchemaMismatchError if the two sides' weights differ.
        """
        self._adopt_fork()
        with self._lock:
            deadline = self._deadline(timeout)
            if watch is not None and self._state is not _State.SENDER:
                raise ValueError("connect(watch=...) is for a sender; receivers have no workers to watch")
            if watch is not None:
                _check_callable(watch, "connect", "as watch= a function of the missing workers' indices that "
                                                  "returns {worker: why} for the dead ones")
            if self._state is _State.SENDER:
                sender = self._sender()
                sender.open(deadline)
                self._opened(sender)
                self._state = _State.SENDER_CONNECTED  # usable for the workers that answer, whatever follows
                sender.start(deadline, watch)
            elif self._state is _State.RECEIVER:
                receiver = self._receiver()
                receiver.open(deadline)
                self._opened(receiver)
                try:
                    receiver.connect(deadline)
                finally:
                    if receiver.version >= 0:  # a version applied and acked: connected, whatever came after
                        self._state = _State.RECEIVER_CONNECTED  # (an apply listener's error, raised here)
            else:
                self._expect(_State.RECEIVER if self.worker_idx is not None else _State.SENDER, "connect")

    def shutdown(self) -> None:
        """Free every resource this scheme holds. Idempotent; the scheme is unusable afterwards.

        Safe to call from another thread: a ``receive()``, receiver ``connect()``, ``send()`` or
        handle ``wait()`` waiting there ends at once with StateError, then the resources are freed.
        """
        self._adopt_fork()
        role = self._role
        if role is not None:
            role.closing = True
            role.endpoint.wake()  # before taking the lock, which a waiting receive() holds
            if isinstance(role, Sender):
                role.stop()
        self._adopt_fork()
        while not self._lock.acquire(timeout=0.05):
            if isinstance(role, Receiver) and role.hand_over(self._close):
                return  # a receive() in another thread waits for the apply guard, this thread's maybe: it closes
        try:
            self._close()
        finally:
            self._lock.release()

    def _close(self) -> None:
        """The rest of shutdown(): free what the role holds; the scheme is closed."""
        with self._lock:
            role = self._role
            if role is not None:
                role.layout.drop_views()
                if self._finalizer is not None:
                    self._finalizer()
                else:
                    role.endpoint.close()
                self._last_version = role.version
            self._role = None
            self._state = _State.CLOSED


#: the longest model_id a header carries
_MAX_MODEL_ID = 256


def _check_model_id(model_id: Any, call: str) -> None:
    """Raise TypeError unless ``model_id`` is a string, ValueError unless it has 1 to 256
    characters: every header carries it, and a receiver compares it with its own."""
    if not isinstance(model_id, str):
        raise TypeError(f"{call}: model_id must be a str, got {type(model_id).__name__} {model_id!r:.60}")
    if not 0 < len(model_id) <= _MAX_MODEL_ID:
        raise ValueError(f"{call}: model_id must have 1 to {_MAX_MODEL_ID} characters, got {model_id!r:.60}")


def _check_callable(value: Any, call: str, want: str) -> None:
    """Raise TypeError naming ``call`` unless ``value`` is callable (``want`` says what it takes)."""
    if not callable(value):
        raise TypeError(f"{call}() takes {want}; got a {type(value).__name__}, which is not callable")


def _close(role: Sender | Receiver, pid: int) -> None:
    """Close a role's endpoint once no one uses it (the scheme was shut down or collected). A
    forked child never closes its parent's endpoint."""
    if forked.pid() == pid:
        role.close()
