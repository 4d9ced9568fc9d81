"""The whole wsync conformance suite against ``shm``."""

from wsync_conformance import TransportSuite


class TestShmConformance(TransportSuite):
    transport = "shm"
