"""A receiver on another "host": its own network and PID namespaces, on a bridge with this process
(root only). Its own PID namespace too, as on another machine: within one, TensorPipe moves
payloads by ``cma`` (reading the other process's memory), and only control messages would cross
the bridge."""

from __future__ import annotations

import multiprocessing
import os
import sys

import pytest
from wsync_conformance import netns
from wsync_core import WeightSyncScheme

sys.path.insert(0, os.path.dirname(__file__))
from rpc_worker import weights  # noqa: E402


@pytest.fixture
def hosts():
    """The machine's own network (the sender) and a namespace (the receiver) on one bridge."""
    if (reason := netns.available()) is not None:
        pytest.skip(reason)
    with netns.hosts(2, local=True) as pair:
        yield pair


def _sender(options: dict, out) -> None:
    """The trainer, in a fresh process: torch fixes TensorPipe's listen address at a process's
    first RPC agent, and pytest's process has already run loopback agents."""
    scheme = WeightSyncScheme("rpc", timeout=20.0, **options)
    w = weights(0.0)
    scheme.init_on_sender(weights=w, num_workers=1)
    sent = []
    try:
        scheme.connect()
        for v in (1, 2):
            for t in w.values():
                t.fill_(v)
            sent.append(scheme.send())
    finally:
        scheme.shutdown()
        out.put(sent)


def test_receiver_in_another_namespace(hosts, workers):
    here, there = hosts
    options = WeightSyncScheme("rpc", host=here.address, rpc_timeout=20.0, world_size=2).transport.options
    proc = workers({"options": options, "idx": 0, "until": 2},
                   prefix=(*there.prefix, "unshare", "--pid", "--fork", "--mount-proc"))
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    sender = ctx.Process(target=_sender, args=(options, out))
    sender.start()
    try:
        assert out.get(timeout=120) == [1, 2]
    finally:
        sender.join(30)
        if sender.is_alive():
            sender.kill()
    applied = [line for line in proc.lines() if line["event"] == "applied"]
    assert [line["version"] for line in applied] == [0, 1, 2]
    assert applied[-1]["sum"] == 2.0 * 32
    assert options["checksum"] is True  # across hosts, by default
