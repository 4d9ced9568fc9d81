"""Faults: receivers and senders killed with SIGKILL, and what they leave in /dev/shm (nothing)."""

from __future__ import annotations

import os
import time
import uuid

import pytest
from shm_procs import fill, make_model, receiver_main, sender_main

from wsync_core import TransportError, WeightSyncScheme, WorkerTimeoutError
from wsync_shm.slot import SHM_DIR


def leftovers(name: str) -> list[str]:
    return sorted(e for e in os.listdir(SHM_DIR) if e.startswith(f"wsync-{name}-"))


def wait_until(check, timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.02)
    return check()


def test_receiver_killed_is_named_by_the_next_send(spawn) -> None:
    name = f"t-{uuid.uuid4().hex[:12]}"
    model = make_model()
    fill(model, 0)
    scheme = WeightSyncScheme("shm", timeout=30.0, name=name)
    scheme.init_on_sender(model=model, num_workers=2)
    try:
        workers = [spawn(receiver_main, scheme, i) for i in range(2)]
        scheme.connect()
        for _, conn in workers:
            assert conn.recv() == ("connected", 0, True)
        victim, _ = workers[1]
        victim.kill()
        victim.join(30)
        alive = workers[0][1]
        fill(model, 1)
        alive.send(("receive", 30.0))  # worker 0 waits for the next version
        start = time.monotonic()
        with pytest.raises(WorkerTimeoutError) as info:
            scheme.send()
        assert info.value.workers == [1]
        assert time.monotonic() - start < 25.0  # the dead socket is noticed, not waited out
        assert alive.recv() == ("ok", 1, 1, True)
        for v in (2, 3):
            fill(model, v)
            alive.send(("receive", 30.0))
            assert scheme.send(worker_ids=[0]) == v
            assert alive.recv() == ("ok", v, v, True)
        alive.send(("quit", None))
        assert alive.recv() == ("bye",)
    finally:
        scheme.shutdown()
    assert leftovers(name) == []


def test_sender_killed_receiver_keeps_its_version_then_follows_one_started_again(spawn) -> None:
    """A trainer SIGKILLed after version 2: the receiver (built independently in this process,
    from the ``name`` alone) keeps version 2 exactly, its receive() raises TransportError, and
    nothing is left in /dev/shm. The trainer started again with the same ``name`` (from its
    checkpoint) is found by the receiver, which kept calling receive(), by itself: it holds the
    new one's versions, numbered from 0 again, exactly. Before, every receive() raised
    TransportError until the worker was started again too."""
    name = f"t-{uuid.uuid4().hex[:12]}"
    first, conn = spawn(sender_main, {"name": name}, 1)
    assert conn.recv() == ("init",)
    model, expected = make_model(), make_model()
    receiver = WeightSyncScheme("shm", timeout=30.0, name=name)
    receiver.init_on_receiver(model=model, worker_idx=0)
    try:
        receiver.connect()
        assert conn.recv() == ("connected",)
        for v in (1, 2):
            conn.send(("send", v))
            assert receiver.receive(timeout=30.0) == v
            assert conn.recv() == ("sent", v)
        assert leftovers(name)
        first.kill()
        first.join(30)
        with pytest.raises(TransportError, match="closed the connection.*connects to a sender started again"):
            receiver.receive(timeout=0.2)
        fill(expected, 2)
        assert receiver.version == 2 and all(model[k].equal(expected[k]) for k in model)
        assert leftovers(name) == []
        again, conn = spawn(sender_main, {"name": name}, 1)
        assert conn.recv() == ("init",)
        for v in (0, 1):  # the new sender's connect() (its version 0), then a send
            if v:
                conn.send(("send", 10 + v))
            end = time.monotonic() + 30
            while receiver.version != v and time.monotonic() < end:
                try:
                    receiver.receive(timeout=0.5)
                except TransportError:
                    pass  # the sender gone: until the new one is there
            assert conn.recv() == (("connected",) if v == 0 else ("sent", 1))
            fill(expected, 10 + v if v else 0)
            assert receiver.version == v and all(model[k].equal(expected[k]) for k in model)
        again.kill()
        again.join(30)
    finally:
        receiver.shutdown()
    assert wait_until(lambda: leftovers(name) == [])


def test_sender_killed_before_any_receiver_leaves_nothing(spawn) -> None:
    name = f"t-{uuid.uuid4().hex[:12]}"
    sender, conn = spawn(sender_main, {"name": name}, 1)
    assert conn.recv() == ("init",)
    assert wait_until(lambda: len(leftovers(name)) == 2), "the sender never created its two slots"
    sender.kill()
    sender.join(30)
    assert wait_until(lambda: leftovers(name) == []), f"left in {SHM_DIR}: {leftovers(name)}"
