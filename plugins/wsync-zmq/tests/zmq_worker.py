"""A worker process for the zmq tests: builds its own scheme from options, receives until stdin closes.

    python zmq_worker.py '{"worker": 0, "options": {...}, "width": 8, "timeout": 30}'

A stdin line ``{"pause": seconds}`` makes it stop calling ``receive()`` for that long (the
next ``receive()`` then waits up to 5 s for the newest version).
Prints one JSON line per applied version, ``{"v": version, "digest": sha256 of the weights}``,
and ``{"error": "..."}`` if connecting or receiving fails.
"""

from __future__ import annotations

import hashlib
import json
import select
import sys
import time

import torch
from torch import nn

from wsync_core import WeightSyncScheme, WsyncError


def make_model(seed: int, width: int = 8) -> nn.Module:
    """The tests' model: parameters, buffers and an int buffer, seeded."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, width), nn.BatchNorm1d(width), nn.Tanh(), nn.Linear(width, 3))
    return model


def digest(model: nn.Module) -> str:
    """sha256 over every tensor's bytes, in key order."""
    h = hashlib.sha256()
    for key, t in sorted(model.state_dict().items()):
        h.update(key.encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def say(**obj: object) -> None:
    print(json.dumps(obj), flush=True)


def main(config: dict) -> int:
    model = make_model(1000 + config["worker"], config.get("width", 8))
    scheme = WeightSyncScheme("zmq", timeout=config.get("timeout", 30.0), **config["options"])
    try:
        scheme.init_on_receiver(model=model, worker_idx=config["worker"])
        scheme.connect()
        say(v=scheme.version, digest=digest(model))
        wait = 0.02
        while True:
            try:
                v = scheme.receive(timeout=wait)
            except WsyncError as exc:
                say(error=f"{type(exc).__name__}: {exc}")
                continue
            if v is not None:
                say(v=v, digest=digest(model))
            if select.select([sys.stdin], [], [], 0)[0]:
                line = sys.stdin.readline()
                if not line:
                    return 0
                time.sleep(json.loads(line).get("pause", 0.0))  # a slow worker: no receive() meanwhile
                wait = 5.0  # back from it, the next receive() waits for the newest (a 20 ms one may
                # take what arrived while it was away, as the endpoint contract lets it)
            else:
                wait = 0.02
    except WsyncError as exc:
        say(error=f"{type(exc).__name__}: {exc}")
        return 1
    finally:
        scheme.shutdown()


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
