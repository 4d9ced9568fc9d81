"""The whole wsync conformance suite against ``rpc`` (TensorPipe, CPU), with a bridge address for
the ``multi_host`` test (its sender runs in a fresh process: TensorPipe fixes a process's listen
address at its first agent)."""

from wsync_conformance import TransportSuite


class TestRpcConformance(TransportSuite):
    transport = "rpc"
    options = {"rpc_timeout": 30.0}

    def multi_host_options(self, host_address: str) -> dict:
        return {"host": host_address, "rpc_timeout": 20.0}
