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

    # not strict: the port is let go by torch's TensorPipe agent some time after shutdown(), within the
    # test's wait on a quiet machine, after it on a busy one; the bug stays open until rpc frees it itself
    @pytest.mark.xfail(strict=False, reason="known: rpc's sender may keep its store's port listening after "
                                            "shutdown() (fork or not), so a new sender with the same options "
                                            "cannot bind it")
    def test_clean_sender_forks_after_connect(self, wsync) -> None:
        super().test_clean_sender_forks_after_connect(wsync)
