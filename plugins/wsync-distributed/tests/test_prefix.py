"""A delta (or any payload shorter than the buffer) moves only its bytes over the link."""

from __future__ import annotations

import os
import sys

from wsync_core import WeightSyncScheme
from wsync_distributed import wire

sys.path.insert(0, os.path.dirname(__file__))
from dist_worker import weights  # noqa: E402


def test_a_delta_broadcasts_only_its_bytes(workers, monkeypatch):
    """delta=True, 10 of 1M elements changed: the link carries the encoded delta (well under 1 KiB,
    not the 4 MiB buffer) and the worker applies it exactly (its model's sum)."""
    sent: list[int] = []
    real = wire.broadcast_part

    def counting(group, tensor):
        sent.append(tensor.numel())
        return real(group, tensor)

    monkeypatch.setattr(wire, "broadcast_part", counting)
    scheme = WeightSyncScheme("distributed", timeout=60.0, heartbeat_timeout=3.0, delta="always")
    w = weights("big4", 0.0)
    scheme.init_on_sender(weights=w, num_workers=1)
    proc = workers({"options": scheme.transport.options, "idx": 0, "variant": "big4", "until": 1, "run_s": 60})
    try:
        scheme.connect()
        assert sum(sent) == w["w"].numel() * 4  # version 0: in full
        sent.clear()
        w["w"][:10] = 1.0
        assert scheme.send() == 1
        report = scheme.last_report
    finally:
        scheme.shutdown()
    assert report.delta_workers == [0] and 0 < sum(sent) == report.nbytes < 1024, (sent, report)
    applied = [line for line in proc.lines() if line["event"] == "applied"]
    assert applied[-1]["version"] == 1 and applied[-1]["sum"] == 10.0, applied
