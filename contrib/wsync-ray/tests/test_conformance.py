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

    def test_capability_multi_host(self, wsync) -> None:
        """multi_host on Ray means workers on another node of the same Ray cluster, not a receiver
        dialing a sender's address: tests/test_two_nodes.py proves it on a real two-node cluster
        (``ray start --head`` and ``ray start --address`` in two network namespaces)."""
        pytest.skip("proved by contrib/wsync-ray/tests/test_two_nodes.py on a two-node Ray cluster across "
                    "network namespaces")

    # the two checks the suite gained after this transport was written; known to fail for ray (open)
    @pytest.mark.xfail(strict=False, reason="ray reports Left only for receivers in actors; the endpoint "
                                            "test's receiver is a plain process")
    def test_endpoint_joined_acked_left(self, wsync) -> None:
        super().test_endpoint_joined_acked_left(wsync)

    @pytest.mark.xfail(strict=False, reason="a silent ray receiver does not yet get exactly the newest version "
                                            "at its next receive()")
    def test_live_silent_worker_stays_connected_under_large_payloads(self, wsync) -> None:
        super().test_live_silent_worker_stays_connected_under_large_payloads(wsync)

    # issue 16's fault checks, found failing for ray (not strict: timing-dependent); open for ray's owner
    @pytest.mark.xfail(strict=False, reason="known (issue 16): a frozen ray worker's first receive() applies a "
                                            "stale queued version (the oldest of those sent while it slept), not "
                                            "the newest")
    def test_faults_slow_worker_gets_newest(self, wsync) -> None:
        super().test_faults_slow_worker_gets_newest(wsync)

    # multi_host on Ray means nodes of one Ray cluster, not a receiver dialing a sender's address: this
    # suite supplies no multi_host_options, so the fault checks across network namespaces cannot build
    # their hosts; the faults across nodes are not yet tested for ray (open)
    @pytest.mark.xfail(strict=False, reason="known (issue 16): ray supplies no multi_host_options (its hosts are "
                                            "Ray nodes); the kill/replacement check across hosts is not run")
    def test_faults_worker_killed(self, wsync) -> None:
        super().test_faults_worker_killed(wsync)

    @pytest.mark.xfail(strict=False, reason="known (issue 16): ray supplies no multi_host_options (its hosts are "
                                            "Ray nodes); the link-cut check across hosts is not run")
    def test_faults_link_cut(self, wsync) -> None:
        super().test_faults_link_cut(wsync)

    @pytest.mark.xfail(strict=False, reason="known (issue 16): ray supplies no multi_host_options (its hosts are "
                                            "Ray nodes); the sender-killed check across hosts is not run")
    def test_faults_sender_killed(self, wsync) -> None:
        super().test_faults_sender_killed(wsync)
