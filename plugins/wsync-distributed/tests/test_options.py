"""Option defaults that depend on where the sender is."""

from __future__ import annotations

import pytest
from wsync_distributed import DistributedTransport


@pytest.mark.parametrize(("host", "backend", "expected"), [
    ("127.0.0.1", "gloo", False), ("localhost", "gloo", False), ("::1", "gloo", False),
    ("10.0.0.7", "gloo", True), ("trainer.example", "gloo", True), ("10.0.0.7", "nccl", False)])
def test_payloads_are_checksummed_by_default_when_they_cross_a_wire(host, backend, expected):
    """Across hosts, TCP's own checksum misses some damage (an outside audit saw damaged versions
    applied silently over a link that swapped two 16-bit words): gloo payloads carry XXH3 sums by
    default unless the sender is on loopback; NCCL's links check their own; an explicit value wins."""
    assert DistributedTransport(host=host, port=29500, backend=backend).options["checksum"] is expected
    assert DistributedTransport(host=host, port=29500, backend=backend, checksum=not expected).options["checksum"] \
        is (not expected)


@pytest.mark.parametrize(("option", "value"), [
    ("collective_timeout", "abc"), ("collective_timeout", "60"), ("heartbeat_timeout", float("nan")),
    ("heartbeat_timeout", 0), ("bucket_mb", True), ("devices", 1.5), ("port", True), ("port", 70000),
    ("world_size", 1), ("rank", -1)])
def test_a_number_option_of_another_type_or_out_of_range_is_refused_by_name(option, value):
    """A string, a bool, NaN or a value out of range is refused when the transport is made, naming
    the option and its range (before, "60" and True passed, and "abc" raised float()'s own error)."""
    with pytest.raises(ValueError, match=f"distributed option {option} must be"):
        DistributedTransport(**{"port": 29500, option: value})


def test_a_second_scheme_on_a_port_taken_is_told_to_take_its_own():
    """Each sender hosts a store of its own: a second scheme of one job (a value network beside the
    policy) given the same port fails at connect() saying what to do (its README used to advise a
    second prefix, which shares nothing)."""
    import torch
    from wsync_core import TransportError, WeightSyncScheme, WorkerTimeoutError

    first = WeightSyncScheme("distributed", timeout=5.0, prefix="policy")
    second = WeightSyncScheme("distributed", timeout=5.0, prefix="value", port=first.transport.options["port"])
    first.init_on_sender(model=torch.nn.Linear(2, 2), num_workers=1)
    second.init_on_sender(model=torch.nn.Linear(3, 3), num_workers=1)
    try:
        with pytest.raises(WorkerTimeoutError):
            first.connect(timeout=0.5)  # (no worker comes: its store stays up until shutdown)
        with pytest.raises(TransportError, match=r"cannot host the store .* give each scheme its own port="):
            second.connect(timeout=0.5)
    finally:
        second.shutdown()
        first.shutdown()
