"""What the shm tests run in child processes: a receiver or a sender driven by commands on a pipe."""

from __future__ import annotations

import time

import torch

from wsync_core import WeightSyncScheme, WsyncError

N = 1000


def make_model() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(N, dtype=torch.float32), "step": torch.zeros((), dtype=torch.int64),
            "mask": torch.zeros(7, dtype=torch.bool)}


def fill(model: dict[str, torch.Tensor], k: int) -> None:
    model["w"].fill_(k + 0.5)
    model["step"].fill_(k)
    model["mask"].fill_(k % 2 == 1)


def holds(model: dict[str, torch.Tensor], k: int) -> bool:
    expected = make_model()
    fill(expected, k)
    return all(torch.equal(model[key], expected[key]) for key in expected)


def receiver_main(scheme, worker: int, conn) -> None:
    """``scheme``: a pickled WeightSyncScheme, or a dict of shm options to build one independently."""
    if isinstance(scheme, dict):
        scheme = WeightSyncScheme("shm", timeout=30.0, **scheme)
    model = make_model()
    scheme.init_on_receiver(model=model, worker_idx=worker)
    scheme.connect()
    conn.send(("connected", scheme.version, holds(model, scheme.version)))
    while True:
        cmd, arg = conn.recv()
        if cmd == "receive":
            try:
                v = scheme.receive(timeout=arg)
                conn.send(("ok", v, scheme.version, holds(model, scheme.version)))
            except WsyncError as exc:
                conn.send(("error", type(exc).__name__, str(exc), scheme.version, holds(model, scheme.version)))
        elif cmd == "quit":
            scheme.shutdown()
            conn.send(("bye",))
            return


def sender_main(options: dict, num_workers: int, conn) -> None:
    scheme = WeightSyncScheme("shm", timeout=30.0, **options)
    model = make_model()
    fill(model, 0)
    scheme.init_on_sender(model=model, num_workers=num_workers)
    conn.send(("init",))
    scheme.connect()
    conn.send(("connected",))
    while True:
        cmd, arg = conn.recv()
        if cmd == "send":
            fill(model, arg)
            conn.send(("sent", scheme.send()))
        elif cmd == "sleep":
            time.sleep(arg)
