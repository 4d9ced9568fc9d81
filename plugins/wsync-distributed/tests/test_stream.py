"""The streaming protocol with real processes: a receiver's model views a receive buffer that is
never written while it does, and a snapshot the core abandons half-written is never applied."""

from __future__ import annotations

import logging
import os
import sys
import time

import pytest
import torch
from wsync_core import WeightSyncScheme

sys.path.insert(0, os.path.dirname(__file__))
from dist_worker import weights  # noqa: E402


def test_a_model_views_a_buffer_that_is_never_written_while_pinned(workers, tmp_path):
    """Worker 1 holds version 1 (its model views a receive buffer) and stops calling receive():
    first worker 0 alone gets versions 2-5, then both get 6-9, which worker 1's background thread
    takes in meanwhile. Worker 1's model must hold exactly version 1 throughout, then 9."""
    scheme = WeightSyncScheme("distributed", sync=False, timeout=90.0, heartbeat_timeout=3.0, bucket_mb=0.5)
    w = weights("big2", 0.0)
    scheme.init_on_sender(weights=w, num_workers=2)
    go = tmp_path / "go"
    opts = scheme.transport.options
    procs = [workers({"options": opts, "idx": 0, "variant": "big2", "until": 9, "run_s": 120}),
             workers({"options": opts, "idx": 1, "variant": "big2", "until": 9, "run_s": 120,
                      "hold": {"at": 1, "file": str(go)}})]
    try:
        scheme.connect()
        w["w"].fill_(1.0)
        scheme.send_async().wait()
        for v in (2, 3, 4, 5):
            w["w"].fill_(float(v))
            assert scheme.send_async(worker_ids=[0]).wait() == v
        for v in (6, 7, 8, 9):
            w["w"].fill_(float(v))
            last = scheme.send_async()
        end = time.monotonic() + 60.0  # worker 0 has 9: the broadcasts to worker 1 are done too
        while 0 not in scheme.last_report.ack_latency and time.monotonic() < end:
            last.done()
            time.sleep(0.02)
        go.touch()
        assert last.wait() == 9
    finally:
        scheme.shutdown()
    out = [p.lines() for p in procs]
    got = [line["version"] for line in out[0] if line["event"] == "applied"]
    assert got[:6] == list(range(6)) and got[-1] == 9 and got == sorted(set(got)), got  # 6-8 may coalesce
    held = [line for line in out[1] if line["event"] == "held"]
    assert held and held[0]["checks"] > 0 and held[0]["bad"] == 0, held
    assert held[0]["pool"] <= 4, held  # the receive pool's bound
    applied = [line for line in out[1] if line["event"] == "applied"]
    assert [line["version"] for line in applied[:2]] == [0, 1] and applied[-1]["version"] == 9
    for line in out[0] + applied:
        if line["event"] == "applied" and line["version"]:
            assert line["lo"] == line["hi"] == line["version"], line


class _Unreadable(torch.Tensor):
    """A tensor whose copy raises: the core fails in the middle of writing a snapshot with it."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            raise RuntimeError("this tensor cannot be read")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_snapshot_abandoned_half_written_is_never_applied(workers, caplog):
    """The core fails in the middle of writing a snapshot (a tensor's copy raises) after the
    transport started broadcasting it; the receiver never applies those bytes, and the next send
    (same version number) arrives whole."""
    scheme = WeightSyncScheme("distributed", timeout=90.0, heartbeat_timeout=3.0, bucket_mb=1)
    w = weights("mixed32", 0.0)
    scheme.init_on_sender(weights=w, num_workers=1)
    proc = workers({"options": scheme.transport.options, "idx": 0, "variant": "mixed32", "until": 2, "run_s": 120})
    try:
        scheme.connect()
        for t in w.values():
            t.fill_(1.0)
        assert scheme.send() == 1
        broken = {"a": torch.full_like(w["a"], 7.0), "b": torch.zeros_like(w["b"]).as_subclass(_Unreadable)}
        with caplog.at_level(logging.INFO, logger="wsync.distributed"):
            with pytest.raises(RuntimeError, match="this tensor cannot be read"):
                scheme.send(weights=broken)
            for t in w.values():
                t.fill_(2.0)
            assert scheme.send() == 2
    finally:
        scheme.shutdown()
    assert "abandoned before publish" in caplog.text
    applied = [line for line in proc.lines() if line["event"] == "applied"]
    assert [line["version"] for line in applied] == [0, 1, 2]
    assert [(line["lo"], line["hi"]) for line in applied[1:]] == [(1.0, 1.0), (2.0, 2.0)]
