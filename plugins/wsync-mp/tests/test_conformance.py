"""The whole wsync conformance suite against ``mp``, with shared secrets for the ``auth`` test."""

import pytest
from wsync_conformance import TransportSuite


class TestMpConformance(TransportSuite):
    transport = "mp"

    def auth_options(self, good: bool) -> dict:
        """The sender and its workers share one authkey; the stranger holds another."""
        return {"authkey": "the-shared-secret-of-this-test" if good else "a-guess-at-the-secret"}

    @pytest.mark.xfail(strict=False, reason="known (issue 16, item 5): a version that reached the worker before it froze is applied when it wakes, before the newest, which the trainer had not yet written (the suite wakes it while the trainer holds its GIL); mp's receiver has no probe asking the sender for the newest first, as zmq and wsync_core.stream do")
    def test_faults_slow_worker_gets_newest(self, wsync) -> None:
        super().test_faults_slow_worker_gets_newest(wsync)
