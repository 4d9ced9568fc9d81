"""The whole wsync conformance suite against ``ray``, on a local Ray head node (2 CPUs, 512 MiB
of object store); the suite's receiver processes join it as Ray drivers. ``multi_host`` runs on a
cluster of its own: a head node on this host's bridge address and a second node in the other
network namespace, so the receiver there is a Ray driver of another node of the same cluster."""

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
from wsync_conformance import Target, TransportSuite
from wsync_conformance.netns import Host

pytest.importorskip("ray", reason="the ray transport needs Ray (pip install 'ray[default]')")

from wsync_ray.cluster import RayNode  # noqa: E402


class TestRay(TransportSuite):
    transport = "ray"

    @pytest.fixture
    def wsync_target(self, ray_head) -> Target:
        return Target(self.transport, {"address": ray_head.address})

    def multi_host_options(self, host_address: str) -> dict:
        """The cluster's address, once ``multi_host_setup`` started it, and checksums on (across
        nodes users turn them on: Ray checks no object's bytes end to end); a check across hosts that
        does not enter that hook first is skipped (ray's hosts are Ray nodes, which
        the transport cannot start from options alone)."""
        address = getattr(self, "_cluster_address", None)
        if address is None:
            pytest.skip("ray's hosts are nodes of one Ray cluster: a check across hosts must enter the suite's "
                        "multi_host_setup(here, *others) hook, which starts a Ray node on each")
        return {"address": address, "checksum": True}  # across nodes, as the README tells users

    @contextmanager
    def multi_host_setup(self, here: Host, *others: Host) -> Iterator[dict]:
        """A Ray cluster of one node per host: the head on ``here`` (this namespace, at its bridge
        address), a node on each of ``others``; every process of every node is stopped on exit."""
        with contextlib.ExitStack() as stack:
            head = stack.enter_context(RayNode(num_cpus=1, object_store_mib=256, node_ip=here.address))
            with ThreadPoolExecutor(len(others) or 1) as pool:  # the nodes start side by side
                starting = [pool.submit(RayNode, num_cpus=1, object_store_mib=256, head=head.address,
                                        node_ip=there.address, prefix=there.prefix) for there in others]
            for node in starting:
                if node.exception() is None:
                    stack.enter_context(node.result())
            for node in starting:
                node.result()  # the first failure to start, once every node that started will stop
            self._cluster_address = head.address
            try:
                yield {}
            finally:
                self._cluster_address = None
