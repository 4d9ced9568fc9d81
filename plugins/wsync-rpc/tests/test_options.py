"""Option defaults that depend on where the sender is."""

from __future__ import annotations

import pytest
from wsync_rpc import RpcTransport


@pytest.mark.parametrize(("host", "expected"), [("127.0.0.1", False), ("localhost", False), ("10.0.0.7", True)])
def test_payloads_are_checksummed_by_default_when_they_cross_a_wire(host, expected):
    """Across hosts, payloads carry XXH3 sums unless asked otherwise (TCP's own checksum misses
    some damage); on loopback they do not, unless asked."""
    assert RpcTransport(host=host, port=29500).options["checksum"] is expected
    assert RpcTransport(host=host, port=29500, checksum=not expected).options["checksum"] is (not expected)
