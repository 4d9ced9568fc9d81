"""The whole wsync conformance suite against ``distributed`` (Gloo, CPU), with a bridge address
for the ``multi_host`` test."""

import pytest
from wsync_conformance import TransportSuite


class TestDistributedConformance(TransportSuite):
    transport = "distributed"
    options = {"backend": "gloo", "heartbeat_timeout": 3.0}

    def multi_host_options(self, host_address: str) -> dict:
        return {"host": host_address}

    # issue 16's fault checks (not strict: timing-dependent); found by the faults suite, open for distributed's owner
    @pytest.mark.xfail(strict=False, reason="known (issue 16): a frozen worker stalls the broadcast: send() with "
                                            "sync=False raises WorkerTimeoutError naming every worker ('no send "
                                            "buffer freed up' within its timeout)")
    def test_faults_slow_worker_gets_newest(self, wsync) -> None:
        super().test_faults_slow_worker_gets_newest(wsync)

    @pytest.mark.xfail(strict=False, reason="known (issue 16): while a worker's link is cut, the second send names "
                                            "the survivor too ([0, 1]): the cut rank stalls the others")
    def test_faults_link_cut(self, wsync) -> None:
        super().test_faults_link_cut(wsync)
