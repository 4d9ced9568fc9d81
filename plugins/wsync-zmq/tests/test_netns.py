"""Multi-host, on one machine: a sender and two receivers in three network namespaces joined by
a bridge; one link is cut mid-run and the other receiver is still updated.

Needs root and ``ip netns``; skipped with the reason otherwise. The 10.231.0.0/24 addresses exist
only inside the namespaces this test makes, and the namespaces are always deleted.
"""

from __future__ import annotations

import pytest
from wsync_conformance import netns

from zmq_helpers import SenderProcess

SUBNET = "10.231.0"
PORT = 47311


@pytest.fixture
def hosts():
    """Hosts ``s`` (the sender, at SUBNET.1), ``r0`` and ``r1``, on one bridge."""
    if (reason := netns.available()) is not None:
        pytest.skip(reason)
    with netns.hosts(3, SUBNET) as made:
        yield dict(zip(("s", "r0", "r1"), made))


def test_one_link_cut_the_other_receiver_still_updated(hosts, spawn):
    options = {"address": f"tcp://{SUBNET}.1:{PORT}", "heartbeat": 2.0}
    run_in = {role: host.prefix for role, host in hosts.items()}
    sender = SenderProcess(2, options, run_in["s"], timeout=60.0)
    try:
        r0 = spawn(0, options, run_in["r0"])
        r1 = spawn(1, options, run_in["r1"])
        first = sender.next()
        assert first.get("v") == 0 and "error" not in first, first
        for r in (r0, r1):
            assert r.wait_version(0)["digest"] == first["digest"]
        one = sender.send()
        assert one.get("v") == 1 and "error" not in one, one
        for r in (r0, r1):
            assert r.wait_version(1)["digest"] == one["digest"]

        hosts["r1"].cut()  # cut r1's link mid-run
        for v in (2, 3):
            result = sender.send(timeout=15.0)  # returns once the heartbeat says r1 is gone
            assert result["v"] == v and result.get("workers") == [1], result
            assert r0.wait_version(v)["digest"] == result["digest"]
        assert r0.errors() == []

        hosts["r1"].restore()  # back: r1 catches up by itself
        assert r1.wait_version(3, timeout=60)["digest"] == result["digest"]
        four = sender.send()
        assert four.get("v") == 4 and "error" not in four, four
        for r in (r0, r1):
            assert r.wait_version(4)["digest"] == four["digest"]
    finally:
        sender.stop()
