"""Broken transports, each derived from ``inproc`` and each planting one bug: a guarantee broken
in a way the core cannot mask, or a rule of the transport interface broken. The suite must fail
each of them under the guarantee named in ``BROKEN``, with the tests ``SELECT`` picks.

Run one: ``PYTHONPATH=conformance/tests wsync conformance wsync_broken:FlippedByte``.
"""

from __future__ import annotations

import json
import math
import pickle
import re
import socket
import threading
import time
from collections.abc import Sequence

import torch
from wsync_core import Buffer, Delivery, ReceiverContext, SenderContext, TransportError
from wsync_core.inproc import InprocTransport, _Channel, _Receiver, _Sender
from wsync_core.transport import Joined, Left

__all__ = ["BROKEN", "SELECT", "FlippedByte", "DroppedAck", "HalfPayload", "OldVersion", "RenumberedHeader", "WrongWorker", "LeakedThread",
           "UnpickledPayload", "UnpicklesPlainData", "AcquireLastPublished", "OlderWins", "NeverLeft", "IgnoresRestart", "UncheckedSize",
           "ReusedReceiveBuffer", "BlockingPublish", "DeadlineIgnored", "SleepsThroughShutdown",
           "CloseNotIdempotent", "EndpointInOptions",
           "SharedAdoptable", "EagerReceiver", "BlockedInC", "CorruptDelta", "PrefixIgnored",
           "WorkerWritesKept", "CrashesInC"]


class _BrokenReceiver(_Receiver):
    """Keeps a copy of the previous payload for the transports that replay it."""

    def __init__(self, transport, ctx: ReceiverContext) -> None:
        super().__init__(transport, ctx)
        self.previous: torch.Tensor | None = None

    def damage(self, delivery: Delivery) -> Delivery:
        return delivery

    def recv(self, deadline):
        delivery = super().recv(deadline)
        if delivery is None:
            return None
        out = self.damage(delivery)
        self.previous = delivery.payload.clone()
        return out


def _transport(name: str, receiver: type[_Receiver] = _Receiver, sender: type[_Sender] = _Sender) -> type:
    def make_sender(self, ctx: SenderContext):
        return sender(self, ctx)

    def make_receiver(self, ctx: ReceiverContext):
        return receiver(self, ctx)

    return type(name, (InprocTransport,), {"name": name.lower(), "sender": make_sender, "receiver": make_receiver,
                                            "__module__": __name__})


def _tooth(name: str, guarantee: str, select: str, **endpoints: type) -> type:
    """``_transport(name, **endpoints)``, registered as a tooth: the suite must fail it under
    ``guarantee`` with the tests ``select`` picks (``BROKEN``, ``SELECT`` and ``__all__``)."""
    BROKEN[name], SELECT[name] = guarantee, select
    __all__.append(name)
    return _transport(name, **endpoints)


class _Flip(_BrokenReceiver):
    def damage(self, delivery: Delivery) -> Delivery:
        payload = delivery.payload.clone()
        if payload.numel():
            payload[0] ^= 0xFF
        return Delivery(delivery.header, payload)


class _DropAck(_Receiver):
    def ack(self, data: bytes) -> None:
        if json.loads(data)["v"] >= 2:  # the worker applies version 2 and later; the sender never hears
            return
        super().ack(data)


class _Half(_BrokenReceiver):
    def damage(self, delivery: Delivery) -> Delivery:
        if self.previous is None:
            return delivery
        n = delivery.payload.numel() // 2
        return Delivery(delivery.header, torch.cat([delivery.payload[:n], self.previous[n:]]))


class _Old(_BrokenReceiver):
    def damage(self, delivery: Delivery) -> Delivery:
        if self.previous is None:
            return delivery
        return Delivery(delivery.header, self.previous)  # the newest header over the previous content


class _Renumbered(_BrokenReceiver):
    """Damages the header on the way in so that it still parses: from version 1 on, the version a
    delivery names is one more than the sender's (a digit changed in transit, no checksum to see it)."""

    def damage(self, delivery: Delivery) -> Delivery:
        header = re.sub(rb'"v":(\d+)', lambda m: b'"v":%d' % (int(m[1]) + (int(m[1]) >= 1)), delivery.header, count=1)
        return Delivery(header, delivery.payload)


class _Misroute(_Sender):
    def __init__(self, transport, ctx: SenderContext) -> None:
        super().__init__(transport, ctx)
        self.num_workers = ctx.num_workers

    def publish(self, buffer: Buffer, header: bytes, workers: Sequence[int]) -> None:
        if json.loads(header)["v"] > 0 and 0 < len(workers) < self.num_workers:
            workers = [(w + 1) % self.num_workers for w in workers]
        super().publish(buffer, header, workers)


class _Leaky(_Sender):
    def open(self, deadline) -> None:
        super().open(deadline)
        stop = threading.Event()
        threading.Thread(target=stop.wait, name="leaked-by-broken-transport", daemon=True).start()


class _Unpickle(_Receiver):
    def recv(self, deadline):
        delivery = super().recv(deadline)
        if delivery is None:
            return None
        return Delivery(delivery.header, pickle.loads(pickle.dumps(delivery.payload)))


class _UnpicklesPlainData(_Receiver):
    """Carries the header inside a pickled tuple, as a control message would be: plain bytes and
    tuples look up no class, so no ``find_class`` audit event tells of it."""

    def recv(self, deadline):
        delivery = super().recv(deadline)
        if delivery is None:
            return None
        (header,) = pickle.loads(pickle.dumps((bytes(delivery.header),)))
        return Delivery(header, delivery.payload, release=delivery.release, adoptable=delivery.adoptable,
                        warm=delivery.warm)


# -- the seven bugs of issue 14, and one per rule of the transport interface -----------------------


class _AcquireLast(_Sender):
    """acquire() hands back the buffer of the last publish (the core then overwrites a payload in flight)."""

    def __init__(self, transport, ctx: SenderContext) -> None:
        super().__init__(transport, ctx)
        self.last: Buffer | None = None

    def acquire(self, deadline) -> Buffer:
        return self.last if self.last is not None else super().acquire(deadline)

    def publish(self, buffer: Buffer, header: bytes, workers: Sequence[int]) -> None:
        self.last = buffer
        super().publish(buffer, header, workers)


class _PrefixIgnored(_Sender):
    """Declares prefix_publish (as inproc does) but delivers the whole buffer whatever ``used`` says:
    a delta arrives with the stale bytes of older versions after it."""

    def publish(self, buffer: Buffer, header: bytes, workers: Sequence[int]) -> None:
        with self.channel.cond:
            for w in workers:
                self.channel.mailbox[w] = (header, buffer.tensor)
            self.channel.cond.notify_all()


class _OlderWins(_Sender):
    """A newer publish is dropped while an older one is still queued for that worker."""

    def publish(self, buffer: Buffer, header: bytes, workers: Sequence[int]) -> None:
        with self.channel.cond:
            for w in workers:
                self.channel.mailbox.setdefault(w, (header, buffer.payload))
            self.channel.cond.notify_all()


class _NeverLeft(_Receiver):
    """close() says nothing: the sender never sees Left."""

    def close(self) -> None:
        channel, self.channel = self.channel, None
        if channel is None:
            return
        with channel.cond:
            channel.receivers.discard(self.worker)
            channel.mailbox.pop(self.worker, None)
        channel.detach_if_unused()


_seen_workers: dict[str, set[int]] = {}


class _IgnoreRestart(_Receiver):
    """A worker that connects again under an index it had before is ignored: no Joined, no deliveries."""

    def open(self, deadline) -> None:
        seen = _seen_workers.setdefault(self.name, set())
        if self.worker not in seen:
            seen.add(self.worker)
            super().open(deadline)
            self.ignored = False
            return
        super().open(deadline)
        self.ignored = True
        with self.channel.cond:  # the sender's connection table still holds the old one
            self.channel.events = type(self.channel.events)(
                e for e in self.channel.events if not (isinstance(e, Joined) and e.worker == self.worker))

    def recv(self, deadline):
        if getattr(self, "ignored", False):  # nothing reaches an ignored connection
            with self.channel.cond:
                self.channel.mailbox.pop(self.worker, None)
            time.sleep(min(deadline.remaining(), 0.5))
            return None
        return super().recv(deadline)


class _UncheckedSize(_Receiver):
    """Copies whatever arrives into a buffer of its own model's size, never checking the size."""

    def __init__(self, transport, ctx: ReceiverContext) -> None:
        super().__init__(transport, ctx)
        self.nbytes = ctx.layout.nbytes

    def recv(self, deadline):
        delivery = super().recv(deadline)
        if delivery is None:
            return None
        out = torch.zeros(self.nbytes, dtype=torch.uint8)
        n = min(self.nbytes, delivery.payload.numel())
        out[:n] = delivery.payload[:n]
        return Delivery(delivery.header, out)


class _ReusedBuffer(_Receiver):
    """One receive buffer for every version, handed out as adoptable: the model views it, and the
    next delivery (even one the core rejects) overwrites what the model holds."""

    def __init__(self, transport, ctx: ReceiverContext) -> None:
        super().__init__(transport, ctx)
        self.buffer: torch.Tensor | None = None

    def recv(self, deadline):
        delivery = super().recv(deadline)
        if delivery is None:
            return None
        if self.buffer is None or self.buffer.numel() != delivery.payload.numel():
            self.buffer = torch.empty(delivery.payload.numel(), dtype=torch.uint8)
        self.buffer.copy_(delivery.payload)
        return Delivery(delivery.header, self.buffer, adoptable=True)


class _WorkerWritesKept(_Receiver):
    """Hands out receive buffers of its own as adoptable and reuses one only after its release, but
    copies into a reused buffer only the bytes that differ from what it last wrote there: what
    the worker wrote into its model meanwhile stays wherever the versions agree."""

    def __init__(self, transport, ctx: ReceiverContext) -> None:
        super().__init__(transport, ctx)
        self.free: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, what was last written to it)
        self.lock = threading.Lock()

    def recv(self, deadline):
        delivery = super().recv(deadline)
        if delivery is None:
            return None
        payload = delivery.payload
        with self.lock:
            pair = self.free.pop() if self.free else None
        if pair is None or pair[0].numel() != payload.numel():
            pair = (payload.clone(), payload.clone())
        else:
            changed = pair[1] != payload
            pair[0][changed] = payload[changed]
            pair[1].copy_(payload)

        def release() -> None:
            with self.lock:
                self.free.append(pair)

        return Delivery(delivery.header, pair[0], release, adoptable=True)


class _BlockingPublish(_Sender):
    """From the fourth publish on, publish() blocks forever (a full socket buffer, say)."""

    def __init__(self, transport, ctx: SenderContext) -> None:
        super().__init__(transport, ctx)
        self.count = 0

    def publish(self, buffer: Buffer, header: bytes, workers: Sequence[int]) -> None:
        self.count += 1
        if self.count > 3:
            self.block()
        super().publish(buffer, header, workers)

    def block(self) -> None:
        threading.Event().wait()


class _DeadlineIgnored(_Receiver):
    """recv() ignores its deadline: it waits until something arrives."""

    def recv(self, deadline):
        channel = self.channel
        with channel.cond:
            channel.cond.wait_for(lambda: self.worker in channel.mailbox)
            item = channel.mailbox.pop(self.worker, None)
        return None if item is None else Delivery(item[0], item[1])


class _SleepsThroughShutdown(_Sender):
    """wake() does nothing: a poll() waiting in another thread runs on to its deadline."""

    def wake(self) -> None:
        pass


class _CloseTwiceSender(_Sender):
    """close() raises when called a second time (or before open)."""

    def close(self) -> None:
        if self.channel is None:
            raise TransportError("already closed")
        super().close()


class _EndpointInOptions(_Sender):
    """Keeps its live endpoint in the transport's options: a pickled scheme drags a lock along."""

    def __init__(self, transport, ctx: SenderContext) -> None:
        super().__init__(transport, ctx)
        transport.options["live_endpoint"] = self

    def open(self, deadline) -> None:
        super().open(deadline)


class _SharedAdoptableSender(_Sender):
    """Two buffers, used in turn (acquire never returns the last published one)."""

    def __init__(self, transport, ctx: SenderContext) -> None:
        super().__init__(transport, ctx)
        self.buffers = [Buffer(torch.empty(self.nbytes, dtype=torch.uint8), i) for i in range(2)]
        self.turn = 0

    def acquire(self, deadline) -> Buffer:
        self.turn ^= 1
        return self.buffers[self.turn]


class _SharedAdoptableReceiver(_Receiver):
    """Hands out the sender's buffer as adoptable (it is not this receiver's own): a model's tensors
    view a slot the sender writes again two versions later."""

    def recv(self, deadline):
        delivery = super().recv(deadline)
        if delivery is None:
            return None
        return Delivery(delivery.header, delivery.payload, adoptable=True)


FlippedByte = _transport("FlippedByte", receiver=_Flip)
DroppedAck = _transport("DroppedAck", receiver=_DropAck)
HalfPayload = _transport("HalfPayload", receiver=_Half)
OldVersion = _transport("OldVersion", receiver=_Old)
RenumberedHeader = _transport("RenumberedHeader", receiver=_Renumbered)
WrongWorker = _transport("WrongWorker", sender=_Misroute)
LeakedThread = _transport("LeakedThread", sender=_Leaky)
UnpickledPayload = _transport("UnpickledPayload", receiver=_Unpickle)
UnpicklesPlainData = _transport("UnpicklesPlainData", receiver=_UnpicklesPlainData)
AcquireLastPublished = _transport("AcquireLastPublished", sender=_AcquireLast)
OlderWins = _transport("OlderWins", sender=_OlderWins)
NeverLeft = _transport("NeverLeft", receiver=_NeverLeft)
IgnoresRestart = _transport("IgnoresRestart", receiver=_IgnoreRestart)
UncheckedSize = _transport("UncheckedSize", receiver=_UncheckedSize)
ReusedReceiveBuffer = _transport("ReusedReceiveBuffer", receiver=_ReusedBuffer)
BlockingPublish = _transport("BlockingPublish", sender=_BlockingPublish)
DeadlineIgnored = _transport("DeadlineIgnored", receiver=_DeadlineIgnored)
SleepsThroughShutdown = _transport("SleepsThroughShutdown", sender=_SleepsThroughShutdown)
CloseNotIdempotent = _transport("CloseNotIdempotent", sender=_CloseTwiceSender)
EndpointInOptions = _transport("EndpointInOptions", sender=_EndpointInOptions)
SharedAdoptable = _transport("SharedAdoptable", sender=_SharedAdoptableSender, receiver=_SharedAdoptableReceiver)
PrefixIgnored = _transport("PrefixIgnored", sender=_PrefixIgnored)
WorkerWritesKept = _transport("WorkerWritesKept", receiver=_WorkerWritesKept)

#: broken transport -> the guarantee it breaks
BROKEN: dict[str, str] = {
    "FlippedByte": "exact",
    "DroppedAck": "versioned",
    "HalfPayload": "atomic",
    "OldVersion": "versioned",
    "RenumberedHeader": "versioned",
    "WrongWorker": "targeted",
    "LeakedThread": "clean",
    "UnpickledPayload": "safe",
    "UnpicklesPlainData": "safe",
    "AcquireLastPublished": "isolated",
    "OlderWins": "versioned",
    "NeverLeft": "live",
    "IgnoresRestart": "live",
    "UncheckedSize": "safe",
    "ReusedReceiveBuffer": "atomic",
    "BlockingPublish": "live",
    "DeadlineIgnored": "live",
    "SleepsThroughShutdown": "live",
    "CloseNotIdempotent": "clean",
    "EndpointInOptions": "portable",
    "SharedAdoptable": "isolated",
    "PrefixIgnored": "exact",
    "WorkerWritesKept": "exact",
}

#: broken transport -> the tests (a pytest -k expression) that must catch it
SELECT: dict[str, str] = {
    "FlippedByte": "test_exact_send_weights_views or test_exact_every_dtype_and_shape",
    "DroppedAck": "test_versioned_counts_and_content",
    "HalfPayload": "test_atomic_no_mix_of_versions",
    "OldVersion": "test_versioned_counts_and_content",
    "RenumberedHeader": "test_versioned_counts_and_content",
    "WrongWorker": "test_targeted_subset_send",
    "LeakedThread": "test_clean_after_shutdown",
    "UnpickledPayload": "test_safe_nothing_unpickled",
    "UnpicklesPlainData": "test_safe_nothing_unpickled",
    "AcquireLastPublished": "test_endpoint_acquire_never_returns_a_buffer_in_use",
    "OlderWins": "test_endpoint_newest_wins",
    "NeverLeft": "test_endpoint_joined_acked_left",
    "IgnoresRestart": "test_endpoint_reconnect_same_index or test_live_restarted_worker_gets_latest",
    "UncheckedSize": "test_endpoint_size_checks",
    "ReusedReceiveBuffer": "test_atomic_damaged_payload",
    # a hung test fails and the run goes on: the ordered test after it still passes
    "BlockingPublish": "test_versioned_counts_and_content or test_ordered_sender",
    "DeadlineIgnored": "test_endpoint_calls_honour_deadlines",
    "SleepsThroughShutdown": "test_endpoint_wake_ends_a_waiting_poll",
    "CloseNotIdempotent": "test_endpoint_close_from_any_state",
    "EndpointInOptions": "test_portable_pickles",
    "SharedAdoptable": "test_targeted_subset_send or test_isolated_kept_references",
    "PrefixIgnored": "test_endpoint_publish_delivers_used_bytes",
    "WorkerWritesKept": "test_exact_after_worker_writes",
}


class _EagerReceiver(_Receiver):
    """Connects and announces itself when built, not in open(): init_on_receiver() half-connects."""

    def __init__(self, transport, ctx: ReceiverContext) -> None:
        super().__init__(transport, ctx)
        from wsync_core import Deadline

        super().open(Deadline(5.0))

    def open(self, deadline) -> None:
        pass


EagerReceiver = _transport("EagerReceiver", receiver=_EagerReceiver)
BROKEN["EagerReceiver"] = "ordered"
SELECT["EagerReceiver"] = "test_ordered_init_does_not_connect"


class _EagerSender(_Sender):
    """Takes its channel when built, not in open(): a sender that init_on_sender() made and that
    never connects holds it (a trainer restarted on the same options finds it taken)."""

    def __init__(self, transport, ctx: SenderContext) -> None:
        super().__init__(transport, ctx)
        from wsync_core import Deadline

        super().open(Deadline(5.0))

    def open(self, deadline) -> None:
        pass


EagerSender = _tooth("EagerSender", "ordered", "test_ordered_init_on_sender_takes_nothing", sender=_EagerSender)


class _BlockedInC(_BlockingPublish):
    """From the fourth publish on, publish() blocks where no signal reaches it (as a call stuck in C)."""

    def block(self) -> None:
        import signal

        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
        while True:
            time.sleep(3600)


BlockedInC = _transport("BlockedInC", sender=_BlockedInC)
BROKEN["BlockedInC"] = "live"
# the process running the hung test is ended; wsync conformance goes on with the ordered test
SELECT["BlockedInC"] = "test_versioned_counts_and_content or test_ordered_sender"


class _CrashesInC(_BlockingPublish):
    """From the fourth publish on, publish() crashes the process (a fault in a native extension)."""

    def block(self) -> None:
        import ctypes

        ctypes.string_at(0)  # reads address 0: SIGSEGV


CrashesInC = _transport("CrashesInC", sender=_CrashesInC)
BROKEN["CrashesInC"] = "versioned"
# the test it crashes in fails under its own guarantee, naming the signal; the ordered test still runs
SELECT["CrashesInC"] = "test_versioned_counts_and_content or test_ordered_sender"


class _CorruptDelta(_Receiver):
    """Flips the first value byte of every delta (a payload with a base): a bug only exactness sees."""

    def recv(self, deadline):
        delivery = super().recv(deadline)
        if delivery is None:
            return None
        header = json.loads(delivery.header)
        table = header.get("x")
        if header.get("b") is None or not table:
            return delivery
        i, count, offset = table[0]
        at = offset if count < 0 else offset + (count * 4 + 63) // 64 * 64
        payload = delivery.payload.clone()
        payload[at] ^= 0x5A
        return Delivery(delivery.header, payload)


CorruptDelta = _transport("CorruptDelta", receiver=_CorruptDelta)
BROKEN["CorruptDelta"] = "exact"
SELECT["CorruptDelta"] = "test_delta_exact_sparse_changes"


# -- faults (issue 16): slow workers, and network transports across hosts -------------------------


class _StaleQueued(_Sender):
    """Queues every version for a worker that is not reading and delivers them oldest first."""

    def publish(self, buffer: Buffer, header: bytes, workers: Sequence[int]) -> None:
        with self.channel.cond:
            queues = self.channel.__dict__.setdefault("queues", {})
            for w in workers:
                queues.setdefault(w, []).append((header, buffer.payload.clone()))
                self.channel.mailbox[w] = queues[w][0]
            self.channel.cond.notify_all()


class _StaleQueuedReceiver(_Receiver):
    """Takes the queued versions oldest first, one each tenth of a second (as through a pipe)."""

    last = 0.0

    def recv(self, deadline):
        gap = self.last + 0.1 - time.monotonic()
        if gap > 0:
            if deadline.remaining() < gap:
                return None
            time.sleep(gap)
        delivery = super().recv(deadline)
        if delivery is None:
            return None
        self.last = time.monotonic()
        with self.channel.cond:  # the next queued one (oldest first) waits in the mailbox
            queue = self.channel.__dict__.get("queues", {}).get(self.worker, [])
            if queue:
                queue.pop(0)
            if queue:
                self.channel.mailbox[self.worker] = queue[0]
        return delivery


StaleQueued = _transport("StaleQueued", sender=_StaleQueued, receiver=_StaleQueuedReceiver)
BROKEN["StaleQueued"] = "live"
SELECT["StaleQueued"] = "test_faults_slow_worker_gets_newest"

# -- an audit of a third-party transport: four bugs the suite passed ------------------------------


class _RingIgnoresHolders(_Sender):
    """Three buffers used in turn, whoever still holds one: never the last published, but a subset
    send hands out again the buffer a skipped worker holds, or has waiting for it unread."""

    def __init__(self, transport, ctx: SenderContext) -> None:
        super().__init__(transport, ctx)
        self.ring = [Buffer(torch.empty(self.nbytes, dtype=torch.uint8), i) for i in range(3)]
        self.turn = -1

    def acquire(self, deadline) -> Buffer:
        self.turn = (self.turn + 1) % len(self.ring)
        return self.ring[self.turn]


class _EmptyIsNone(_Receiver):
    """Takes a payload of 0 bytes (a model whose every tensor is empty) for nothing received."""

    def recv(self, deadline):
        delivery = super().recv(deadline)
        if delivery is None or delivery.payload.numel() == 0:
            return None
        return delivery


class _ReversedEvents(_Sender):
    """poll() returns the events it gathered last first: a worker's Left before its acks, its
    re-Joined before its Left."""

    def poll(self, deadline):
        return list(reversed(super().poll(deadline)))


class _HoardsBuffers(_Sender):
    """acquire() allocates a new buffer every time and keeps every one until close."""

    def __init__(self, transport, ctx: SenderContext) -> None:
        super().__init__(transport, ctx)
        self.hoard: list[Buffer] = []

    def acquire(self, deadline) -> Buffer:
        buffer = super().acquire(deadline)
        self.hoard.append(buffer)
        return buffer

    def close(self) -> None:
        self.hoard.clear()
        super().close()


class _BlindRecv(_Receiver):
    """recv() given an expired deadline returns None without looking: a worker polling with
    receive(timeout=0) never applies anything."""

    def recv(self, deadline):
        return None if deadline.expired() else super().recv(deadline)


class _BlindPoll(_Sender):
    """poll() given an expired deadline returns [] without looking: the acks and joins only a
    waiting send reads."""

    def poll(self, deadline):
        return [] if deadline.expired() else super().poll(deadline)


class _CutHeaders(_Sender):
    """Delivers at most the first 64 KiB of a header (a fixed frame's size): a model of many
    tensors never connects, its first header, which carries the layout, cut short."""

    def publish(self, buffer, header, workers):
        super().publish(buffer, header[:65536], workers)


class _ChunkTail(_BrokenReceiver):
    """Copies a payload in 16 MiB chunks and drops the last, partial one: past the last whole
    chunk a worker keeps the previous version's bytes (zeros at first). Models under 16 MiB pass."""

    CHUNK = 16 << 20

    def damage(self, delivery: Delivery) -> Delivery:
        n = delivery.payload.numel()
        if n <= self.CHUNK:
            return delivery
        keep = self.previous if self.previous is not None and self.previous.numel() == n else None
        out = keep.clone() if keep is not None else torch.zeros(n, dtype=torch.uint8)
        whole = n // self.CHUNK * self.CHUNK
        out[:whole] = delivery.payload[:whole]
        return Delivery(delivery.header, out)


_reopened: dict[str, set[int]] = {}


class _AckLostAfterReopen(_Receiver):
    """A worker back under an index it had before loses its first ack (sent before its connection
    is registered again, say): the sender waits for it until the send's timeout."""

    def open(self, deadline) -> None:
        seen = _reopened.setdefault(self.name, set())
        self.drop_ack = self.worker in seen
        seen.add(self.worker)
        super().open(deadline)

    def ack(self, data: bytes) -> None:
        if self.drop_ack:
            self.drop_ack = False
            return
        super().ack(data)


class _FourSlots(_Sender):
    """Routes a version sent to some of the workers through a table of four, by worker index
    modulo four (a version for everyone goes right): with five workers, one for worker 4 reaches
    worker 0."""

    def publish(self, buffer: Buffer, header: bytes, workers: Sequence[int]) -> None:
        if sorted(workers) != sorted(self.channel.receivers):
            workers = sorted({w % 4 for w in workers})
        super().publish(buffer, header, workers)


class _LeaksWhenAlone(_Sender):
    """Starts a watcher thread in open() and stops it in close() only once a worker has joined: a
    sender whose connect() timed out with no worker leaves it running."""

    def open(self, deadline) -> None:
        super().open(deadline)
        self.joined_any = False
        self.stop_watch = threading.Event()
        threading.Thread(target=self.stop_watch.wait, name="watcher-of-a-broken-transport", daemon=True).start()

    def poll(self, deadline):
        events = super().poll(deadline)
        self.joined_any = self.joined_any or any(isinstance(e, Joined) for e in events)
        return events

    def close(self) -> None:
        if getattr(self, "joined_any", False):
            self.stop_watch.set()
        super().close()


class _Misaligned(_Sender):
    """``acquire()`` hands out a buffer 8 bytes into an allocation: its address is no multiple of 64."""

    def acquire(self, deadline) -> Buffer:
        return Buffer(torch.empty(self.nbytes + 8, dtype=torch.uint8)[8:])


class _CutAcks(_Receiver):
    """Sends at most an ack's first KiB (a fixed-size control frame): acks of versions fit, a
    rejection quoting a long error arrives cut, as malformed."""

    def ack(self, data: bytes) -> None:
        super().ack(bytes(data)[:1024])


class _SpinningRecv(_Receiver):
    """``recv()`` waits by asking again and again (a deadline misread as milliseconds, say): the
    worker's process burns a core while it waits for a version."""

    def recv(self, deadline):
        from wsync_core import Deadline

        while True:
            delivery = super().recv(Deadline(0))
            if delivery is not None or deadline.expired() or self.woken:
                return delivery


class _RaisesForGone(_Sender):
    """publish() raises TransportError when a target has closed since the last poll (instead of
    skipping it and reporting Left): one worker gone fails the send for every other."""

    def publish(self, buffer, header, workers):
        gone = [w for w in workers if w not in self.channel.receivers]
        if gone:
            raise TransportError(f"workers {gone} are gone")
        super().publish(buffer, header, workers)


class _DropsOnFailedWrite(_Sender):
    """publish() to a worker that has closed since the last poll "fails to write" and drops it,
    forgetting what it sent before closing: its last ack is lost, and its Left reported."""

    def publish(self, buffer, header, workers):
        channel = self.channel
        with channel.cond:
            for w in workers:
                if w not in channel.receivers:
                    kept = [ev for ev in channel.events if ev.worker != w or isinstance(ev, Left)]
                    channel.events.clear()
                    channel.events.extend(kept)
        super().publish(buffer, header, workers)


class _DeafToWake(_Receiver):
    """wake() does nothing: a recv() waiting in another thread runs on to its deadline, so a
    shutdown() from another thread waits out the worker's receive(timeout=...)."""

    def wake(self) -> None:
        pass


class _LastAckLost(_Receiver):
    """ack() queues; the queue goes out with the next ack or recv(), and close() drops it (an I/O
    thread that stops before it has written what was queued): an ack just before closing is lost."""

    def __init__(self, transport, ctx: ReceiverContext) -> None:
        super().__init__(transport, ctx)
        self.queued: list[bytes] = []

    def _flush(self) -> None:
        for data in self.queued:
            super().ack(data)
        self.queued = []

    def ack(self, data: bytes) -> None:
        self._flush()
        self.queued.append(bytes(data))

    def recv(self, deadline):
        self._flush()
        return super().recv(deadline)


class _IndexUnchecked(_Receiver):
    """Takes any worker index: one out of the sender's range waits for versions that never come,
    its connect() timing out with "got no weights" instead of naming the index."""

    def _refusal(self, channel) -> None:
        return None


class _DeafDial(_Receiver):
    """Waits in open() until its channel has a sender, a few times a second, deaf to wake(): a
    worker started before its trainer cannot be shut down from another thread until its timeout."""

    def open(self, deadline) -> None:
        give_up = time.monotonic() + 42.0  # (deaf for as long as the check waits, then done: a quick close)
        channel = _Channel.attach(self.name)
        try:
            while not channel.sender and not deadline.expired() and time.monotonic() < give_up:
                time.sleep(deadline.slice(0.05))
        finally:
            channel.detach_if_unused()
        super().open(deadline)


class _InfiniteTimeout(_Receiver):
    """open() hands what remains of its deadline to a socket timeout, which cannot take math.inf
    (OverflowError): a worker connecting with ``timeout=math.inf``, the documented "forever",
    fails (mp's handshake did, and rpc's agent start, found by an outside audit)."""

    def open(self, deadline) -> None:
        with socket.socket() as sock:
            sock.settimeout(deadline.remaining())
        super().open(deadline)


class _EndAfterPublish(_Sender):
    """A worker's Left found by a publish (the new connection met first, the old one's end after
    it, as zmq's sender matched ends by descriptor) is reported after its new Joined; with only
    polls in between, events come in order."""

    def __init__(self, transport, ctx: SenderContext) -> None:
        super().__init__(transport, ctx)
        self.published = False

    def publish(self, buffer, header, workers) -> None:
        self.published = True
        super().publish(buffer, header, workers)

    def poll(self, deadline):
        events = super().poll(deadline)
        if self.published:
            events = [ev for ev in events if not isinstance(ev, Left)] + [ev for ev in events if isinstance(ev, Left)]
        self.published = False
        return events


RingIgnoresHolders = _tooth("RingIgnoresHolders", "isolated", "test_endpoint_acquire_never_returns_a_buffer_in_use",
                            sender=_RingIgnoresHolders)
EmptyIsNone = _tooth("EmptyIsNone", "exact", "test_exact_empty_model", receiver=_EmptyIsNone)
ReversedEvents = _tooth("ReversedEvents", "live", "test_endpoint_events_in_order", sender=_ReversedEvents)
HoardsBuffers = _tooth("HoardsBuffers", "live", "test_endpoint_sender_memory_bounded", sender=_HoardsBuffers)
BlindRecv = _tooth("BlindRecv", "live", "test_endpoint_expired_deadline_still_looks", receiver=_BlindRecv)
BlindPoll = _tooth("BlindPoll", "live", "test_endpoint_expired_deadline_still_looks", sender=_BlindPoll)
CutHeaders = _tooth("CutHeaders", "exact", "test_exact_many_tensors", sender=_CutHeaders)
CutAcks = _tooth("CutAcks", "exact", "test_endpoint_headers_and_acks_arrive_whole", receiver=_CutAcks)
AckLostAfterReopen = _tooth("AckLostAfterReopen", "live", "test_endpoint_reconnect_same_index",
                            receiver=_AckLostAfterReopen)
FourSlots = _tooth("FourSlots", "targeted", "test_endpoint_five_workers", sender=_FourSlots)
LeaksWhenAlone = _tooth("LeaksWhenAlone", "clean", "test_clean_after_connects_that_time_out", sender=_LeaksWhenAlone)
Misaligned = _tooth("Misaligned", "exact", "test_endpoint_publish_delivers_used_bytes", sender=_Misaligned)
ChunkTail = _tooth("ChunkTail", "exact", "test_endpoint_a_large_payload_arrives_whole", receiver=_ChunkTail)
SpinningRecv = _tooth("SpinningRecv", "live", "test_endpoint_waits_sleep", receiver=_SpinningRecv)
RaisesForGone = _tooth("RaisesForGone", "live", "test_endpoint_publish_skips_a_gone_worker", sender=_RaisesForGone)
LastAckLost = _tooth("LastAckLost", "live", "test_endpoint_events_in_order", receiver=_LastAckLost)
EndAfterPublish = _tooth("EndAfterPublish", "live", "test_endpoint_events_in_order", sender=_EndAfterPublish)
DropsOnFailedWrite = _tooth("DropsOnFailedWrite", "live", "test_endpoint_ack_then_close_while_publishing",
                            sender=_DropsOnFailedWrite)
IndexUnchecked = _tooth("IndexUnchecked", "live", "test_live_worker_index_out_of_range_is_told",
                        receiver=_IndexUnchecked)
DeafToWake = _tooth("DeafToWake", "live", "test_live_shutdown_from_another_thread_ends_receive", receiver=_DeafToWake)
InfiniteTimeout = _tooth("InfiniteTimeout", "live", "test_live_a_timeout_of_math_inf_waits_as_long_as_it_takes",
                        receiver=_InfiniteTimeout)
DeafDial = _tooth("DeafDial", "live", "test_live_shutdown_from_another_thread_ends_connect_with_no_sender",
                  receiver=_DeafDial)

try:  # the network teeth build on contrib/wsync-tcp (a byte stream over TCP, multi_host)
    from wsync_tcp import TcpTransport
    from wsync_tcp import _Receiver as _TcpReceiver
    from wsync_tcp import _Sender as _TcpSender
except ImportError:  # pragma: no cover - wsync-tcp is part of this repository
    TcpTransport = None

if TcpTransport is not None:

    class _HoardingSender(_TcpSender):
        """Delivers the newest version, but keeps a copy of every version for a worker until it acks."""

        def __init__(self, options, ctx: SenderContext) -> None:
            super().__init__(options, ctx)
            self.hoard: dict[int, list[torch.Tensor]] = {}

        def deliver(self, buffer, header: bytes, workers: Sequence[int]) -> None:
            for w in workers:
                self.hoard.setdefault(w, []).append(buffer.tensor.clone())
            super().deliver(buffer, header, workers)

        def emit(self, event) -> None:
            from wsync_core.transport import Acked

            if isinstance(event, Acked):
                self.hoard.pop(event.worker, None)
            super().emit(event)

    class _HangsWhenSenderDies(_TcpReceiver):
        """Once its sender is gone, recv() waits for a delivery that never comes, whatever its deadline."""

        def _live(self, conn) -> None:
            self.had_sender = True
            super()._live(conn)

        def recv(self, deadline):
            if getattr(self, "had_sender", False) and self.conn is None:
                threading.Event().wait()
            return super().recv(deadline)

    class _NoReconnect(_TcpReceiver):
        """Talks to the first connection it makes; once that is lost (a cut link), it never reconnects."""

        def _run(self) -> None:
            while self.is_open:
                try:
                    stream = self.connect(min(2.0, self.heartbeat))
                except OSError:
                    time.sleep(0.05)
                    continue
                self._serve(stream)
                break
            while self.is_open:  # alive, connected to nothing
                time.sleep(0.1)

    class _ProbesWithoutDeadline(_TcpReceiver):
        """Before handing over what waited, asks its sender for the newest version and waits for the
        answer whatever the deadline, as a store client on a cut link waits for TCP to give up: on
        a worker whose link is cut, a receive() with a version waiting hangs."""

        def recv(self, deadline):
            from wsync_core import Deadline
            from wsync_core.stream import Kind, frame

            with self.cond:
                self.check_open()
                conn = self.conn
                if conn is not None and conn.stage == "live" and self._waited(conn):
                    self._probes += 1
                    probe = self._probes
                    conn.push(frame(Kind.PROBE, a=probe))
                    self._kick()
                    self.wait_until(lambda: self._answered >= probe, Deadline(math.inf))
            return super().recv(deadline)

    class _GoodbyeIsFinal(_TcpReceiver):
        """Reconnects after a lost link, but takes the sender's goodbye (a shutdown) for the end: a
        trainer restarted on the same address waits for workers that never come back."""

        def _frame(self, conn, f):
            from wsync_core.stream import Kind

            if f.kind == Kind.BYE and not f.body:
                return "the sender shut down"
            return super()._frame(conn, f)

    _LEFT_OPEN: list[socket.socket] = []

    class _LeavesListener(_TcpReceiver):
        """Listens on a socket of its own, opened with the receiver and never closed (a module keeps it)."""

        def __init__(self, options, ctx: ReceiverContext) -> None:
            super().__init__(options, ctx)
            _LEFT_OPEN.append(socket.create_server(("127.0.0.1", 0)))

    def _tcp(name: str, sender: type = _TcpSender, receiver: type = _TcpReceiver, heartbeat: float = 10.0) -> type:
        def make_sender(self, ctx: SenderContext):
            return sender(self.options, ctx)

        def make_receiver(self, ctx: ReceiverContext):
            return receiver(self.options, ctx)

        def multi_host_options(host_address: str) -> dict:
            return {"host": host_address, "heartbeat": heartbeat}

        return type(name, (TcpTransport,), {"name": name.lower(), "sender": make_sender, "receiver": make_receiver,
                                            "multi_host_options": staticmethod(multi_host_options),
                                            "__module__": __name__})

    def _auth_options(good: bool) -> dict:
        return {"authkey": "the-shared-secret-of-this-test" if good else "a-guess-at-the-secret"}

    def _shows_secret(self) -> str:  # a plugin's own repr that forgot the secret
        return f"ShowsSecret({self.options})"

    #: its own __repr__ prints the authkey
    ShowsSecret = type("ShowsSecret", (TcpTransport,), {"name": "showssecret", "__repr__": _shows_secret,
                                                        "auth_options": staticmethod(_auth_options),
                                                        "__module__": __name__})
    #: declares auth but names no secret option, so the base repr prints the authkey
    UnnamedSecret = type("UnnamedSecret", (TcpTransport,), {"name": "unnamedsecret", "secret_options": (),
                                                            "auth_options": staticmethod(_auth_options),
                                                            "__module__": __name__})

    def _keyed_alike(endpoint: type):
        def make(self, ctx):  # the handshake's MAC uses one built-in key, not the peer's own
            return endpoint({**self.options, "authkey": "built-in"} if self.options["authkey"] else self.options, ctx)
        return make

    #: declares auth and runs the handshake, but every peer proves the same built-in key: a
    #: stranger with a wrong key joins and is sent every version
    KeyIgnored = type("KeyIgnored", (TcpTransport,), {"name": "keyignored", "sender": _keyed_alike(_TcpSender),
                                                      "receiver": _keyed_alike(_TcpReceiver),
                                                      "auth_options": staticmethod(_auth_options),
                                                      "__module__": __name__})
    BROKEN.update(ShowsSecret="safe", UnnamedSecret="safe", KeyIgnored="safe")
    SELECT.update(ShowsSecret="test_capability_auth_secrets_never_shown",
                  UnnamedSecret="test_capability_auth_secrets_never_shown",
                  KeyIgnored="test_capability_auth and not secrets")
    __all__ += ["ShowsSecret", "UnnamedSecret", "KeyIgnored"]

    class _SilentTakeover(_TcpSender):
        """Newest hello wins, but the connection it replaces is closed without a word: the receiver
        still reading it connects again and takes the index back, over and over."""

        def _drop(self, conn, reason: str, tell: bool = False) -> None:
            super()._drop(conn, reason)

    HoardingSender = _tcp("HoardingSender", sender=_HoardingSender)
    HangsWhenSenderDies = _tcp("HangsWhenSenderDies", receiver=_HangsWhenSenderDies)
    NoReconnect = _tcp("NoReconnect", receiver=_NoReconnect, heartbeat=1.0)
    ProbesWithoutDeadline = _tcp("ProbesWithoutDeadline", receiver=_ProbesWithoutDeadline, heartbeat=1.0)
    BROKEN.update(HoardingSender="live", HangsWhenSenderDies="live", NoReconnect="live",
                  ProbesWithoutDeadline="live")
    SELECT.update(HoardingSender="test_faults_slow_worker_gets_newest",
                  HangsWhenSenderDies="test_faults_sender_killed",
                  NoReconnect="test_faults_link_cut", ProbesWithoutDeadline="test_faults_link_cut")
    __all__ += ["HoardingSender", "HangsWhenSenderDies", "NoReconnect", "ProbesWithoutDeadline"]

    SilentTakeover = _tcp("SilentTakeover", sender=_SilentTakeover)
    BROKEN["SilentTakeover"] = "live"
    SELECT["SilentTakeover"] = "test_live_two_receivers_claim_one_index"
    __all__ += ["SilentTakeover"]

    class _StrayTakesIndex(_TcpSender):
        """Newest hello wins whatever its size: another model's worker, given this scheme's
        options, pushes out the worker that holds its index and applies every version."""

        def _hello(self, conn, worker: int, nbytes: int, origin: str) -> None:
            super()._hello(conn, worker, self.ctx.layout.nbytes, origin)

    class _ForeignTakesIndex(_TcpSender):
        """Reads the hello's origin but never compares it: a worker of another trainer's scheme
        (another job given this address) pushes out the worker that holds its index."""

        def _hello(self, conn, worker: int, nbytes: int, origin: str) -> None:
            super()._hello(conn, worker, nbytes, "")

    StrayTakesIndex = _tcp("StrayTakesIndex", sender=_StrayTakesIndex)
    ForeignTakesIndex = _tcp("ForeignTakesIndex", sender=_ForeignTakesIndex)
    BROKEN.update(StrayTakesIndex="live", ForeignTakesIndex="targeted")
    SELECT.update(StrayTakesIndex="test_live_worker_of_another_model_does_not_take_an_index",
                  ForeignTakesIndex="test_targeted_worker_of_another_trainer_does_not_take_an_index")
    __all__ += ["StrayTakesIndex", "ForeignTakesIndex"]

    GoodbyeIsFinal = _tcp("GoodbyeIsFinal", receiver=_GoodbyeIsFinal)
    BROKEN["GoodbyeIsFinal"] = "live"
    SELECT["GoodbyeIsFinal"] = "test_live_sender_restarted_on_its_address"
    __all__ += ["GoodbyeIsFinal"]

    ListenerLeft = _tcp("ListenerLeft", receiver=_LeavesListener)
    BROKEN["ListenerLeft"] = "clean"
    SELECT["ListenerLeft"] = "test_clean_after_shutdown"
    __all__ += ["ListenerLeft"]
    #: not a tooth (in no table): ListenerLeft declaring a trusted runtime, whose first listener
    #: the harness's pool takes for the runtime's (test_parts)
    RuntimeListens = type("RuntimeListens", (ListenerLeft,), {"name": "runtimelistens",
                                                              "trusted_runtime": ("wsync_broken", "a test's runtime"),
                                                              "__module__": __name__})

    class _AbortsAtExit(_TcpReceiver):
        """Closes, but leaves work that ends its process with SIGABRT at exit (as a native thread
        left running does: "terminate called without an active exception")."""

        def close(self) -> None:
            import atexit
            import os

            super().close()
            atexit.register(os.abort)

    AbortsAtExit = _tcp("AbortsAtExit", receiver=_AbortsAtExit)
    BROKEN["AbortsAtExit"] = "clean"
    SELECT["AbortsAtExit"] = "test_clean_receiver_process_exits_with_status_0"
    __all__ += ["AbortsAtExit"]

    def _listens_everywhere(self, **options) -> None:  # its default: every interface, not loopback
        TcpTransport.__init__(self, **{"host": "0.0.0.0", "advertise": "127.0.0.1", **options})

    ListensEverywhere = type("ListensEverywhere", (TcpTransport,), {"name": "listenseverywhere",
                                                                    "__init__": _listens_everywhere,
                                                                    "__module__": __name__})
    BROKEN["ListensEverywhere"] = "safe"
    SELECT["ListensEverywhere"] = "test_safe_binds_loopback"
    __all__ += ["ListensEverywhere"]

    def _trusts_the_wire(self, **options) -> None:  # its default: no checksum ("TCP checks its bytes")
        TcpTransport.__init__(self, **{"checksum": False, **options})

    TrustsTheWire = type("TrustsTheWire", (TcpTransport,), {"name": "truststhewire", "__init__": _trusts_the_wire,
                                                            "__module__": __name__})
    BROKEN["TrustsTheWire"] = "exact"
    SELECT["TrustsTheWire"] = "test_capability_multi_host"
    __all__ += ["TrustsTheWire"]

    class _FallsBackToNoAuth(_TcpReceiver):
        """Holds an authkey and proves it when challenged, but takes a sender that has not
        challenged it within 0.2 s for one without authentication (a "compatibility" fallback):
        whoever listens on the sender's address feeds it weights."""

        def _serve(self, stream):
            def fall_back() -> None:
                with self.cond:
                    conn = self.conn
                    if conn is not None and conn.stage == "auth":
                        self._live(conn)
                self._kick()

            threading.Timer(0.2, fall_back).start()
            return super()._serve(stream)

    FallsBackToNoAuth = type("FallsBackToNoAuth", (_tcp("FallsBackToNoAuth", receiver=_FallsBackToNoAuth),),
                             {"auth_options": staticmethod(_auth_options), "__module__": __name__})
    BROKEN["FallsBackToNoAuth"] = "safe"
    SELECT["FallsBackToNoAuth"] = "test_capability_auth_refuses_an_impostor_sender"
    __all__ += ["FallsBackToNoAuth"]

__all__ += ["StaleQueued"]

try:  # a tooth on plugins/wsync-shm (processes on one host, a worker's end seen as its socket's end)
    from wsync_shm.transport import ShmTransport
    from wsync_shm.transport import _Receiver as _ShmReceiver
except ImportError:  # pragma: no cover - wsync-shm is part of this repository
    ShmTransport = None

if ShmTransport is not None:

    class _ChildKeepsConnection(_ShmReceiver):
        """A forked child keeps its copy of the worker's connection: when the worker shuts down,
        the sender never sees its end, and refuses it back under its index."""

        def forget_in_child(self) -> None:
            pass

    ChildKeepsConnection = type("ChildKeepsConnection", (ShmTransport,), {
        "name": "childkeepsconnection", "receiver": lambda self, ctx: _ChildKeepsConnection(self, ctx),
        "__module__": __name__})
    BROKEN["ChildKeepsConnection"] = "live"
    SELECT["ChildKeepsConnection"] = "test_live_worker_with_a_forked_child_comes_back"
    __all__ += ["ChildKeepsConnection"]
