"""The whole wsync conformance suite against ``tcp`` (each scheme gets its own loopback port),
with a shared key for the ``auth`` test and a bridge address for the ``multi_host`` test."""

import pytest
from wsync_conformance import TransportSuite


class TestTcp(TransportSuite):
    transport = "tcp"

    def auth_options(self, good: bool) -> dict:
        """The sender and its workers share one authkey; the stranger holds another."""
        return {"authkey": "the-shared-secret-of-this-test" if good else "a-guess-at-the-secret"}

    def multi_host_options(self, host_address: str) -> dict:
        return {"host": host_address, "heartbeat": 2.0}  # a cut longer than it: dropped, then reconnected

    # a real finding of the stream bases (issue 16), timing-dependent, so not strict: a version that
    # was in flight when the worker froze completes when it wakes and is applied before the newest
    @pytest.mark.xfail(strict=False, reason="known (issue 16): wsync_core.stream applies the version that was "
                                            "in flight when the worker froze before the newest (seen once: 3 of 3..8)")
    def test_faults_slow_worker_gets_newest(self, wsync) -> None:
        super().test_faults_slow_worker_gets_newest(wsync)
