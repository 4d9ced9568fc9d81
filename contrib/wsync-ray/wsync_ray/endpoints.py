"""The ``ray`` transport's two endpoints: the sender puts payloads into Ray's object store and
posts to the mailbox actor; a receiver takes from the mailbox and reads its node's object store.

Every Ray call that can wait is bounded by the caller's deadline (``ray.get`` with a timeout, in
slices so that ``wake`` ends it at once); a long-poll left unanswered at the deadline is kept and
picked up by the next call, so nothing is asked twice and nothing is lost.
"""

from __future__ import annotations

import logging
import pickle
import queue
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
from wsync_core.transport import Event, claim_refusal, index_refusal, origin_refusal, zero_copy_for

from .acks import AckFrame, AckLink, AckServer, Closed, Hello
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
#: longest a receiver tries to open its direct-ack connection before it acks through the mailbox
ACK_CONNECT_S = 5.0
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
        # (ray's stubs type remote()'s options as a task's: max_concurrency is an actor's)
        _mailbox_class = ray.remote(num_cpus=0, max_concurrency=10_000)(Mailbox)  # type: ignore[call-overload]
    return _mailbox_class


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


def _ray_failed(what: str, exc: BaseException) -> TransportError:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return TransportError(f"{what}: {type(exc).__name__}: {first}")


class _MailboxFailed:
    """The events pump failed (a Ray call, or Ray shut down under it): ``poll`` raises it."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc


class _EventPump:
    """A thread that keeps ``EVENT_POLLS`` events long-polls waiting at the mailbox, one for each
    of the next events, so each new event answers one at once; it puts the events into ``inbox``
    in their order (each once, whichever answer brings it), or a ``_MailboxFailed``."""

    def __init__(self, mailbox: Any, inbox: queue.SimpleQueue) -> None:
        self.mailbox, self.inbox = mailbox, inbox
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="wsync-ray-events", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Stop asking (within ``WAKE_SLICE_S``); waits for the thread unless called from it."""
        self.stopped.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=5.0)

    def _run(self) -> None:
        try:
            self._pump()
        except Exception as exc:  # whatever ends the thread reaches the sender's next poll, not a log
            self.inbox.put(_MailboxFailed(exc))

    def _pump(self) -> None:
        pending: list[tuple[int, Any]] = []  # (event awaited, ref)
        seen = -1  # the number of the last event handed on
        while not self.stopped.is_set():
            waiting = {need for need, _ in pending}
            for need in range(seen + 1, seen + 1 + EVENT_POLLS):
                if need not in waiting:
                    pending.append((need, self.mailbox.events.remote(seen, need, LONG_POLL_S)))
            refs = [ref for _, ref in pending]
            done, _ = ray.wait(refs, num_returns=1, timeout=WAKE_SLICE_S, fetch_local=True)
            if not done:
                continue
            done = ray.wait(refs, num_returns=len(refs), timeout=0)[0] or done
            pending = [(n, r) for n, r in pending if r not in done]
            replies = ray.get(done)
            numbered = sorted({item[0]: item[1] for reply in replies if isinstance(reply, list) for item in reply
                               if isinstance(item, list) and len(item) == 2 and isinstance(item[0], int)
                               and item[0] > seen}.items())
            for n, item in numbered:
                if n != seen + 1:  # a gap: the next answer brings it, with what follows
                    break
                seen = n
                self.inbox.put(_MailboxEvent(item))


class _MailboxEvent:
    """One event of the mailbox's log, as it came (checked by ``_event``)."""

    def __init__(self, item: Any) -> None:
        self.item = item


#: acks the sender keeps from a receiver it has not yet seen join (they can come first: the
#: mailbox hands a new receiver a delivery before the sender reads its join)
MAX_EARLY_ACKS = 1024
#: how long the sender waits, once a receiver has left, for its direct-ack connection to end
#: (so that the acks it sent before leaving are read first)
LEFT_GRACE_S = 1.0


class RaySender(SenderEndpoint):
    """Two staging buffers; each new snapshot goes into the object store once, its reference to
    the mailbox with the header for the listed workers. Acks come over receivers' direct
    connections (``acks.AckServer``) or, from a receiver without one, through the mailbox; both
    and the mailbox's events meet in one inbox that ``poll`` reads."""

    def __init__(self, options: dict[str, Any], ctx: SenderContext) -> None:
        self.channel, self.namespace, self.address = options["channel"], options["namespace"], options["address"]
        self.direct_acks = options.get("direct_acks", True)
        self.nbytes = ctx.layout.nbytes
        self.num_workers = ctx.num_workers
        self.origin = ctx.origin
        self.slots: list[Buffer] = []
        self.refs: dict[int, Any] = {}  # slot -> object reference holding its bytes
        self.latest = -1  # the slot published last
        self.seq = 0
        self.mailbox: Any = None
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.server: AckServer | None = None
        self.pump: _EventPump | None = None
        self.tokens: dict[int, str] = {}  # worker -> token of the receiver serving it, as joins said
        self.retired: set[str] = set()  # tokens that served a worker and no longer do
        self.early: list[AckFrame] = []  # direct acks of tokens not yet joined
        self.links: set[str] = set()  # tokens with a direct-ack connection open
        self.leaving: dict[str, tuple[Left, float]] = {}  # token -> its Left, held until its connection ends
        self.failed: _MailboxFailed | None = None
        self.posts: list[Any] = []
        self.woken = threading.Event()

    def open(self, deadline: Deadline) -> None:
        connect_ray(self.address)
        acks = None
        if self.direct_acks:
            try:  # where Ray itself listens for this node: receivers on other nodes reach it there
                self.server = AckServer(ray.util.get_node_ip_address(), self.inbox)
            except OSError as exc:
                log.info("ray channel %s: no direct-ack socket (%s); acks go through the mailbox", self.channel, exc)
            else:
                acks = [self.server.address[0], self.server.address[1], self.server.secret]
        try:
            # on the sender's own node: a mailbox on a worker's node would take every worker down
            # with that node (a cut link, a preempted host)
            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            self.mailbox = _mailbox().options(name=self.channel, namespace=self.namespace, max_restarts=0,
                                              scheduling_strategy=here).remote(acks, self.num_workers, self.nbytes, self.origin)
        except ValueError as exc:
            self._stop_threads()
            raise TransportError(f"ray channel {self.channel!r} (namespace {self.namespace!r}) already has a "
                                 f"sender: {exc}") from exc
        self.pump = _EventPump(self.mailbox, self.inbox)
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
                # raw bytes, out of band: one copy into the store (numpy's stubs give an ndarray
                # __buffer__ on Python 3.12+ only)
                ref = ray.put(pickle.PickleBuffer(data.numpy()))  # type: ignore[arg-type]
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
        self._check_posts()
        if self.failed is not None:
            return self._handle(self.failed)
        events = self._due()
        while not events and not self.woken.is_set():
            try:
                item = self.inbox.get(timeout=deadline.slice(WAKE_SLICE_S))
            except queue.Empty:
                events = self._due()
                if deadline.expired():
                    break
                continue
            events = self._handle(item)
            while True:  # whatever else is there already: one call hands on all of it
                try:
                    item = self.inbox.get_nowait()
                except queue.Empty:
                    break
                events += self._handle(item)
            events += self._due()
        return events

    def _handle(self, item: Any) -> list[Event]:
        """The wsync events one inbox item makes (none, one, or a join with the acks that came before it)."""
        if isinstance(item, _MailboxFailed):
            self.failed = item  # the pump has stopped: every later poll says so too
            raise _ray_failed(f"the mailbox actor {self.channel!r} failed", item.exc) from item.exc
        if isinstance(item, Hello):
            self.links.add(item.token)
            return []
        if isinstance(item, Closed):
            self.links.discard(item.token)
            held = self.leaving.pop(item.token, None)
            return [] if held is None else [held[0]]
        if isinstance(item, AckFrame):
            if self.tokens.get(item.worker) == item.token or item.token in self.leaving:
                return [Acked(item.worker, item.data)]
            if item.token not in self.retired:  # from a receiver whose join is still on its way
                if len(self.early) >= MAX_EARLY_ACKS:
                    log.warning("ray channel %s: more than %d acks from receivers not yet joined; dropping "
                                "the oldest", self.channel, MAX_EARLY_ACKS)
                    del self.early[0]
                self.early.append(item)
            return []
        raw = item.item
        event = _event(raw)
        if isinstance(event, Joined):
            out: list[Event] = []
            for token, (left, _) in list(self.leaving.items()):  # a restart: the old receiver's end first
                if left.worker == event.worker:
                    del self.leaving[token]
                    out.append(left)
            old = self.tokens.get(event.worker)
            if old is not None:
                self.retired.add(old)
            token = raw[2]  # _event admits a join only with its receiver's token
            self.tokens[event.worker] = token
            out.append(event)
            keep = []
            for ack in self.early:
                if ack.token == token and ack.worker == event.worker:
                    out.append(Acked(ack.worker, ack.data))
                else:
                    keep.append(ack)
            self.early = keep
            return out
        if isinstance(event, Left):
            gone = self.tokens.pop(event.worker, None)
            if gone is not None:
                self.retired.add(gone)
                if gone in self.links:  # its acks sent before it left are read first
                    self.leaving[gone] = (event, time.monotonic() + LEFT_GRACE_S)
                    return []
        return [] if event is None else [event]

    def _due(self) -> list[Event]:
        """The held Left events whose receivers' connections did not end within ``LEFT_GRACE_S``."""
        if not self.leaving:
            return []
        now = time.monotonic()
        due = [token for token, (_, at) in self.leaving.items() if at <= now]
        return [self.leaving.pop(token)[0] for token in due]

    def wake(self) -> None:
        self.woken.set()

    def _stop_threads(self) -> None:
        if self.pump is not None:
            self.pump.stop()
            self.pump = None
        if self.server is not None:
            self.server.close()
            self.server = None

    def close(self) -> None:
        mailbox, self.mailbox = self.mailbox, None
        self.refs.clear()
        self.slots, self.posts = [], []
        self._stop_threads()
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
        if kind == "join" and len(item) == 3 and isinstance(item[2], str):
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
        self.nbytes = ctx.layout.nbytes
        self.origin = ctx.origin
        self.token = uuid.uuid4().hex
        self.mailbox: Any = None
        self.pending: Any = None  # a take not yet answered
        self.candidate: tuple[bytes, Any] | None = None  # a possibly stale delivery, kept until none is newer
        self.fetching: tuple[bytes, Any] | None = None  # a delivery whose payload is not local yet
        self.zero_copy = zero_copy_for(options.get("zero_copy"), ctx)
        self.delivered = False  # the last recv returned a delivery
        self.link: AckLink | None = None  # the direct-ack connection to the sender
        self.woken = threading.Event()

    def open(self, deadline: Deadline) -> None:
        connect_ray(self.address)
        delay = 0.01
        while True:
            try:
                mailbox = ray.get_actor(self.channel, namespace=self.namespace)
                break
            except ValueError:
                if self.woken.is_set():  # shutting down: recv returns None, the core's connect() raises StateError
                    return
                if deadline.expired():
                    raise WorkerTimeoutError(f"no ray sender on channel {self.channel!r} (namespace "
                                             f"{self.namespace!r}) by the deadline", [self.worker]) from None
                time.sleep(deadline.slice(delay))
                delay = min(2 * delay, 0.2)
        context = ray.get_runtime_context()
        # how the mailbox sees this process die: through its actor, else its Ray worker's record
        watch = ["actor", context.current_actor] if context.get_actor_id() is not None else \
            ["worker", context.get_worker_id()]
        hello: ray.ObjectRef[Any] = mailbox.hello.remote(self.worker, self.token, watch, self.nbytes, self.origin)
        try:
            ready, _ = ray.wait([hello], timeout=deadline.seconds())
            if not ready:
                raise WorkerTimeoutError(f"the ray sender on channel {self.channel!r} did not answer by the deadline",
                                         [self.worker])
            reply = ray.get(hello)
        except RayError as exc:
            raise _ray_failed(f"saying hello to the ray sender on channel {self.channel!r} failed", exc) from exc
        if reply == ["closed"]:
            raise TransportError(f"the ray sender on channel {self.channel!r} has shut down")
        if isinstance(reply, list) and len(reply) == 2 and reply[0] == "foreign" and isinstance(reply[1], str):
            why = origin_refusal(self.worker, self.origin, reply[1])
            raise TransportError(f"the ray sender on channel {self.channel!r} refused worker {self.worker}: {why}")
        if isinstance(reply, list) and len(reply) == 2 and reply[0] in ("out_of_range", "held") \
                and isinstance(reply[1], int) and not isinstance(reply[1], bool):
            why = index_refusal(self.worker, reply[1]) if reply[0] == "out_of_range" else claim_refusal(
                self.worker, f"a payload of {self.nbytes} bytes; this sender's has {reply[1]}")
            raise TransportError(f"the ray sender on channel {self.channel!r} refused worker {self.worker}: {why}")
        if not (isinstance(reply, list) and len(reply) == 2 and reply[0] == "ok"):
            raise TransportError(f"malformed hello reply from the ray sender on channel {self.channel!r}: "
                                 f"{reply!r:.100}")
        self.mailbox = mailbox
        if reply[1] is not None:
            try:  # acks straight to the sender; the mailbox carries them where that cannot connect
                self.link = AckLink(reply[1], self.worker, self.token,
                                    max(min(deadline.remaining(), ACK_CONNECT_S), 1.0))
            except OSError as exc:
                log.info("ray channel %s: worker %d acks through the mailbox (no direct connection: %s)",
                         self.channel, self.worker, exc)

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
        if self.link is not None:
            try:
                self.link.send(bytes(data))
            except OSError as exc:  # the connection broke: this ack and the later ones go through the mailbox
                log.info("ray channel %s: worker %d's direct ack failed (%s); acking through the mailbox",
                         self.channel, self.worker, exc)
                self._drop_link()
            else:
                if self.pending is None:  # re-arm the long-poll: what arrives next is here sooner
                    self.pending = self.mailbox.take.remote(self.worker, self.token, LONG_POLL_S)
                return
        if self.pending is None:  # the ack also re-arms the long-poll: what arrives next is here sooner
            self.pending = self.mailbox.ack.remote(self.worker, self.token, bytes(data), LONG_POLL_S)
        else:
            self.mailbox.ack.remote(self.worker, self.token, bytes(data))

    def _drop_link(self) -> None:
        link, self.link = self.link, None
        if link is not None:
            link.close()

    def close(self) -> None:
        mailbox, self.mailbox = self.mailbox, None
        self.pending = self.fetching = self.candidate = None
        self._drop_link()  # its end reaches the sender after the acks sent on it, before the bye
        if mailbox is None:
            return
        try:  # after this worker's acks (Ray runs one caller's calls in order): the sender reads them first
            ray.get(mailbox.bye.remote(self.worker, self.token), timeout=5)
        except (RayError, GetTimeoutError) as exc:
            log.debug("ray channel %s: bye from worker %d failed: %s", self.channel, self.worker, exc)
