"""The whole wsync conformance suite against ``distributed`` (Gloo, CPU)."""

from wsync_conformance import TransportSuite


class TestDistributedConformance(TransportSuite):
    transport = "distributed"
    options = {"backend": "gloo", "heartbeat_timeout": 3.0}
