"""The whole wsync conformance suite against ``mp``."""

from wsync_conformance import TransportSuite


class TestMpConformance(TransportSuite):
    transport = "mp"
