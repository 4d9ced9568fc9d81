"""The whole wsync conformance suite against ``ray``, on a local Ray head node (2 CPUs, 512 MiB
of object store); the suite's receiver processes join it as Ray drivers. ``multi_host`` runs on a
cluster of its own: a head node on this host's bridge address and a second node in the other
network namespace, so the receiver there is a Ray driver of another node of the same cluster."""

from collections.abc import Iterator
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
        return {}  # the cluster's address comes from multi_host_setup

    @contextmanager
    def multi_host_setup(self, here: Host, there: Host) -> Iterator[dict]:
        """A two-node Ray cluster: the head on ``here`` (this namespace, at its bridge address),
        a node on ``there``; every process of both is stopped on exit."""
        with RayNode(num_cpus=1, object_store_mib=256, node_ip=here.address) as head, \
                RayNode(num_cpus=1, object_store_mib=256, head=head.address, node_ip=there.address,
                        prefix=there.prefix):
            yield {"address": head.address}
