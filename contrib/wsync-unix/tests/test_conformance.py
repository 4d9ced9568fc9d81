"""The whole wsync conformance suite against ``unix`` (each scheme gets its own name and key); the
``auth`` hook is the transport class's own, as ``wsync conformance unix`` finds it."""

from wsync_conformance import TransportSuite


class TestUnix(TransportSuite):
    transport = "unix"
