"""``multi_host`` on a real Ray cluster of two nodes on this machine: ``ray start --head`` in one
network namespace and ``ray start --address`` in another, joined by veth links to a bridge
(``wsync_conformance.netns``). The trainer runs in the head's namespace, both rollout actors on
the other node, so every payload crosses Ray's object manager between the two.

Runs with ``--thorough`` only (the suite's ``test_capability_multi_host`` proves multi_host on
a two-node cluster in the default run). Needs root and ``ip netns``; skipped with the reason otherwise. Each node gets 1 CPU and 256 MiB
of object store; every Ray process is stopped and the namespaces deleted, whatever happens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from wsync_conformance import netns

pytest.importorskip("ray")

from wsync_ray.cluster import RayNode  # noqa: E402

HERE = Path(__file__).parent


@pytest.fixture
def two_hosts(request):
    if not request.config.getoption("wsync_thorough", default=False):
        pytest.skip("runs with --thorough (24 s); by default the suite's test_capability_multi_host "
                    "(tests/test_conformance.py) proves multi_host on a two-node Ray cluster")
    if (reason := netns.available()) is not None:
        pytest.skip(reason)
    with netns.hosts(2) as made:
        yield made


def test_two_node_cluster(two_hosts) -> None:
    near, far = two_hosts
    env = {"RAY_AUTH_MODE": "disabled"}
    nodes: list[RayNode] = []
    try:
        head = RayNode(num_cpus=1, object_store_mib=256, node_ip=near.address, prefix=near.prefix, env=env)
        nodes.append(head)
        nodes.append(RayNode(num_cpus=1, object_store_mib=256, head=head.address, node_ip=far.address,
                             prefix=far.prefix, env=env, resources='{"far": 1}'))
        proc = near.run([sys.executable, str(HERE / "ray_two_nodes.py"), head.address], stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
        try:
            out, err = proc.communicate(timeout=400)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"the two-node trainer hung:\n{err[-3000:]}")
        assert proc.returncode == 0, err[-4000:]
        result = json.loads(out.strip().splitlines()[-1])
    finally:
        for node in reversed(nodes):
            node.stop()
    print(json.dumps(result, indent=1))
    assert result["trainer_node"] not in result["worker_nodes"], "the rollout actors must run on the other node"
    assert result["connected"] == [0, 0]
    assert result["direct_acks"] == [True, True] and result["links"] == 2, "acks must cross the link directly"
    for sent in result["versions"]:
        for w in sent["workers"]:
            assert w == {"version": sent["v"], "digest": sent["digest"]}, sent
    dead = result["dead"]
    assert dead.get("workers") == [1] and "disconnected" in dead["message"], dead
    assert result["after_kill"]["worker0"] == {"version": 4, "digest": result["after_kill"]["digest"]}
