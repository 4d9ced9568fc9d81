"""The whole wsync conformance suite against ``zmq`` (each scheme gets its own loopback port)."""

from wsync_conformance import TransportSuite


class TestZmqConformance(TransportSuite):
    transport = "zmq"
