"""Faults with real processes and real Gloo groups: a worker that dies, a worker whose model differs."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import torch
from wsync_core import SchemaMismatchError, WeightSyncScheme, WorkerTimeoutError

sys.path.insert(0, os.path.dirname(__file__))
from dist_worker import send_versions, weights  # noqa: E402


def _sender(n: int, **options):
    scheme = WeightSyncScheme("distributed", timeout=90.0, heartbeat_timeout=2.0, **options)
    w = weights("base", 0.0)
    scheme.init_on_sender(weights=w, num_workers=n)
    return scheme, w


def test_dead_worker_is_named_and_the_others_are_updated(workers):
    scheme, w = _sender(2)
    opts = scheme.transport.options
    procs = [workers({"options": opts, "idx": i, "until": 3, "run_s": 120}) for i in range(2)]
    try:
        scheme.connect()
        procs[1].proc.send_signal(signal.SIGKILL)
        procs[1].proc.wait(30)
        for t in w.values():
            t.fill_(1)
        t0 = time.monotonic()
        with pytest.raises(WorkerTimeoutError) as info:
            scheme.send(timeout=20.0)
        assert info.value.workers == [1]
        assert time.monotonic() - t0 < 20.0 + 10.0
        for v in (2, 3):  # the scheme stays usable for the survivor
            for t in w.values():
                t.fill_(v)
            assert scheme.send(worker_ids=[0]) == v
    finally:
        scheme.shutdown()
    applied = [line["version"] for line in procs[0].lines() if line["event"] == "applied"]
    assert applied[0] == 0 and applied[-1] == 3 and 1 in applied


@pytest.mark.parametrize("variant", ["other"])
def test_schema_mismatch_raises_on_both_sides(workers, variant):
    scheme, _ = _sender(1)
    proc = workers({"options": scheme.transport.options, "idx": 0, "variant": variant, "timeout": 60.0})
    try:
        with pytest.raises(SchemaMismatchError, match="a"):
            scheme.connect()
    finally:
        scheme.shutdown()
    errors = [line for line in proc.lines() if line["event"] == "error"]
    assert errors and errors[0]["type"] == "SchemaMismatchError", errors


def test_nccl_path(workers):
    """NCCL: CUDA buffers on both sides (one GPU per rank), a streamed snapshot, the model adopting
    the receive buffer on its own device."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available on this machine")
    if torch.cuda.device_count() < 2:
        pytest.skip(f"NCCL needs one GPU per rank; this machine has {torch.cuda.device_count()}")
    scheme = WeightSyncScheme("distributed", timeout=120.0, backend="nccl", bucket_mb=1)
    w = {k: t.to("cuda:0") for k, t in weights("mixed4", 0.0).items()}
    scheme.init_on_sender(weights=w, num_workers=1)
    proc = workers({"options": scheme.transport.options, "idx": 0, "variant": "mixed4", "device": "cuda:1",
                    "until": 2, "timeout": 120.0})
    applied = send_versions(scheme, w, proc, [1, 2])
    assert [line["version"] for line in applied] == [0, 1, 2], applied
    assert [(line["lo"], line["hi"]) for line in applied[1:]] == [(1.0, 1.0), (2.0, 2.0)]
