"""The whole wsync conformance suite against ``mp``, with shared secrets for the ``auth`` test."""

from wsync_conformance import TransportSuite


class TestMpConformance(TransportSuite):
    transport = "mp"

    def auth_options(self, good: bool) -> dict:
        """The sender and its workers share one authkey; the stranger holds another."""
        return {"authkey": "the-shared-secret-of-this-test" if good else "a-guess-at-the-secret"}

