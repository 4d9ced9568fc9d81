"""The whole wsync conformance suite against ``mp``; the ``auth`` hook is the transport class's own,
as ``wsync conformance mp`` finds it."""

from wsync_conformance import TransportSuite


class TestMpConformance(TransportSuite):
    transport = "mp"
