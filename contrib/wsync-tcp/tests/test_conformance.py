"""The whole wsync conformance suite against ``tcp`` (each scheme gets its own loopback port),
with a shared key for the ``auth`` test and a bridge address for the ``multi_host`` test."""

from wsync_conformance import TransportSuite


class TestTcp(TransportSuite):
    transport = "tcp"

    def auth_options(self, good: bool) -> dict:
        """The sender and its workers share one authkey; the stranger holds another."""
        return {"authkey": "the-shared-secret-of-this-test" if good else "a-guess-at-the-secret"}

    def multi_host_options(self, host_address: str) -> dict:
        return {"host": host_address, "heartbeat": 2.0}  # a cut longer than it: dropped, then reconnected
