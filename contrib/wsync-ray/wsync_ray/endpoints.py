"""The ``ray`` transport's two endpoints: the sender puts payloads into Ray's object store and
posts to the mailbox actor; a receiver takes from the mailbox and reads its node's object store.

Every Ray call that can wait is bounded by the caller's deadline (``ray.get`` with a timeout, in
slices so that ``wake`` ends it at once); a long-poll left unanswered at the deadline is kept and
picked up by the next call, so nothing is asked twice and nothing is lost.
"""

from __future__ import annotations

import logging
import math
import pickle
import threading
import time
import uuid
import warnings
from collections.abc import Sequence
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from wsync_core import (
    Acked,
    Buffer,
    Deadline,
    Delivery,
    Joined,
    Left,
    ReceiverContext,
    ReceiverEndpoint,
    SenderContext,
    SenderEndpoint,
    TransportError,
    WorkerTimeoutError,
)
from wsync_core.protocol import MAX_ACK_BYTES, MAX_HEADER_BYTES
from wsync_core.transport import Event, zero_copy_for

from .mailbox import Mailbox
from .plasma import private_map

__all__ = ["RaySender", "RayReceiver", "connect_ray"]

log = logging.getLogger("wsync.ray")

#: longest a mailbox long-poll waits on the actor before answering "nothing yet"
LONG_POLL_S = 5.0
#: longest a wait goes without checking whether the scheme is shutting down (``wake``)
WAKE_SLICE_S = 0.05
#: how long a receive whose deadline has passed still waits for the mailbox to say whether a
#: delivery it answered earlier is still the newest
RECHECK_GRACE_S = 0.05
#: how many events long-polls the sender keeps at the mailbox at once
EVENT_POLLS = 4
_mailbox_class: Any = None


def connect_ray(address: str | None) -> None:
    """Join the Ray cluster at ``address`` ("auto" if None) unless this process already is in one
    (a Ray actor, task or driver). Raises TransportError if it cannot."""
    if ray.is_initialized():
        return
    try:
        ray.init(address=address or "auto", log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, ValueError, RuntimeError, RayError) as exc:
        raise TransportError(f"cannot join the Ray cluster at {address or 'auto'!r}: {exc}") from exc


def _mailbox() -> Any:
    global _mailbox_class
    if _mailbox_class is None:
        _mailbox_class = ray.remote(num_cpus=0, max_concurrency=10_000)(Mailbox)
    return _mailbox_class


def _timeout(deadline: Deadline) -> float | None:
    left = deadline.remaining()
    return None if math.isinf(left) else left


class _Woken(Exception):
    """The scheme is shutting down: the wait gives up at once."""


def _get(ref: Any, deadline: Deadline, woken: threading.Event) -> Any:
    """``ray.get(ref)`` by ``deadline``, in slices of ``WAKE_SLICE_S`` so that ``woken`` ends the
    wait at once. Raises GetTimeoutError at the deadline, _Woken once woken, RayError as Ray does."""
    while True:
        if woken.is_set():
            raise _Woken
        try:
            return ray.get(ref, timeout=deadline.slice(WAKE_SLICE_S))
        except GetTimeoutError:
            if deadline.expired():
                raise


def _wait_any(refs: list[Any], deadline: Deadline, woken: threading.Event) -> list[Any]:
    """Those of ``refs`` that are ready, waiting for one by ``deadline``, in slices of
    ``WAKE_SLICE_S`` so that ``woken`` ends the wait at once. Raises GetTimeoutError at the
    deadline, _Woken once woken."""
    while True:
        if woken.is_set():
            raise _Woken
        done, _ = ray.wait(refs, num_returns=1, timeout=deadline.slice(WAKE_SLICE_S), fetch_local=True)
        if done:
            more, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            return more or done
        if deadline.expired():
            raise GetTimeoutError("nothing came by the deadline")


def _ray_failed(what: str, exc: BaseException) -> TransportError:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return TransportError(f"{what}: {type(exc).__name__}: {first}")


class RaySender(SenderEndpoint):
    """Two staging buffers; each new snapshot goes into the object store once, its reference to
    the mailbox with the header for the listed workers."""

    def __init__(self, options: dict[str, Any], ctx: SenderContext) -> None:
        self.channel, self.namespace, self.address = options["channel"], options["namespace"], options["address"]
        self.nbytes = ctx.layout.nbytes
        self.slots: list[Buffer] = []
        self.refs: dict[int, Any] = {}  # slot -> object reference holding its bytes
        self.latest = -1  # the slot published last
        self.seq = 0
        self.mailbox: Any = None
        self.pending_events: list[tuple[int, Any]] = []  # events long-polls waiting: (event awaited, ref)
        self.seen = -1  # the number of the last event handed on
        self.posts: list[Any] = []
        self.woken = threading.Event()

    def open(self, deadline: Deadline) -> None:
        connect_ray(self.address)
        try:
            # on the sender's own node: a mailbox on a worker's node would take every worker down
            # with that node (a cut link, a preempted host)
            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            self.mailbox = _mailbox().options(name=self.channel, namespace=self.namespace, max_restarts=0,
                                              scheduling_strategy=here).remote()
        except ValueError as exc:
            raise TransportError(f"ray channel {self.channel!r} (namespace {self.namespace!r}) already has a "
                                 f"sender: {exc}") from exc
        self.slots = [Buffer(torch.empty(self.nbytes, dtype=torch.uint8), i) for i in range(2)]

    def acquire(self, deadline: Deadline) -> Buffer:
        slot = 1 if self.latest == 0 else 0  # never the buffer published last
        self.refs.pop(slot, None)  # the store frees that version once no mailbox or receiver holds it
        return self.slots[slot]

    def publish(self, buffer: Buffer, header: bytes, workers: Sequence[int]) -> None:
        if len(header) > MAX_HEADER_BYTES:
            raise TransportError(f"header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
        slot = buffer.index  # 0 or 1: which of self.slots
        ref = self.refs.get(slot)
        if ref is None:
            data = buffer.tensor.detach().cpu().contiguous()
            try:
                ref = ray.put(pickle.PickleBuffer(data.numpy()))  # raw bytes, out of band: one copy into the store
            except RayError as exc:
                raise _ray_failed("putting the payload into Ray's object store failed", exc) from exc
        # only the newest version may be published again (to a worker that joins): the sender lets
        # go of older ones, which leave the store once the mailbox and the receivers let go too
        self.refs = {slot: ref}
        self.latest = slot
        self.seq += 1
        self.posts.append(self.mailbox.post.remote(self.seq, list(workers), bytes(header), [ref]))

    def _check_posts(self) -> None:
        if not self.posts:
            return
        done, self.posts = ray.wait(self.posts, num_returns=len(self.posts), timeout=0)
        try:
            ray.get(done)
        except RayError as exc:
            raise _ray_failed(f"the mailbox actor {self.channel!r} failed", exc) from exc

    def poll(self, deadline: Deadline) -> list[Event]:
        while True:
            self._check_posts()
            # EVENT_POLLS long-polls wait at the mailbox, for the next EVENT_POLLS events, so each new
            # event answers one at once (none waits for the sender's next call to arrive); events
            # are numbered, so each is handed on once and in order whichever answer brings it
            waiting = {need for need, _ in self.pending_events}
            for need in range(self.seen + 1, self.seen + 1 + EVENT_POLLS):
                if need not in waiting:
                    self.pending_events.append((need, self.mailbox.events.remote(self.seen, need, LONG_POLL_S)))
            try:
                done = _wait_any([ref for _, ref in self.pending_events], deadline, self.woken)
                self.pending_events = [(n, r) for n, r in self.pending_events if r not in done]
                replies = ray.get(done)
            except (GetTimeoutError, _Woken):
                return []
            except RayError as exc:
                self.pending_events = []
                raise _ray_failed(f"the mailbox actor {self.channel!r} failed", exc) from exc
            numbered = sorted({item[0]: item[1] for reply in replies if isinstance(reply, list) for item in reply
                               if isinstance(item, list) and len(item) == 2 and isinstance(item[0], int)
                               and item[0] > self.seen}.items())
            events: list[Event] = []
            for n, item in numbered:
                if n != self.seen + 1:  # a gap: the next answer brings it, with what follows
                    break
                self.seen = n
                if (event := _event(item)) is not None:
                    events.append(event)
            if events or deadline.expired():
                return events

    def wake(self) -> None:
        self.woken.set()

    def close(self) -> None:
        mailbox, self.mailbox = self.mailbox, None
        self.refs.clear()
        self.slots, self.posts, self.pending_events = [], [], []
        if mailbox is None:
            return
        try:  # waiting receivers hear that the sender is gone, then the actor goes
            ray.get(mailbox.close.remote(), timeout=10)
        except (RayError, GetTimeoutError) as exc:
            log.debug("ray channel %s: mailbox close failed: %s", self.channel, exc)
        try:
            ray.kill(mailbox, no_restart=True)
        except RayError as exc:
            log.debug("ray channel %s: mailbox kill failed: %s", self.channel, exc)
            return
        end = time.monotonic() + 10.0  # the channel is free again once its name is: a new sender may open
        while time.monotonic() < end:
            try:
                ray.get_actor(self.channel, namespace=self.namespace)
            except ValueError:
                return
            time.sleep(0.02)
        log.warning("ray channel %s: the mailbox's name is still taken 10 s after shutdown", self.channel)


def _event(item: Any) -> Event | None:
    """One mailbox event as a wsync Event; None (logged) for anything malformed."""
    if isinstance(item, list) and len(item) >= 2 and isinstance(item[1], int) and not isinstance(item[1], bool):
        kind, worker = item[0], item[1]
        if kind == "join" and len(item) == 2:
            return Joined(worker)
        if kind == "ack" and len(item) == 3 and isinstance(item[2], bytes) and len(item[2]) <= MAX_ACK_BYTES:
            return Acked(worker, item[2])
        if kind == "left" and len(item) == 3 and isinstance(item[2], str):
            return Left(worker, item[2])
    log.warning("ray transport: ignoring a malformed mailbox event %.200r", item)
    return None


def _payload(value: Any) -> torch.Tensor:
    """A uint8 tensor viewing ``value`` (a read-only buffer in the object store) without copying."""
    view = memoryview(value).cast("B")
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # read-only on purpose: the core only reads a non-adoptable payload
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8)


class RayReceiver(ReceiverEndpoint):
    """Takes its newest delivery from the mailbox (a long-poll) and hands the core the payload in
    this node's object store: a private copy-on-write mapping of it the core may adopt (zero-copy,
    where this process may map it), else a read-only view the core copies from. Either is released
    (and so freeable) once no tensor views it."""

    def __init__(self, options: dict[str, Any], ctx: ReceiverContext) -> None:
        self.channel, self.namespace, self.address = options["channel"], options["namespace"], options["address"]
        self.worker = ctx.worker_idx
        self.token = uuid.uuid4().hex
        self.mailbox: Any = None
        self.pending: Any = None  # a take not yet answered
        self.candidate: tuple[bytes, Any] | None = None  # a possibly stale delivery, kept until none is newer
        self.fetching: tuple[bytes, Any] | None = None  # a delivery whose payload is not local yet
        self.zero_copy = zero_copy_for(options.get("zero_copy"), ctx)
        self.delivered = False  # the last recv returned a delivery
        self.woken = threading.Event()

    def open(self, deadline: Deadline) -> None:
        connect_ray(self.address)
        delay = 0.01
        while True:
            try:
                mailbox = ray.get_actor(self.channel, namespace=self.namespace)
                break
            except ValueError:
                if deadline.expired():
                    raise WorkerTimeoutError(f"no ray sender on channel {self.channel!r} (namespace "
                                             f"{self.namespace!r}) by the deadline", [self.worker]) from None
                time.sleep(deadline.slice(delay))
                delay = min(2 * delay, 0.2)
        context = ray.get_runtime_context()
        # how the mailbox sees this process die: through its actor, else its Ray worker's record
        watch = ["actor", context.current_actor] if context.get_actor_id() is not None else \
            ["worker", context.get_worker_id()]
        hello = mailbox.hello.remote(self.worker, self.token, watch)
        try:
            ready, _ = ray.wait([hello], timeout=_timeout(deadline))
            if not ready:
                raise WorkerTimeoutError(f"the ray sender on channel {self.channel!r} did not answer by the deadline",
                                         [self.worker])
            if not ray.get(hello):
                raise TransportError(f"the ray sender on channel {self.channel!r} has shut down")
        except RayError as exc:
            raise _ray_failed(f"saying hello to the ray sender on channel {self.channel!r} failed", exc) from exc
        self.mailbox = mailbox

    def recv(self, deadline: Deadline) -> Delivery | None:
        if self.woken.is_set():
            return None
        if self.delivered and deadline.expired():
            # the core's "anything newer?" right after a delivery: the mailbox keeps only the newest
            # per worker and that was just taken, so do not wait for its answer. The long-poll is
            # re-armed by the ack that follows (one call for both), or by the next recv
            self.delivered = False
            return None
        self.delivered = False
        # a take answered before this call began may be stale: the worker was not reading while
        # newer versions replaced it in the mailbox. Such a delivery is only a candidate until a
        # take that does not wait says nothing newer is there (the newest wins, never a queued one)
        suspect = self.pending is not None and bool(ray.wait([self.pending], timeout=0, fetch_local=False)[0])
        while True:
            if self.fetching is not None:
                header, ref = self.fetching
                try:  # a local object at once; another node's is pulled here first
                    value = _get(ref, deadline, self.woken)
                except (GetTimeoutError, _Woken):
                    return None
                except RayError as exc:
                    self.fetching = None
                    raise _ray_failed(f"worker {self.worker}: reading the payload from Ray's object store failed",
                                      exc) from exc
                self.fetching = None
                self.delivered = True
                return self._delivery(header, ref, value)
            if self.pending is None:
                self.pending = self.mailbox.take.remote(self.worker, self.token,
                                                        0.0 if self.candidate is not None else LONG_POLL_S)
            rechecking = self.candidate is not None
            try:  # a recheck may overrun a short deadline by RECHECK_GRACE_S: it is one quick call
                reply = _get(self.pending, Deadline(max(deadline.remaining(), RECHECK_GRACE_S)) if rechecking
                             else deadline, self.woken)
            except _Woken:
                return None
            except GetTimeoutError:
                if not rechecking:
                    return None
                # no answer in time: the candidate is the newest this receiver knows of; the recheck
                # stays pending and is looked at by the next call
                self.fetching, self.candidate = self.candidate, None
                continue
            except RayActorError as exc:
                self.pending = None
                raise _ray_failed(f"worker {self.worker}: the ray sender on channel {self.channel!r} is gone",
                                  exc) from exc
            except RayError as exc:
                self.pending = None
                raise _ray_failed(f"worker {self.worker}: taking from the mailbox failed", exc) from exc
            self.pending = None
            kind = reply[0] if isinstance(reply, list) and reply else None
            if kind == "none":
                if self.candidate is not None:  # nothing newer than the candidate: it is the newest
                    self.fetching, self.candidate = self.candidate, None
                elif deadline.expired():
                    return None
            elif kind == "data" and len(reply) == 4 and isinstance(reply[2], bytes) and isinstance(reply[3], list) \
                    and len(reply[3]) == 1 and isinstance(reply[3][0], ray.ObjectRef):
                if len(reply[2]) > MAX_HEADER_BYTES:
                    raise TransportError(f"worker {self.worker}: a header of {len(reply[2])} bytes exceeds "
                                         f"{MAX_HEADER_BYTES}")
                if suspect:  # ask once for anything newer; this one is dropped if there is
                    suspect, self.candidate = False, (reply[2], reply[3][0])
                else:
                    self.fetching, self.candidate = (reply[2], reply[3][0]), None
            elif kind == "closed":
                raise TransportError(f"worker {self.worker}: the ray sender on channel {self.channel!r} shut down")
            elif kind == "gone":
                raise TransportError(f"worker {self.worker}: another receiver now serves this worker on channel "
                                     f"{self.channel!r}")
            else:
                raise TransportError(f"worker {self.worker}: malformed mailbox reply {reply!r:.200}")

    def _delivery(self, header: bytes, ref: Any, value: Any) -> Delivery:
        if self.zero_copy:
            mapped = private_map(value)
            if mapped is not None:  # the receiver's own copy-on-write memory: the core may adopt it
                tensor, region = mapped
                kept = [ref, value, region]

                def release_mapped() -> None:
                    kept.clear()  # the mapping goes with the last view of it, then Ray may free the object

                return Delivery(header, tensor, release_mapped, adoptable=True)
        payload = _payload(value)
        held = [ref, value]

        def release() -> None:
            held.clear()  # drops this process's reference: the object is freed once nobody holds it

        return Delivery(header, payload, release)

    def wake(self) -> None:
        self.woken.set()

    def ack(self, data: bytes) -> None:
        if len(data) > MAX_ACK_BYTES:
            raise TransportError(f"ack of {len(data)} bytes exceeds {MAX_ACK_BYTES}")
        if self.pending is None:  # the ack also re-arms the long-poll: what arrives next is here sooner
            self.pending = self.mailbox.ack.remote(self.worker, self.token, bytes(data), LONG_POLL_S)
        else:
            self.mailbox.ack.remote(self.worker, self.token, bytes(data))

    def close(self) -> None:
        mailbox, self.mailbox = self.mailbox, None
        self.pending = self.fetching = self.candidate = None
        if mailbox is None:
            return
        try:  # after this worker's acks (Ray runs one caller's calls in order): the sender reads them first
            ray.get(mailbox.bye.remote(self.worker, self.token), timeout=5)
        except (RayError, GetTimeoutError) as exc:
            log.debug("ray channel %s: bye from worker %d failed: %s", self.channel, self.worker, exc)
