"""The shm transport's own behaviour: slots, stale notifications, names, framing."""

from __future__ import annotations

import os
import socket
import uuid

import pytest
import torch
from shm_procs import fill, holds, make_model, receiver_main

from wsync_core import Deadline, Layout, TransportError, WeightSyncScheme
from wsync_core.protocol import MAX_ACK_BYTES
from wsync_core.transport import Acked, Joined, Left, SenderContext
from wsync_shm import ShmTransport, wire
from wsync_shm.slot import SHM_DIR, Slot
from wsync_shm.wire import FRAMING, Kind


def slot_files(name: str) -> list[str]:
    return sorted(e for e in os.listdir(SHM_DIR) if e.startswith(f"wsync-{name}-"))


@pytest.fixture
def group():
    """An async sender and ``n`` receivers in this thread: ``group(n, **options)`` -> (name, sender, model, receivers)."""
    made: list[WeightSyncScheme] = []

    def build(n: int, **options):
        name = f"t-{uuid.uuid4().hex[:12]}"
        model = make_model()
        fill(model, 0)
        sender = WeightSyncScheme("shm", sync=False, timeout=30.0, name=name, **options)
        sender.init_on_sender(model=model, num_workers=n)
        made.append(sender)
        receivers = []
        for i in range(n):
            r = WeightSyncScheme("shm", timeout=30.0, name=name, **options)
            r.init_on_receiver(model=make_model(), worker_idx=i)
            made.append(r)
            receivers.append(r)
        handle_connect(sender, receivers)
        return name, sender, model, receivers

    yield build
    for scheme in made:
        scheme.shutdown()


def handle_connect(sender: WeightSyncScheme, receivers: list[WeightSyncScheme]) -> None:
    import threading

    t = threading.Thread(target=sender.connect)
    t.start()
    for r in receivers:
        r.connect()
    t.join(60)
    assert sender.version == 0


def model_of(r: WeightSyncScheme) -> dict[str, torch.Tensor]:
    return r._role.source  # the receiver's model, as given to init_on_receiver


def test_sync_rounds_use_two_slots(group) -> None:
    name, sender, model, receivers = group(2)
    for v in range(1, 11):
        fill(model, v)
        handle = sender.send_async()
        assert [r.receive(timeout=30.0) for r in receivers] == [v, v]
        assert handle.wait() == v
        assert all(holds(model_of(r), v) for r in receivers)
    assert len(slot_files(name)) == 2


def test_lagging_and_subset_receivers_get_their_newest_version(group) -> None:
    name, sender, model, (r0, r1, r2) = group(3)
    fill(model, 1)
    sender.send_async(worker_ids=[0])  # r0 does not read it yet
    for v in (2, 3, 4):
        fill(model, v)
        sender.send_async(worker_ids=[1])
        assert r1.receive(timeout=30.0) == v
    assert r2.receive(timeout=0.0) is None  # never targeted
    assert r0.receive(timeout=30.0) == 1 and holds(model_of(r0), 1)
    assert holds(model_of(r1), 4) and holds(model_of(r2), 0)
    for v in (5, 6, 7):  # nobody reads: only the newest matters
        fill(model, v)
        sender.send_async()
    assert [r.receive(timeout=30.0) for r in (r0, r1, r2)] == [7, 7, 7]
    assert all(holds(model_of(r), 7) for r in (r0, r1, r2))
    assert len(slot_files(name)) <= 3 + 2


def test_a_version_sent_while_a_receive_holds_the_one_before_is_the_next_receive(group, monkeypatch) -> None:
    """A receive looks for a newer delivery before applying the one it took without reading the
    socket again (it was just emptied): one published in between is not lost, nor applied out of
    order; the next receive, a poll included, applies it."""
    from wsync_shm import transport as shm_transport

    name, sender, model, (r0,) = group(1)
    take = shm_transport._Receiver._take
    sent: list[int] = []

    def take_then_publish(endpoint):
        delivery = take(endpoint)
        if delivery is not None and not sent:  # the receiver holds version 1: publish version 2 now
            fill(model, 2)
            sent.append(sender.send_async().version)
        return delivery

    monkeypatch.setattr(shm_transport._Receiver, "_take", take_then_publish)
    fill(model, 1)
    sender.send_async()
    assert r0.receive(timeout=30.0) == 1 and holds(model_of(r0), 1)
    assert sent == [2]
    assert r0.receive(timeout=0.0) == 2 and holds(model_of(r0), 2)
    assert r0.receive(timeout=0.0) is None


def test_zero_copy_receivers_view_a_pinned_slot_and_write_privately(group) -> None:
    name, sender, model, (r0, r1) = group(2, zero_copy=True)
    w0 = model_of(r0)["w"]
    fill(model, 1)
    sender.send_async()
    assert [r.receive(timeout=30.0) for r in (r0, r1)] == [1, 1]
    assert model_of(r0)["w"] is w0  # the same tensor object, now viewing the slot
    w0.fill_(-1.0)  # a worker's own write stays its own
    assert holds(model_of(r1), 1)
    for v in (2, 3, 4, 5):  # r0 pins the slot holding version 1; the sender never writes it
        fill(model, v)
        sender.send_async(worker_ids=[1])
        assert r1.receive(timeout=30.0) == v and holds(model_of(r1), v)
    assert torch.all(w0 == -1.0) and model_of(r0)["step"].item() == 1
    assert len(slot_files(name)) == 3  # the pinned one, and two for r1's versions
    fill(model, 6)
    sender.send_async()
    assert [r.receive(timeout=30.0) for r in (r0, r1)] == [6, 6]
    assert holds(model_of(r0), 6) and holds(model_of(r1), 6)


def test_a_zero_copy_worker_that_writes_its_model_gets_each_reused_slot_exactly(group) -> None:
    """A worker keeps one private mapping per slot across deliveries: the pages it wrote (all of a
    tensor, scattered elements, a swapped-out page alike) are dropped when the slot goes back, so a
    version that comes later in the same slot is exact, never the worker's old writes."""
    _, sender, model, (r0,) = group(1, zero_copy=True)
    for v in range(1, 13):  # two slots, each reused five times
        fill(model, v)
        sender.send_async()
        assert r0.receive(timeout=30.0) == v
        mine = model_of(r0)
        assert holds(mine, v), v
        if v % 3 == 0:
            mine["w"].fill_(-1.0)  # every page of the payload's largest tensor
        else:
            mine["w"][v::997].fill_(-2.0)  # a few scattered pages
        mine["step"].fill_(-v)


@pytest.mark.parametrize("zero_copy", [True, False])
def test_a_receive_in_inference_mode_leaves_tensors_the_model_can_train_with(group, zero_copy) -> None:
    """A rollout loop that receives under ``torch.inference_mode()``: the tensors it is left with
    (views of a slot, with zero-copy) must not be inference tensors, which autograd refuses to save
    and a later receive outside inference mode could not write."""
    _, sender, model, (r0,) = group(1, zero_copy=zero_copy)
    for v in (1, 2):
        fill(model, v)
        sender.send_async()
        with torch.inference_mode():
            assert r0.receive(timeout=30.0) == v
        mine = model_of(r0)
        assert holds(mine, v) and not any(t.is_inference() for t in mine.values())
        x = torch.ones_like(mine["w"], requires_grad=True)
        (x * mine["w"]).sum().backward()  # saves the model's tensor for backward
    fill(model, 3)
    sender.send_async()
    assert r0.receive(timeout=30.0) == 3 and holds(model_of(r0), 3)


def test_zero_copy_takes_the_slots_memory_and_copy_mode_keeps_the_models(group) -> None:
    for zero_copy in (True, False, None):
        _, sender, model, (r0,) = group(1, zero_copy=zero_copy)  # explicit: the model is small
        before = model_of(r0)["w"].data_ptr()
        fill(model, 1)
        sender.send_async()
        assert r0.receive(timeout=30.0) == 1 and holds(model_of(r0), 1)
        assert (model_of(r0)["w"].data_ptr() != before) is bool(zero_copy)  # None: small models are copied


def test_a_receiver_shut_down_keeps_its_weights_while_the_slot_is_reused(group) -> None:
    _, sender, model, (r0, r1) = group(2, zero_copy=True)
    fill(model, 1)
    sender.send_async()
    assert [r.receive(timeout=30.0) for r in (r0, r1)] == [1, 1]
    kept = model_of(r0)
    r0.shutdown()  # unpins its slot: the model gets its own copy first
    for v in (2, 3, 4):
        fill(model, v)
        sender.send_async(worker_ids=[1])
        assert r1.receive(timeout=30.0) == v
    assert holds(kept, 1)


def test_trainer_writes_after_send_do_not_reach_receivers(group) -> None:
    _, sender, model, (r0,) = group(1)
    fill(model, 1)
    sender.send_async()
    fill(model, 99)  # the live tensors change before the receiver reads
    assert r0.receive(timeout=30.0) == 1 and holds(model_of(r0), 1)


def test_a_second_sender_with_the_same_name_is_refused(group) -> None:
    name, *_ = group(1)
    other = WeightSyncScheme("shm", timeout=5.0, name=name)
    other.init_on_sender(model=make_model(), num_workers=1)
    try:
        with pytest.raises(TransportError, match="already in use"):
            other.connect()
    finally:
        other.shutdown()


def test_a_second_receiver_with_the_same_index_is_refused(group) -> None:
    name, *_ = group(1)
    twin = WeightSyncScheme("shm", timeout=10.0, name=name)
    twin.init_on_receiver(model=make_model(), worker_idx=0)
    try:
        with pytest.raises(TransportError, match="already connected"):
            twin.connect()
    finally:
        twin.shutdown()


def test_a_worker_back_under_its_index_is_welcomed_while_its_old_connection_still_holds_unread_acks() -> None:
    """A worker that acked, closed and came back before the sender read its old connection to the
    end: the old connection's acks come first, then its Left, then the new one's Joined (it was once
    refused as 'already connected' when the old one had more than one read of acks left)."""
    name = f"t-{uuid.uuid4().hex[:12]}"
    model = make_model()
    endpoint = ShmTransport(name=name).sender(SenderContext(1, Layout.of(model), "m", torch.device("cpu")))
    deadline = Deadline(30.0)
    endpoint.open(deadline)
    old = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    new = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)  # all the acks fit before any is read
        old.connect(wire.address(name))
        old.sendall(FRAMING.encode(Kind.HELLO, arg=0))
        assert [type(e) for e in endpoint.poll(deadline)] == [Joined]
        acks = 6 * 65536 // (MAX_ACK_BYTES // 4)  # six of the sender's reads
        old.sendall(b"".join(FRAMING.encode(Kind.ACK, bytes(MAX_ACK_BYTES // 4)) for _ in range(acks)))
        old.close()
        new.connect(wire.address(name))
        new.sendall(FRAMING.encode(Kind.HELLO, arg=0))
        events: list = []
        while not any(isinstance(e, Joined) for e in events) and not deadline.expired():
            events += endpoint.poll(deadline)
        assert [type(e) for e in events] == [Acked] * acks + [Left, Joined]
        reply = next(iter(FRAMING.reader("the sender", accept=[Kind.WELCOME, Kind.REFUSE]).feed(new.recv(4096))))
        assert reply.kind == Kind.WELCOME
    finally:
        old.close()
        new.close()
        endpoint.close()


def test_independent_receiver_process_finds_the_sender_by_name(spawn) -> None:
    name = f"t-{uuid.uuid4().hex[:12]}"
    model = make_model()
    fill(model, 0)
    sender = WeightSyncScheme("shm", timeout=30.0, name=name)
    sender.init_on_sender(model=model, num_workers=1)
    try:
        _, conn = spawn(receiver_main, {"name": name}, 0)  # options only: no pickled scheme
        sender.connect()
        assert conn.recv() == ("connected", 0, True)
        fill(model, 1)
        conn.send(("receive", 30.0))
        assert sender.send() == 1
        assert conn.recv() == ("ok", 1, 1, True)
        conn.send(("quit", None))
        assert conn.recv() == ("bye",)
    finally:
        sender.shutdown()
    assert slot_files(name) == []


def test_names_are_checked_and_travel_with_the_pickle() -> None:
    import pickle

    for bad in ("../etc", ""):  # an empty name was replaced by a random one: workers made apart never met the sender
        with pytest.raises(ValueError, match="shm name"):
            ShmTransport(name=bad)
    t = ShmTransport()
    assert pickle.loads(pickle.dumps(t)).options == t.options


def test_a_slot_creation_cut_short_by_ctrl_c_is_made_again(group, monkeypatch) -> None:
    """Ctrl-C in the trainer while send() adds a slot (a 200 MiB one takes a while to allocate):
    the next slot of that index is made, and sends go on. Every later send raised TransportError
    'File exists' before (found by an outside audit: SIGINT into send() with a slow worker)."""
    name, sender, model, (receiver,) = group(1)
    endpoint = sender._role.endpoint
    slots = len(slot_files(name))
    create = Slot.create

    def interrupted(path: str, nbytes: int, device=None) -> Slot:
        create(path, nbytes, device).close()  # the file is made, then the interrupt comes
        raise KeyboardInterrupt

    monkeypatch.setattr(Slot, "create", interrupted)
    with pytest.raises(KeyboardInterrupt):
        endpoint._new_slot()
    monkeypatch.undo()
    endpoint._new_slot()
    assert len(slot_files(name)) == slots + 1
    for v in (1, 2):
        fill(model, v)
        handle = sender.send_async()
        assert receiver.receive(timeout=30.0) == v and handle.wait() == v
        assert holds(model_of(receiver), v)
