"""The whole wsync conformance suite against ``rpc`` (TensorPipe, CPU)."""

from wsync_conformance import TransportSuite


class TestRpcConformance(TransportSuite):
    transport = "rpc"
    options = {"rpc_timeout": 30.0}
