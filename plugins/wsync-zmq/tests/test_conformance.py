"""The whole wsync conformance suite against ``zmq`` (each scheme gets its own loopback port); the
``auth`` hook (CURVE keys) and the ``multi_host`` hook (a TCP address) are the transport class's
own, as ``wsync conformance zmq`` finds them."""

from wsync_conformance import TransportSuite


class TestZmqConformance(TransportSuite):
    transport = "zmq"
