"""A receiver on another "host": its own network namespace, reached over a veth link (root only)."""

from __future__ import annotations

import os
import random
import shutil
import subprocess

import pytest
from wsync_core import WeightSyncScheme

import sys

sys.path.insert(0, os.path.dirname(__file__))
from rpc_worker import weights  # noqa: E402


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def namespace():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (ip netns) to build a network namespace")
    tag = f"{os.getpid() % 10000}{random.randrange(100)}"
    ns, host_if, ns_if = f"wsync-{tag}", f"wsh{tag}", f"wsn{tag}"
    subnet = f"10.232.{random.randrange(1, 250)}"
    try:
        try:
            _ip("netns", "add", ns)
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"cannot create a network namespace here: {exc.stderr.decode().strip()}")
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", ns)
        _ip("addr", "add", f"{subnet}.1/24", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("-n", ns, "addr", "add", f"{subnet}.2/24", "dev", ns_if)
        _ip("-n", ns, "link", "set", ns_if, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        yield ns, f"{subnet}.1"
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


@pytest.mark.xfail(reason="worker in another network namespace never gets version 0 (TensorPipe path across "
                          "namespaces not working yet); multi_host is not declared until this passes", strict=False)
def test_receiver_in_another_namespace(namespace, workers):
    ns, address = namespace
    scheme = WeightSyncScheme("rpc", timeout=90.0, host=address, rpc_timeout=30.0)
    w = weights(0.0)
    scheme.init_on_sender(weights=w, num_workers=1)
    proc = workers({"options": scheme.transport.options, "idx": 0, "until": 2}, prefix=["ip", "netns", "exec", ns])
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
