"""The whole wsync conformance suite against ``rpc`` (TensorPipe, CPU), with a bridge address for
the ``multi_host`` test (its sender runs in a fresh process: TensorPipe fixes a process's listen
address at its first agent)."""

import pytest
from wsync_conformance import TransportSuite


class TestRpcConformance(TransportSuite):
    transport = "rpc"
    options = {"rpc_timeout": 30.0}

    def multi_host_options(self, host_address: str) -> dict:
        return {"host": host_address, "rpc_timeout": 20.0}

    @pytest.mark.xfail(strict=False, reason="known (issue 16, item 5): a version that reached the worker before it froze is applied when it wakes, before the newest, which the trainer had not yet written (the suite wakes it while the trainer holds its GIL); rpc's receiver has no probe asking the sender for the newest first, as zmq and wsync_core.stream do")
    def test_faults_slow_worker_gets_newest(self, wsync) -> None:
        super().test_faults_slow_worker_gets_newest(wsync)
