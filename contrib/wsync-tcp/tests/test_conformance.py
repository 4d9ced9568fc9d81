"""The whole wsync conformance suite against ``tcp`` (each scheme gets its own loopback port); the
``auth`` and ``multi_host`` hooks are the transport class's own, as ``wsync conformance tcp`` finds them."""

from wsync_conformance import TransportSuite


class TestTcp(TransportSuite):
    transport = "tcp"
