"""The whole wsync conformance suite against ``distributed`` (Gloo, CPU), with a bridge address
for the ``multi_host`` test."""

import pytest
from wsync_conformance import TransportSuite


class TestDistributedConformance(TransportSuite):
    transport = "distributed"
    options = {"backend": "gloo", "heartbeat_timeout": 3.0}

    def multi_host_options(self, host_address: str) -> dict:
        return {"host": host_address}

    # issue 16's link-cut check, not strict (timing-dependent): open for distributed
    @pytest.mark.xfail(strict=False, reason="known (issue 16): while a worker's link is cut, the suite's second "
                                            "send names the survivor too ([0, 1]); distributed's own netns test "
                                            "(heartbeat_timeout given up, then rejoin) passes")
    def test_faults_link_cut(self, wsync) -> None:
        super().test_faults_link_cut(wsync)
