"""A tcp worker process for the tests: builds its own scheme from options, receives until stdin closes.

    python tcp_worker.py '{"worker": 0, "options": {...}, "timeout": 30}'

Prints one JSON line per applied version, ``{"v": version, "digest": ...}``, and
``{"error": "TransportError: ..."}`` if connecting or receiving fails; with ``"announce": true``,
``{"ready": true}`` first, just before it connects.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import sys
import time

import torch
from torch import nn
from wsync_core import WeightSyncScheme, WsyncError


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for key, t in sorted(model.state_dict().items()):
        h.update(key.encode() + t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def say(**obj: object) -> None:
    print(json.dumps(obj), flush=True)


def main(config: dict) -> int:
    model = make_model(1000 + config["worker"])
    scheme = WeightSyncScheme("tcp", timeout=config["timeout"], **config["options"])
    try:
        scheme.init_on_receiver(model=model, worker_idx=config["worker"])
        if config.get("announce"):  # the test waits for this before it gives the sender a short timeout
            say(ready=True)
        scheme.connect()
        if config.get("fork"):  # a child that outlives this process must not keep its connection open
            child = os.fork()
            if child == 0:
                time.sleep(120)
                os._exit(0)
            say(child=child)
        say(v=scheme.version, digest=digest(model))
        while True:
            try:
                v = scheme.receive(timeout=0.02)
            except WsyncError as exc:
                say(error=f"{type(exc).__name__}: {exc}")
                continue
            if v is not None:
                say(v=v, digest=digest(model))
            if select.select([sys.stdin], [], [], 0)[0] and not sys.stdin.readline():
                return 0
    except WsyncError as exc:
        say(error=f"{type(exc).__name__}: {exc}")
        return 1
    finally:
        scheme.shutdown()


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
