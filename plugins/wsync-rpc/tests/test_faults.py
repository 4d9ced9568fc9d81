"""Faults with real processes and a real RPC group: a worker that dies, a worker that never comes, a
sender that does not answer acks."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest
from wsync_core import TransportError, WeightSyncScheme, WorkerTimeoutError

sys.path.insert(0, os.path.dirname(__file__))
from rpc_worker import weights  # noqa: E402


def _sender(n: int, **options):
    scheme = WeightSyncScheme("rpc", timeout=90.0, rpc_timeout=20.0, **options)
    w = weights(0.0)
    scheme.init_on_sender(weights=w, num_workers=n)
    return scheme, w


def test_dead_worker_is_named_and_the_others_are_updated(workers):
    scheme, w = _sender(2)
    opts = scheme.transport.options
    procs = [workers({"options": opts, "idx": i, "until": 3, "run_s": 120}) for i in range(2)]
    try:
        scheme.connect()
        procs[1].proc.send_signal(signal.SIGKILL)
        procs[1].proc.wait(30)
        for t in w.values():
            t.fill_(1)
        t0 = time.monotonic()
        with pytest.raises(WorkerTimeoutError) as info:
            scheme.send(timeout=5.0)
        assert info.value.workers == [1]
        assert time.monotonic() - t0 < 5.0 + 10.0
        for v in (2, 3):  # the scheme stays usable for the survivor
            for t in w.values():
                t.fill_(v)
            assert scheme.send(worker_ids=[0]) == v
    finally:
        scheme.shutdown()
    applied = [line["version"] for line in procs[0].lines() if line["event"] == "applied"]
    assert applied[0] == 0 and applied[-1] == 3 and 1 in applied


def test_an_ack_that_has_not_landed_holds_no_receive(workers, monkeypatch):
    """The sender's RPC handler holds worker 0's acks (as a sender whose RPC threads are busy does,
    or a link cut while an ack waits for its reply): the worker's ``receive(timeout=0.5)`` calls keep
    their timeout and apply the version that reaches it meanwhile; once the handler runs again every
    ack lands, in order, and a synchronous send completes."""
    from wsync_core import Acked
    from wsync_rpc.endpoints import RpcSender

    held, release = threading.Event(), threading.Event()
    emit = RpcSender.emit

    def slow(self, event) -> None:  # (runs in the RPC handler of the worker's ack: its reply waits)
        if isinstance(event, Acked) and held.is_set():
            release.wait(60)
        emit(self, event)

    monkeypatch.setattr(RpcSender, "emit", slow)
    scheme, w = _sender(1)
    proc = workers({"options": scheme.transport.options, "idx": 0, "until": 3, "run_s": 120})
    try:
        scheme.connect()
        held.set()
        for v in (1, 2):  # version 1's ack is held; version 2 comes while it waits
            for t in w.values():
                t.fill_(v)
            scheme.send_async()
            time.sleep(4.0)
        release.set()
        for t in w.values():
            t.fill_(3)
        assert scheme.send(timeout=30.0) == 3  # acks flow again: every one landed
    finally:
        release.set()
        scheme.shutdown()
    lines = proc.lines()
    applied = [line["version"] for line in lines if line["event"] == "applied"]
    assert applied == [0, 1, 2, 3], lines
    done = next(line for line in lines if line["event"] == "done")
    assert done["slowest"] < 0.5 + 3.0, done  # (before: version 2's receive waited for version 1's ack, 4 s)


def test_missing_worker_is_named_at_connect(workers):
    """RPC's world is static: every worker must join at start; connect() names the one that did not."""
    scheme, _ = _sender(2)
    proc = workers({"options": scheme.transport.options, "idx": 0, "timeout": 5.0})
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerTimeoutError) as info:
            scheme.connect(timeout=3.0)
        assert 1 in info.value.workers  # worker 0 waits for the RPC group too: it cannot start without 1
        assert time.monotonic() - t0 < 3.0 + 15.0
    finally:
        scheme.shutdown()
    errors = [line for line in proc.lines() if line["event"] == "error"]
    assert errors, "worker 0 connected although worker 1 never joined the RPC group"


def test_one_agent_per_process():
    """A second endpoint in a process that holds one raises; after shutdown() the process may host another."""
    first, _ = _sender(1)
    second, _ = _sender(1)
    try:
        with pytest.raises(WorkerTimeoutError):
            first.connect(timeout=1.0)  # no worker comes; the sender stays open
        with pytest.raises(TransportError, match="one per process"):
            second.connect(timeout=1.0)
        first.shutdown()
        third, _ = _sender(1)
        try:
            with pytest.raises(WorkerTimeoutError):
                third.connect(timeout=1.0)
        finally:
            third.shutdown()
    finally:
        first.shutdown()
        second.shutdown()
