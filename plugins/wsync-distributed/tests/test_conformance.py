"""The whole wsync conformance suite against ``distributed`` (Gloo, CPU); the ``multi_host`` hook is
the transport class's own, as ``wsync conformance distributed`` finds it."""

from wsync_conformance import TransportSuite


class TestDistributedConformance(TransportSuite):
    transport = "distributed"
    options = {"backend": "gloo", "heartbeat_timeout": 3.0}
