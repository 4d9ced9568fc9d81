"""Multi-host, on one machine: a sender and two receivers in three network namespaces joined by
veth links to a bridge; one link is cut mid-run and the other receiver is still updated.

Needs root and ``ip netns``; skipped with the reason otherwise. The 10.231.0.0/24 addresses exist
only inside the namespaces this test makes, and the namespaces are always deleted.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from zmq_helpers import SenderProcess

SUBNET = "10.231.0"
PORT = 47311


def ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if result.returncode:
        raise RuntimeError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")


@pytest.fixture
def hosts():
    """Namespaces ``sender``, ``r0``, ``r1``: each receiver's veth ends on a bridge in the sender's."""
    if shutil.which("ip") is None:
        pytest.skip("needs the `ip` command (iproute2) to make network namespaces")
    if os.geteuid() != 0:
        pytest.skip("needs root to make network namespaces")
    tag = f"wsz{os.getpid() % 100000}"
    names = {role: f"{tag}{role}" for role in ("s", "r0", "r1")}
    made: list[str] = []
    try:
        for ns in names.values():
            try:
                ip("netns", "add", ns)
            except RuntimeError as exc:
                pytest.skip(f"this machine does not allow network namespaces: {exc}")
            made.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
        s = names["s"]
        ip("-n", s, "link", "add", "br0", "type", "bridge")
        ip("-n", s, "addr", "add", f"{SUBNET}.1/24", "dev", "br0")
        ip("-n", s, "link", "set", "br0", "up")
        for i, role in enumerate(("r0", "r1")):
            outer, inner = f"{tag}{role}a", f"{tag}{role}b"
            ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            ip("link", "set", outer, "netns", s)
            ip("link", "set", inner, "netns", names[role])
            ip("-n", s, "link", "set", outer, "master", "br0")
            ip("-n", s, "link", "set", outer, "up")
            ip("-n", names[role], "addr", "add", f"{SUBNET}.{i + 2}/24", "dev", inner)
            ip("-n", names[role], "link", "set", inner, "up")
        yield {**names, "link_r1": f"{tag}r1a"}
    finally:
        for ns in made:  # deleting a namespace deletes its ends of the veth links
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def test_one_link_cut_the_other_receiver_still_updated(hosts, spawn):
    options = {"address": f"tcp://{SUBNET}.1:{PORT}", "heartbeat": 2.0}
    run_in = {role: ("ip", "netns", "exec", hosts[role]) for role in ("s", "r0", "r1")}
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

        ip("-n", hosts["s"], "link", "set", hosts["link_r1"], "down")  # cut r1's link mid-run
        for v in (2, 3):
            result = sender.send(timeout=15.0)  # returns once the heartbeat says r1 is gone
            assert result["v"] == v and result.get("workers") == [1], result
            assert r0.wait_version(v)["digest"] == result["digest"]
        assert r0.errors() == []

        ip("-n", hosts["s"], "link", "set", hosts["link_r1"], "up")  # back: r1 catches up by itself
        assert r1.wait_version(3, timeout=60)["digest"] == result["digest"]
        four = sender.send()
        assert four.get("v") == 4 and "error" not in four, four
        for r in (r0, r1):
            assert r.wait_version(4)["digest"] == four["digest"]
    finally:
        sender.stop()
