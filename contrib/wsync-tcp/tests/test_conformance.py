"""The whole wsync conformance suite against ``tcp`` (each scheme gets its own loopback port)."""

from wsync_conformance import TransportSuite


class TestTcp(TransportSuite):
    transport = "tcp"
