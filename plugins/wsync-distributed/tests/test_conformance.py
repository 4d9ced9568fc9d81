"""The whole wsync conformance suite against ``distributed`` (Gloo, CPU), with a bridge address
for the ``multi_host`` test."""

from wsync_conformance import TransportSuite


class TestDistributedConformance(TransportSuite):
    transport = "distributed"
    options = {"backend": "gloo", "heartbeat_timeout": 3.0}

    def multi_host_options(self, host_address: str) -> dict:
        return {"host": host_address}
