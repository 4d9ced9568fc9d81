"""What a transport hands the receiver as a payload. It may sit at any address (zmq's frame right
after its header does): the receiver reads it exactly, adopts nothing there that its dtypes cannot
be read from, and never crashes the worker (a typed torch copy of complex128 from an address that
is not a multiple of 16 ended it with SIGSEGV). One that is not a flat contiguous uint8 tensor is
the transport's fault: TransportError naming it, the model untouched."""

from __future__ import annotations

import threading

import pytest
import torch

from core_helpers import connect_both
from wsync_core import Delivery, TransportError, WeightSyncScheme
from wsync_core.inproc import InprocTransport, _Receiver

#: where each delivery's payload lands: an address this many bytes past a multiple of 64
SHIFTS = (1, 4, 8)


class _Moved(_Receiver):
    """Hands every payload over at an address ``shift`` bytes past a multiple of 64, as adoptable."""

    shift = 1

    def recv(self, deadline):
        delivery = super().recv(deadline)
        if delivery is None or delivery.payload.numel() == 0:
            return delivery
        n = delivery.payload.numel()
        room = torch.empty(n + 128, dtype=torch.uint8)
        start = -room.data_ptr() % 64 + self.shift
        moved = room[start:start + n]
        moved.copy_(delivery.payload)
        return Delivery(delivery.header, moved, adoptable=True)


def _moved_transport(shift: int) -> type:
    receiver = type(f"_Moved{shift}", (_Moved,), {"shift": shift})
    return type(f"Moved{shift}", (InprocTransport,),
                {"name": f"moved{shift}", "receiver": lambda self, ctx: receiver(self, ctx)})


def _model(n: int) -> dict[str, torch.Tensor]:
    return {"c": torch.zeros(n, dtype=torch.complex128), "d": torch.zeros(n, dtype=torch.float64),
            "f": torch.zeros(n, dtype=torch.float32), "h": torch.zeros(3, dtype=torch.bfloat16)}


def _fill(model: dict[str, torch.Tensor], v: float) -> None:
    for t in model.values():
        t.copy_(torch.arange(t.numel()).to(t.dtype) + v)


@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("n", [5, 200_000])  # small (one native copy) and large (typed copies, adoption)
@pytest.mark.parametrize("delta", [False, True])
def test_a_payload_at_any_address_is_applied_exactly(shift: int, n: int, delta: bool) -> None:
    trainer = _model(n)
    sender = WeightSyncScheme(_moved_transport(shift)(), delta=delta, timeout=30.0)
    sender.init_on_sender(model=trainer, num_workers=1)
    worker = _model(n)
    receiver = WeightSyncScheme(sender.transport, delta=delta, timeout=30.0)
    receiver.init_on_receiver(model=worker, worker_idx=0)
    connecting = threading.Thread(target=receiver.connect)
    connecting.start()
    sender.connect()
    connecting.join()
    try:
        for v in (1.0, 2.0, 3.0):
            _fill(trainer, v)
            if v == 3.0:
                trainer["c"][0] += 1j  # a delta of one element
            handle = sender.send_async()
            assert receiver.receive(timeout=30.0) == handle.wait()
            for key, t in worker.items():
                assert torch.equal(t, trainer[key]), (key, v)
                assert t.data_ptr() % t.element_size() == 0, key
                t.sum()  # a typed read of what the model holds
    finally:
        receiver.shutdown()
        sender.shutdown()


class _Strided(_Receiver):
    """Hands every payload over as a strided view (every other byte of a buffer twice its size)."""

    def recv(self, deadline):
        delivery = super().recv(deadline)
        if delivery is None:
            return None
        room = torch.zeros(2 * delivery.payload.numel(), dtype=torch.uint8)
        room[::2] = delivery.payload
        return Delivery(delivery.header, room[::2])


class _Int8(_Receiver):
    """Hands every payload over as int8."""

    def recv(self, deadline):
        delivery = super().recv(deadline)
        return None if delivery is None else Delivery(delivery.header, delivery.payload.view(torch.int8))


@pytest.mark.parametrize("receiver", [_Strided, _Int8])
def test_a_payload_that_is_not_flat_contiguous_uint8_is_named_and_changes_nothing(receiver: type) -> None:
    transport = type("Odd", (InprocTransport,), {"name": "odd", "receiver": lambda self, ctx: receiver(self, ctx)})
    sender = WeightSyncScheme(transport(), timeout=5.0)
    sender.init_on_sender(model=_model(4), num_workers=1)
    worker = _model(4)
    before = {k: t.clone() for k, t in worker.items()}
    scheme = WeightSyncScheme(sender.transport, timeout=5.0)
    scheme.init_on_receiver(model=worker, worker_idx=0)
    try:
        refused, error = connect_both(sender, scheme)
        assert refused is not None and "rejected version 0" in str(refused), refused
        assert isinstance(error, TransportError) and "a payload is a flat contiguous uint8 tensor" in str(error), error
        assert all(torch.equal(worker[k], before[k]) for k in worker)
    finally:
        scheme.shutdown()
        sender.shutdown()


def test_a_send_buffer_at_a_misaligned_address_is_named_before_anything_is_packed() -> None:
    """acquire() must hand out a flat contiguous uint8 tensor at a multiple of 64: one a byte off
    (a typed copy of complex128 into it could crash the trainer) fails the send by name."""
    from wsync_core import Buffer
    from wsync_core.inproc import _Sender

    class _OffByOne(_Sender):
        def acquire(self, deadline):
            buffer = super().acquire(deadline)
            room = torch.empty(buffer.tensor.numel() + 64, dtype=torch.uint8)
            start = -room.data_ptr() % 64 + 1
            return Buffer(room[start:start + buffer.tensor.numel()])

    transport = type("OffByOne", (InprocTransport,), {"name": "offbyone", "sender": lambda self, ctx: _OffByOne(self, ctx)})
    sender = WeightSyncScheme(transport(), timeout=5.0)
    sender.init_on_sender(model=_model(4), num_workers=1)
    with pytest.raises(TransportError, match=r"acquire\(\) returned a buffer of dtype torch.uint8.*multiple of 64"):
        sender.connect()
    sender.shutdown()
