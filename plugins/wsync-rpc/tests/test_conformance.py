"""The whole wsync conformance suite against ``rpc`` (TensorPipe, CPU); the ``multi_host`` hook is
the transport class's own (its sender runs in a fresh process: TensorPipe fixes a process's listen
address at its first agent)."""

from wsync_conformance import TransportSuite


class TestRpcConformance(TransportSuite):
    transport = "rpc"
    options = {"rpc_timeout": 30.0}
