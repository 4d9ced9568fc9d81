"""mp's control frames from a worker: what taking and applying a version sends, and when."""

from __future__ import annotations

import pickle
import select
import threading
import time
from typing import Any

import torch
from torch import nn
from wsync_core import Deadline, StateError, WeightSyncScheme
from wsync_mp.wire import FRAMING, Kind


class _CountingSocket:
    """A worker's socket that records each ``send`` call's bytes (everything else passes through)."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self.sent: list[bytes] = []

    def send(self, data: Any, *flags: int) -> int:
        n = self._sock.send(data, *flags)
        self.sent.append(bytes(data[:n]))
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    def kinds(self) -> list[list[Kind]]:
        """The frame kinds of each send, in order."""
        return [[f.kind for f in FRAMING.reader("a worker", frozenset(Kind)).feed(chunk)] for chunk in self.sent]


def _pair() -> tuple[WeightSyncScheme, nn.Module, WeightSyncScheme, _CountingSocket]:
    """A connected mp sender (sync=False) and one receiver in this process, the receiver's socket counted."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    sender = WeightSyncScheme("mp", timeout=30.0, sync=False)
    sender.init_on_sender(model=model, num_workers=1)
    receiver: WeightSyncScheme = pickle.loads(pickle.dumps(sender))
    receiver.init_on_receiver(model=nn.Linear(8, 8), worker_idx=0)
    t = threading.Thread(target=receiver.connect)
    t.start()
    sender.connect()
    t.join()
    endpoint = receiver._role.endpoint
    counting = endpoint.sock = _CountingSocket(endpoint.sock)
    return sender, model, receiver, counting


def test_seen_and_release_go_out_with_the_ack_in_one_send() -> None:
    """Taking a version (SEEN), giving its slot back after the copy (RELEASE) and the ack reach the
    sender in one send: one wake-up of its I/O thread per version, not three."""
    sender, model, receiver, counting = _pair()
    try:
        with torch.no_grad():
            model.weight.add_(1.0)
        handle = sender.send_async()
        assert receiver.receive(timeout=30.0) == 1
        handle.wait()
        kinds = counting.kinds()
        assert [Kind.SEEN, Kind.RELEASE, Kind.ACK] in kinds, kinds
        assert all(Kind.ACK in k for k in kinds if Kind.SEEN in k or Kind.RELEASE in k), kinds
    finally:
        receiver.shutdown()
        sender.shutdown()


def test_held_frames_never_wait_on_a_worker_that_does_not_ack() -> None:
    """A delivery taken and never acked (the worker stopped between): its SEEN goes out at the
    latest with the second recv() after it, or before a recv() that waits, so the sender goes on
    notifying newer versions."""
    sender, model, receiver, counting = _pair()
    endpoint = receiver._role.endpoint
    try:
        sender.send_async()
        delivery = endpoint.recv(Deadline(30.0))
        assert delivery is not None
        delivery.release()
        assert endpoint.recv(Deadline(0.0)) is None
        assert not any(Kind.SEEN in k for k in counting.kinds()), "held until an ack or the next recv()"
        assert endpoint.recv(Deadline(0.0)) is None
        assert [Kind.SEEN, Kind.RELEASE] in counting.kinds()
        sender.send_async()  # notified only because the sender saw the SEEN
        assert receiver.receive(timeout=30.0) == 2

        sender.send_async()
        delivery = endpoint.recv(Deadline(30.0))
        assert delivery is not None
        delivery.release()
        sent = len(counting.sent)
        assert endpoint.recv(Deadline(0.05)) is None  # nothing comes: it waits, after sending what it held
        assert counting.kinds()[sent:] == [[Kind.SEEN, Kind.RELEASE]]
    finally:
        receiver.shutdown()
        sender.shutdown()


def test_a_receive_waits_on_the_socket_itself() -> None:
    """The receiver starts no thread: the notification wakes the receive waiting for it (no hand-off
    from a reader thread), and ``shutdown()`` from another thread ends that wait at once."""
    before = {t.ident for t in threading.enumerate()}
    sender, model, receiver, _ = _pair()
    got: list[Any] = []
    try:
        started = [t.name for t in threading.enumerate() if t.ident not in before]
        assert all(name.startswith(("wsync-mp-sender", "wsync-sender")) for name in started), started
        waiting = threading.Thread(target=lambda: got.append(receiver.receive(timeout=120.0)))
        waiting.start()
        sender.send_async()
        waiting.join(60.0)
        assert got == [1]

        def wait_for_the_next() -> None:
            try:
                receiver.receive(timeout=120.0)
            except StateError as exc:
                got.append(exc)

        waiting = threading.Thread(target=wait_for_the_next)
        waiting.start()
        time.sleep(0.2)  # (it may or may not wait yet: shutdown ends it either way)
        receiver.shutdown()  # wakes the receive waiting on its socket, long before 120 s
        waiting.join(60.0)
        assert not waiting.is_alive() and isinstance(got[1], StateError), got
    finally:
        receiver.shutdown()
        sender.shutdown()


def test_a_waiting_notification_is_probed_only_when_something_newer_is_pending() -> None:
    """A worker back from a rollout finds a notification waiting: if the sender's board says it is
    the newest published to this worker, the receive takes it without a round trip to the sender;
    if a newer one is pending in the sender, it probes and applies that one."""
    sender, model, receiver, counting = _pair()
    endpoint = receiver._role.endpoint
    try:
        sender.send_async()
        assert select.select([endpoint.sock], [], [], 30.0)[0], "the notification never came"
        assert receiver.receive(timeout=30.0) == 1
        assert not any(Kind.PROBE in k for k in counting.kinds()), counting.kinds()

        sender.send_async()  # version 2, notified and left waiting
        assert select.select([endpoint.sock], [], [], 30.0)[0], "the notification never came"
        sender.send_async()  # version 3 stays pending in the sender: version 2 was not taken yet
        assert receiver.receive(timeout=30.0) == 3
        assert any(Kind.PROBE in k for k in counting.kinds()), counting.kinds()
        assert endpoint.probes == 1
    finally:
        receiver.shutdown()
        sender.shutdown()
