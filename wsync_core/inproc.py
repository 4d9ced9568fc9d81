"""``inproc``: the reference transport. Receivers are threads of the sender's process.

Each receiver holds a plain-pickled copy of the scheme; copies meet through a process-wide
table of channels keyed by the ``channel`` option. Receivers read the sender's snapshot
buffer directly (zero-copy): the core never writes a buffer again once published.
"""

from __future__ import annotations

import os
import re
import threading
import uuid
from collections import deque
from collections.abc import Sequence

import torch

from .deadline import Deadline
from .errors import TransportError
from .hookspecs import hookimpl
from .transport import (
    Acked,
    Buffer,
    Capabilities,
    Delivery,
    Event,
    Joined,
    Left,
    ReceiverContext,
    ReceiverEndpoint,
    SenderContext,
    SenderEndpoint,
    Transport,
    flag,
    index_refusal,
)

__all__ = ["InprocTransport"]

_table_lock = threading.Lock()
_channels: dict[str, _Channel] = {}
#: the default channel name: the process that made it, and a unique part
_DEFAULT_NAME = re.compile(r"inproc-([0-9]+)-[0-9a-f]{32}")


class _Channel:
    """What a sender and its receivers share: mailboxes (newest delivery per worker) and events."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.cond = threading.Condition()
        self.events: deque[Event] = deque()
        self.mailbox: dict[int, tuple[bytes, torch.Tensor]] = {}
        self.sender = False
        self.num_workers = 0  # the sender's, while it is open
        self.receivers: set[int] = set()

    @staticmethod
    def attach(name: str) -> _Channel:
        """The channel called ``name`` in this process's table. Raises TransportError for a default
        name made in another process: a scheme pickled into a process of its own, which no sender
        of this process's table will ever meet."""
        made = _DEFAULT_NAME.fullmatch(name)
        if made is not None and int(made[1]) != os.getpid():
            raise TransportError(f"inproc carries weights between threads of one process: channel {name!r} "
                                 f"was made in process {made[1]}, and this is process {os.getpid()}; between "
                                 f"processes use another transport (shm, mp, tcp, ...: `wsync transports`)")
        with _table_lock:
            channel = _channels.get(name)
            if channel is None:
                channel = _channels[name] = _Channel(name)
            return channel

    def detach_if_unused(self) -> None:
        with _table_lock, self.cond:
            if not self.sender and not self.receivers and _channels.get(self.name) is self:
                del _channels[self.name]


def _wake(endpoint: _Sender | _Receiver) -> None:
    """End the endpoint's wait in another thread, and every later one (the scheme shuts down)."""
    channel = endpoint.channel
    if channel is None:
        endpoint.woken = True
        return
    with channel.cond:
        endpoint.woken = True
        channel.cond.notify_all()


class _Sender(SenderEndpoint):
    prefix_publish = True
    def __init__(self, transport: InprocTransport, ctx: SenderContext) -> None:
        self.name = transport.options["channel"]
        self.nbytes = ctx.layout.nbytes
        self.num_workers = ctx.num_workers
        self.channel: _Channel | None = None
        self.woken = False

    def open(self, deadline: Deadline) -> None:
        channel = _Channel.attach(self.name)
        with channel.cond:
            if channel.sender:
                raise TransportError(f"inproc channel {self.name!r} already has a sender")
            channel.sender, channel.num_workers = True, self.num_workers
            channel.cond.notify_all()  # a receiver out of range waiting for it is told
        self.channel = channel

    def acquire(self, deadline: Deadline) -> Buffer:
        return Buffer(torch.empty(self.nbytes, dtype=torch.uint8))  # receivers keep what they got: always new

    def publish(self, buffer: Buffer, header: bytes, workers: Sequence[int]) -> None:
        channel = self.channel
        assert channel is not None  # (the core publishes between open and close)
        payload = buffer.payload
        with channel.cond:
            for w in workers:
                channel.mailbox[w] = (header, payload)
            channel.cond.notify_all()

    def poll(self, deadline: Deadline) -> list[Event]:
        channel = self.channel
        assert channel is not None  # (the core polls between open and close)
        with channel.cond:
            channel.cond.wait_for(lambda: channel.events or self.woken, deadline.seconds())
            events = list(channel.events)
            channel.events.clear()
        return events

    def wake(self) -> None:
        _wake(self)

    def close(self) -> None:
        channel, self.channel = self.channel, None
        if channel is None:
            return
        with channel.cond:
            channel.sender = False
            channel.mailbox.clear()
            channel.events.clear()
            channel.cond.notify_all()
        channel.detach_if_unused()


class _Receiver(ReceiverEndpoint):
    def __init__(self, transport: InprocTransport, ctx: ReceiverContext) -> None:
        self.name = transport.options["channel"]
        self.worker = ctx.worker_idx
        self.channel: _Channel | None = None
        self.woken = False

    def open(self, deadline: Deadline) -> None:
        channel = _Channel.attach(self.name)
        with channel.cond:
            if self.worker in channel.receivers:
                raise TransportError(f"inproc channel {self.name!r} already has a worker {self.worker}")
            why = self._refusal(channel)
            if why is not None:
                raise TransportError(why)
            channel.receivers.add(self.worker)
            channel.events.append(Joined(self.worker))
            channel.cond.notify_all()
        self.channel = channel

    def recv(self, deadline: Deadline) -> Delivery | None:
        channel = self.channel
        assert channel is not None  # (the core receives between open and close)
        with channel.cond:
            channel.cond.wait_for(lambda: self.worker in channel.mailbox or self.woken
                                  or self._refusal(channel) is not None, deadline.seconds())
            why = self._refusal(channel)
            if why is not None:
                raise TransportError(why)
            item = None if self.woken else channel.mailbox.pop(self.worker, None)
        return None if item is None else Delivery(item[0], item[1])

    def _refusal(self, channel: _Channel) -> str | None:
        """Why the channel's sender, if open, does not take this worker (its index out of range,
        a launcher's off-by-one), or None (caller holds ``channel.cond``)."""
        why = index_refusal(self.worker, channel.num_workers) if channel.sender else None
        return None if why is None else f"inproc channel {self.name!r}: {why}"

    def wake(self) -> None:
        _wake(self)

    def ack(self, data: bytes) -> None:
        channel = self.channel
        assert channel is not None  # (the core acks between open and close)
        with channel.cond:
            channel.events.append(Acked(self.worker, data))
            channel.cond.notify_all()

    def close(self) -> None:
        channel, self.channel = self.channel, None
        if channel is None:
            return
        with channel.cond:
            channel.receivers.discard(self.worker)
            channel.mailbox.pop(self.worker, None)
            if channel.sender:
                channel.events.append(Left(self.worker, "receiver shut down"))
            channel.cond.notify_all()
        channel.detach_if_unused()


class InprocTransport(Transport):
    """Receivers are threads of this process; ``channel`` names the meeting point (default: unique)."""

    name = "inproc"
    interface = 2
    capabilities = Capabilities(processes=False, zero_copy=True)

    def __init__(self, *, channel: str | None = None, checksum: bool = False) -> None:
        super().__init__(channel=channel or f"inproc-{os.getpid()}-{uuid.uuid4().hex}",
                         checksum=flag("inproc option checksum", checksum))

    def sender(self, ctx: SenderContext) -> SenderEndpoint:
        return _Sender(self, ctx)

    def receiver(self, ctx: ReceiverContext) -> ReceiverEndpoint:
        return _Receiver(self, ctx)


def open_channels() -> list[str]:
    """Names of the inproc channels alive in this process (for leak checks)."""
    with _table_lock:
        return sorted(_channels)


@hookimpl
def wsync_register_transports(register) -> None:
    register(InprocTransport)
