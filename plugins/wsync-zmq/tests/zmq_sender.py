"""A sender process for the zmq tests: connects, then sends one version per line read from stdin.

    python zmq_sender.py '{"workers": 2, "options": {...}, "timeout": 30}'

Each stdin line is a JSON object of ``send()`` keywords (``{}`` or ``{"timeout": 3}``); each
result is printed as ``{"v": version, "digest": ...}`` or ``{"error": ..., "workers": [...]}``.
"""

from __future__ import annotations

import json
import sys

import torch

from wsync_core import WeightSyncScheme, WorkerTimeoutError, WsyncError
from zmq_worker import digest, make_model


def say(**obj: object) -> None:
    print(json.dumps(obj), flush=True)


def main(config: dict) -> int:
    model = make_model(0, config.get("width", 8))
    scheme = WeightSyncScheme("zmq", timeout=config.get("timeout", 30.0), **config["options"])
    scheme.init_on_sender(model=model, num_workers=config["workers"])
    try:
        try:
            scheme.connect()
            say(v=0, digest=digest(model))
        except WsyncError as exc:
            say(error=f"{type(exc).__name__}: {exc}", workers=getattr(exc, "workers", []))
        for line in sys.stdin:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.25)
            try:
                v = scheme.send(**json.loads(line))
                say(v=v, digest=digest(model))
            except WorkerTimeoutError as exc:
                say(v=scheme.version, digest=digest(model), error=str(exc), workers=exc.workers)
    finally:
        scheme.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
