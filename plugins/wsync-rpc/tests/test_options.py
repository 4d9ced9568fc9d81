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


@pytest.mark.parametrize(("option", "value"), [("rpc_timeout", "60"), ("rpc_timeout", float("nan")),
                                               ("port", "29500"), ("port", 0), ("world_size", True)])
def test_a_number_option_of_another_type_or_out_of_range_is_refused_by_name(option, value):
    """A string, a bool, NaN or a value out of range is refused naming the option and its range
    (before, a port of 0 meant "pick one", "60" passed, and True was a world size)."""
    with pytest.raises(ValueError, match=f"rpc option {option} must be"):
        RpcTransport(**{option: value})
