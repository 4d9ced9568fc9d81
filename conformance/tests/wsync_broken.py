"""Broken transports, each derived from ``inproc`` and each violating one guarantee in a way
the core cannot mask. The suite must fail each of them under that guarantee.

Run one: ``PYTHONPATH=conformance/tests wsync conformance wsync_broken:FlippedByte``.
"""

from __future__ import annotations

import json
import pickle
import threading
from collections.abc import Sequence

import torch
from wsync_core import Delivery, ReceiverContext, SenderContext
from wsync_core.inproc import InprocTransport, _Receiver, _Sender

__all__ = ["BROKEN", "FlippedByte", "DroppedAck", "HalfPayload", "OldVersion", "WrongWorker", "LeakedThread",
           "UnpickledPayload"]


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


class _Misroute(_Sender):
    def __init__(self, transport, ctx: SenderContext) -> None:
        super().__init__(transport, ctx)
        self.num_workers = ctx.num_workers

    def publish(self, buffer: torch.Tensor, header: bytes, workers: Sequence[int]) -> None:
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


FlippedByte = _transport("FlippedByte", receiver=_Flip)
DroppedAck = _transport("DroppedAck", receiver=_DropAck)
HalfPayload = _transport("HalfPayload", receiver=_Half)
OldVersion = _transport("OldVersion", receiver=_Old)
WrongWorker = _transport("WrongWorker", sender=_Misroute)
LeakedThread = _transport("LeakedThread", sender=_Leaky)
UnpickledPayload = _transport("UnpickledPayload", receiver=_Unpickle)

#: broken transport -> the guarantee it breaks
BROKEN: dict[str, str] = {
    "FlippedByte": "exact",
    "DroppedAck": "versioned",
    "HalfPayload": "atomic",
    "OldVersion": "versioned",
    "WrongWorker": "targeted",
    "LeakedThread": "clean",
    "UnpickledPayload": "safe",
}
