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


def test_sender_killed_receiver_keeps_its_version_and_nothing_is_left(spawn) -> None:
    """The receiver is built independently in this process, from the ``name`` alone."""
    name = f"t-{uuid.uuid4().hex[:12]}"
    sender, conn = spawn(sender_main, {"name": name}, 1)
    assert conn.recv() == ("init",)
    model = make_model()
    receiver = WeightSyncScheme("shm", timeout=30.0, name=name)
    receiver.init_on_receiver(model=model, worker_idx=0)
    try:
        receiver.connect()
        assert conn.recv() == ("connected",)
        conn.send(("send", 1))
        assert receiver.receive(timeout=30.0) == 1
        assert conn.recv() == ("sent", 1)
        assert leftovers(name)
        sender.kill()
        sender.join(30)
        with pytest.raises(TransportError, match="closed the connection"):
            receiver.receive(timeout=5.0)
        assert receiver.version == 1
        expected = make_model()
        fill(expected, 1)
        assert all(model[k].equal(expected[k]) for k in model)
        assert leftovers(name) == []
    finally:
        receiver.shutdown()
    assert leftovers(name) == []


def test_sender_killed_before_any_receiver_leaves_nothing(spawn) -> None:
    name = f"t-{uuid.uuid4().hex[:12]}"
    sender, conn = spawn(sender_main, {"name": name}, 1)
    assert conn.recv() == ("init",)
    assert wait_until(lambda: len(leftovers(name)) == 2), "the sender never created its two slots"
    sender.kill()
    sender.join(30)
    assert wait_until(lambda: leftovers(name) == []), f"left in {SHM_DIR}: {leftovers(name)}"
