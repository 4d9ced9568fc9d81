"""The whole wsync conformance suite against ``zmq`` (each scheme gets its own loopback port),
with CURVE keys for the ``auth`` test and a bridge address for the ``multi_host`` test."""

from typing import ClassVar

import pytest
import zmq
from wsync_conformance import TransportSuite
from wsync_core import free_port


def _pair() -> tuple[str, str]:
    public, secret = zmq.curve_keypair()
    return public.decode(), secret.decode()


class TestZmqConformance(TransportSuite):
    transport = "zmq"
    keys: ClassVar[dict[str, tuple[str, str]]] = {name: _pair() for name in ("server", "client", "stranger")}

    def auth_options(self, good: bool) -> dict:
        """The sender and its workers share the server key; only the client key is allowed.
        The stranger knows the server's public key but holds a key the sender does not allow."""
        server, client, stranger = self.keys["server"], self.keys["client"], self.keys["stranger"]
        if good:
            return {"curve_server_key": server[0], "curve_server_secret": server[1], "curve_client_key": client[0],
                    "curve_client_secret": client[1], "curve_allowed_clients": [client[0]]}
        return {"curve_server_secret": None, "curve_client_key": stranger[0], "curve_client_secret": stranger[1]}

    def multi_host_options(self, host_address: str) -> dict:
        return {"address": f"tcp://{host_address}:{free_port(host_address)}"}

    # zmq's real finding (issue 16, slow workers): a silent worker may apply a stale queued version
    # before the newest; not strict because which version it holds depends on timing
    @pytest.mark.xfail(strict=False, reason="known: a silent zmq worker may first apply a stale queued version")
    def test_live_silent_worker_stays_connected_under_large_payloads(self, wsync) -> None:
        super().test_live_silent_worker_stays_connected_under_large_payloads(wsync)

    # issue 16's slow-worker check: the same finding as above, with the worker's process frozen (SIGSTOP)
    # while six versions go out; not strict: seen in one run of two (applied 4 of 3..8)
    @pytest.mark.xfail(strict=False, reason="known (issue 16): a frozen zmq worker's first receive() may apply a "
                                            "stale queued version, not the newest")
    def test_faults_slow_worker_gets_newest(self, wsync) -> None:
        super().test_faults_slow_worker_gets_newest(wsync)
