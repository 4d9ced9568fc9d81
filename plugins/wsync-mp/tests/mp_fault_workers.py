"""Process bodies for the mp fault tests (importable by spawn and forkserver children)."""

from __future__ import annotations

import os
import pickle
import sys
import time

import torch
from wsync_core import WsyncError


def make_model(value: float = 0.0) -> dict[str, torch.Tensor]:
    """The tests' weights: a float, an int and a bool tensor, all filled from ``value``."""
    return {"w": torch.full((64, 33), float(value)), "step": torch.full((5,), int(value), dtype=torch.int64),
            "mask": torch.full((7,), bool(int(value) % 2))}


def version_of(model: dict[str, torch.Tensor]) -> int | None:
    """The version a model was filled with, or None if its tensors disagree (a mix)."""
    seen = {int(model["w"][0, 0]), int(model["step"][0])}
    flat = {float(x) for x in model["w"].flatten().tolist()} | {int(x) for x in model["step"].tolist()}
    return seen.pop() if len(seen) == 1 and len(flat) == 1 else None


def receiver(blob: bytes, worker: int, out, stop, audit: bool = False) -> None:
    """Connect as ``worker``, then report ("v", worker, version, version_of(model)) per version until ``stop``."""
    scheme = pickle.loads(blob)
    found: list[str] = []
    if audit:
        sys.addaudithook(lambda event, args: found.append(f"{args}") if event == "pickle.find_class" else None)
    model = make_model()
    try:
        scheme.init_on_receiver(model=model, worker_idx=worker)
        scheme.connect(timeout=60)
        out.put(("v", worker, scheme.version, version_of(model)))
        while not stop.is_set():
            v = scheme.receive(timeout=0.2)
            if v is not None:
                out.put(("v", worker, v, version_of(model)))
    except WsyncError as exc:
        out.put(("error", worker, type(exc).__name__, str(exc)))
    finally:
        scheme.shutdown()
        if audit:
            out.put(("audit", worker, found))


def sender(blob: bytes, out, commands, fork_sleeper: bool) -> None:
    """Connect one worker, optionally fork a sleeping child, then send the versions ``commands`` names."""
    scheme = pickle.loads(blob)
    model = make_model()
    scheme.init_on_sender(weights=model, num_workers=1)
    scheme.connect(timeout=60)
    if fork_sleeper:  # a child forked while the sender is open must not keep its sockets alive
        pid = os.fork()
        if pid == 0:
            time.sleep(120)
            os._exit(0)
        out.put(("sleeper", pid))
    while True:
        version = commands.get(timeout=120)
        for t in model.values():
            t.fill_(version)
        out.put(("sent", scheme.send(timeout=60)))
