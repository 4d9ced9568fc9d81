"""The whole wsync conformance suite against ``distributed`` (Gloo, CPU), with a bridge address
for the ``multi_host`` test."""

import pytest
from wsync_conformance import TransportSuite


class TestDistributedConformance(TransportSuite):
    transport = "distributed"
    options = {"backend": "gloo", "heartbeat_timeout": 3.0}

    def multi_host_options(self, host_address: str) -> dict:
        return {"host": host_address}

    @pytest.mark.xfail(strict=False, reason="known (issue 16, item 5): a version that reached the worker before it froze is applied when it wakes, before the newest, which the trainer had not yet written (the suite wakes it while the trainer holds its GIL); distributed's receiver thread has no probe asking the sender for the newest first, as zmq and wsync_core.stream do")
    def test_faults_slow_worker_gets_newest(self, wsync) -> None:
        super().test_faults_slow_worker_gets_newest(wsync)
