"""Multi-host, on one machine: the sender in this process listens on a veth address; one worker
runs in another network namespace and reaches it over the link, another runs here. The remote
link is cut mid-run (the heartbeat notices, the local worker is still updated) and restored (the
remote worker reconnects by itself and catches up).

Needs root and ``ip netns`` (skipped with the reason otherwise); every namespace and link this
test makes is deleted on exit.
"""

from __future__ import annotations

import pytest
import torch
from wsync_conformance import netns
from wsync_core import WeightSyncScheme, WorkerTimeoutError

from tcp_worker import digest, make_model


@pytest.fixture
def hosts():
    """``here`` (this process, on a veth link) and ``remote`` (a namespace of its own), one bridge."""
    if (reason := netns.available()) is not None:
        pytest.skip(reason)
    with netns.hosts(2, local=True) as (here, remote):
        yield here, remote


def test_a_worker_on_another_host(hosts, spawn) -> None:
    here, remote = hosts
    model = make_model(0)
    scheme = WeightSyncScheme("tcp", timeout=60.0, host=here.address, heartbeat=2.0, authkey="multi-host")
    options = scheme.transport.options
    assert options["advertise"] == here.address
    try:
        scheme.init_on_sender(model=model, num_workers=2)
        local = spawn(0, options)
        far = spawn(1, options, remote.prefix)
        scheme.connect()
        for w in (local, far):
            assert w.wait_version(0)["digest"] == digest(model)

        remote.cut()
        with torch.no_grad():
            model[0].weight.add_(1.0)
        with pytest.raises(WorkerTimeoutError) as info:
            scheme.send(timeout=30.0)  # the heartbeat reports worker 1 gone well before
        assert info.value.workers == [1]
        assert local.wait_version(1)["digest"] == digest(model)

        remote.restore()  # worker 1 reconnects by itself and gets the latest version
        assert far.wait_version(1, timeout=60.0)["digest"] == digest(model)
        with torch.no_grad():
            model[0].weight.add_(1.0)
        assert scheme.send() == 2
        for w in (local, far):
            assert w.wait_version(2)["digest"] == digest(model)
    finally:
        scheme.shutdown()
