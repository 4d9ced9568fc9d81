"""The whole wsync conformance suite against ``unix`` (each scheme gets its own name and key),
with a shared key for the ``auth`` test."""

from wsync_conformance import TransportSuite


class TestUnix(TransportSuite):
    transport = "unix"

    def auth_options(self, good: bool) -> dict:
        """The sender and its workers share one authkey; the stranger holds another."""
        return {"authkey": "the-shared-secret-of-this-test" if good else "a-guess-at-the-secret"}
