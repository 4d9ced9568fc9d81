"""A receiver on another "host": its own network namespace, on a bridge with this process (root only)."""

from __future__ import annotations

import os
import sys

import pytest
from wsync_conformance import netns
from wsync_core import WeightSyncScheme

sys.path.insert(0, os.path.dirname(__file__))
from rpc_worker import weights  # noqa: E402


@pytest.fixture
def hosts():
    """This process (the sender) and a namespace (the receiver) on one bridge."""
    if (reason := netns.available()) is not None:
        pytest.skip(reason)
    with netns.hosts(2, local=True) as pair:
        yield pair


@pytest.mark.xfail(reason="passes alone, but after another RPC session in the same process (e.g. test_faults' "
                          "dead-worker test) the worker in the other namespace never gets version 0; "
                          "multi_host is not declared until this passes", strict=False)
def test_receiver_in_another_namespace(hosts, workers):
    here, there = hosts
    scheme = WeightSyncScheme("rpc", timeout=20.0, host=here.address, rpc_timeout=20.0)
    w = weights(0.0)
    scheme.init_on_sender(weights=w, num_workers=1)
    proc = workers({"options": scheme.transport.options, "idx": 0, "until": 2}, prefix=there.prefix)
    try:
        scheme.connect()
        for v in (1, 2):
            for t in w.values():
                t.fill_(v)
            assert scheme.send() == v
    finally:
        scheme.shutdown()
    applied = [line for line in proc.lines() if line["event"] == "applied"]
    assert [line["version"] for line in applied] == [0, 1, 2]
    assert applied[-1]["sum"] == 2.0 * 32
