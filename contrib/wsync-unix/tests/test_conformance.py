"""The whole wsync conformance suite against ``unix`` (each scheme gets its own name and key)."""

from wsync_conformance import TransportSuite


class TestUnix(TransportSuite):
    transport = "unix"
