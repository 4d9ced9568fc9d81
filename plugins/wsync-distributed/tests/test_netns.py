"""A receiver on another "host": its own network namespace, on a bridge with this process (root only)."""

from __future__ import annotations

import os
import sys

import pytest
from wsync_conformance import netns
from wsync_core import WeightSyncScheme

sys.path.insert(0, os.path.dirname(__file__))
from dist_worker import send_versions, weights  # noqa: E402


@pytest.fixture
def hosts():
    """This process (the sender) and a namespace (the receiver) on one bridge."""
    if (reason := netns.available()) is not None:
        pytest.skip(reason)
    with netns.hosts(2, local=True) as pair:
        yield pair


def test_receiver_in_another_namespace(hosts, workers):
    here, there = hosts
    scheme = WeightSyncScheme("distributed", timeout=90.0, host=here.address, backend="gloo")
    w = weights("base", 0.0)
    scheme.init_on_sender(weights=w, num_workers=1)
    proc = workers({"options": scheme.transport.options, "idx": 0, "until": 2}, prefix=there.prefix)
    applied = send_versions(scheme, w, proc, [1, 2])
    assert [line["version"] for line in applied] == [0, 1, 2]
    assert applied[-1]["sum"] == 2.0 * 32
