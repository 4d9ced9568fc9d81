"""The whole wsync conformance suite against ``ray``, on a local Ray head node (2 CPUs, 512 MiB
of object store); the suite's receiver processes join it as Ray drivers."""

import pytest
from wsync_conformance import Target, TransportSuite

pytest.importorskip("ray", reason="the ray transport needs Ray (pip install 'ray[default]')")


class TestRay(TransportSuite):
    transport = "ray"

    @pytest.fixture
    def wsync_target(self, ray_head) -> Target:
        return Target(self.transport, {"address": ray_head.address})
