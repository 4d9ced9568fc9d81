"""unix's own tests: options, and authentication (the suite cannot test how a peer authenticates)."""

from __future__ import annotations

import pytest
import torch
from wsync_core import Deadline, Joined, Layout, ReceiverContext, SenderContext, TransportError
from wsync_unix import UnixTransport

LAYOUT = Layout.of({"w": torch.zeros(16)})


def test_default_is_a_unique_name_with_a_key_and_options_are_checked() -> None:
    a, b = UnixTransport(), UnixTransport()
    assert a.options["name"] != b.options["name"] and a.options["authkey"] and "***" in repr(a)
    assert UnixTransport(name="x").options["authkey"] is None
    with pytest.raises(ValueError, match="name"):
        UnixTransport(name="a/b")


def test_a_wrong_key_is_refused_and_the_right_one_joins() -> None:
    transport = UnixTransport(name=f"test-auth-{id(object())}", authkey="right")
    sender = transport.sender(SenderContext(2, LAYOUT, "policy", torch.device("cpu")))
    sender.open(Deadline(10))
    receivers = []
    try:
        for worker, key in ((0, "wrong"), (1, "right")):
            t = UnixTransport(name=transport.options["name"], authkey=key)
            receivers.append(t.receiver(ReceiverContext(worker, LAYOUT, "policy", torch.device("cpu"))))
            receivers[-1].open(Deadline(10))
        with pytest.raises(TransportError, match="authentication failed"):
            receivers[0].recv(Deadline(30))
        events, deadline = [], Deadline(30)
        while Joined(1) not in events and not deadline.expired():
            events += sender.poll(Deadline(deadline.slice(0.5)))
        assert events == [Joined(1)]
    finally:
        for r in receivers:
            r.close()
        sender.close()


def test_a_worker_index_out_of_range_is_refused_with_the_reason() -> None:
    transport = UnixTransport()
    sender = transport.sender(SenderContext(1, LAYOUT, "policy", torch.device("cpu")))
    sender.open(Deadline(10))
    receiver = transport.receiver(ReceiverContext(5, LAYOUT, "policy", torch.device("cpu")))
    receiver.open(Deadline(10))
    try:
        with pytest.raises(TransportError, match=r"refused this worker: worker_idx 5 is out of range: "
                                                 r"this sender has 1 workers"):
            receiver.recv(Deadline(30))
        assert sender.poll(Deadline(0)) == []
    finally:
        receiver.close()
        sender.close()


@pytest.mark.parametrize("sender_key, worker_key, message", [
    ("key", None, "the sender requires authentication"),
    (None, "key", "does this worker have an authkey and the sender none"),
])
def test_a_key_on_one_side_only_is_named(sender_key, worker_key, message) -> None:
    name = f"test-one-key-{id(object())}"
    sender = UnixTransport(name=name, authkey=sender_key, heartbeat=1.0).sender(
        SenderContext(1, LAYOUT, "policy", torch.device("cpu")))
    sender.open(Deadline(10))
    receiver = UnixTransport(name=name, authkey=worker_key, heartbeat=1.0).receiver(
        ReceiverContext(0, LAYOUT, "policy", torch.device("cpu")))
    receiver.open(Deadline(10))
    try:
        with pytest.raises(TransportError, match=message):
            receiver.recv(Deadline(30))
        assert sender.poll(Deadline(0)) == []
    finally:
        receiver.close()
        sender.close()


def test_a_trainer_started_again_under_the_same_name_is_followed_from_its_version_0() -> None:
    """The trainer restarts (the same ``name``) while a worker runs on, holding the first trainer's
    version 3: the new trainer numbers from 0 again, and the worker takes each of its versions
    (headers name the sender that numbered them), never counting them as old."""
    import threading

    from wsync_core import WeightSyncScheme

    def model(value: float) -> dict[str, torch.Tensor]:
        return {"w": torch.full((1024,), value)}

    worker_model = model(-1.0)
    worker = WeightSyncScheme("unix", name="wsync-test-restart", timeout=10.0)
    worker.init_on_receiver(model=worker_model, worker_idx=0)
    for first, start in ((True, 0.0), (False, 100.0)):
        trainer_model = model(start)
        trainer = WeightSyncScheme("unix", name="wsync-test-restart", timeout=10.0)
        trainer.init_on_sender(model=trainer_model, num_workers=1)
        try:
            if first:
                connecting = threading.Thread(target=worker.connect)
                connecting.start()
                trainer.connect()
                connecting.join()
            else:  # the worker reconnects by itself; its receive() takes version 0 of the new trainer
                handle = threading.Thread(target=trainer.connect)
                handle.start()
                deadline = Deadline(30)
                while (worker.version != 0 or worker_model["w"][0] != start) and not deadline.expired():
                    worker.receive(timeout=0.1)
                assert worker.version == 0 and worker_model["w"][0] == start
                handle.join()
            for v in (1, 2, 3):
                trainer_model["w"].fill_(start + v)
                sent = trainer.send_async()
                assert worker.receive(timeout=10.0) == v and sent.wait() == v
                assert torch.equal(worker_model["w"], trainer_model["w"]), (first, v)
        finally:
            trainer.shutdown()
    worker.shutdown()
