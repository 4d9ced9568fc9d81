"""A receiver process for the tests: builds its own scheme from options given on the command line.

Prints one JSON line per event: {"event": "applied", "version": v, "sum": ...} or {"event": "error", ...},
and at the end {"event": "done", "slowest": s}: the longest ``receive(timeout=0.5)`` call in seconds.
Run as ``python rpc_worker.py '<json>'`` (also under ``ip netns exec``).
"""

from __future__ import annotations

import json
import sys
import time

import torch
from wsync_core import WeightSyncScheme, WsyncError


def weights(value: float = 0.0) -> dict[str, torch.Tensor]:
    """The test model: a few tensors of several dtypes."""
    return {"a": torch.full((8, 4), value), "b": torch.full((3,), value, dtype=torch.float64),
            "c": torch.zeros((), dtype=torch.int64) + int(value)}


def main() -> None:
    cfg = json.loads(sys.argv[1])
    scheme = WeightSyncScheme("rpc", timeout=cfg.get("timeout", 60.0), **cfg["options"])
    model = weights(-1.0)
    scheme.init_on_receiver(model=model, worker_idx=cfg["idx"])

    def say(**kw):
        print(json.dumps(kw), flush=True)

    slowest = 0.0
    try:
        scheme.connect()
        say(event="applied", version=scheme.version, sum=float(model["a"].sum()))
        end = time.monotonic() + cfg.get("run_s", 60.0)
        while time.monotonic() < end and scheme.version < cfg.get("until", 0):
            t0 = time.monotonic()
            v = scheme.receive(timeout=0.5)
            slowest = max(slowest, time.monotonic() - t0)
            if v is not None:
                say(event="applied", version=v, sum=float(model["a"].sum()))
    except WsyncError as exc:
        say(event="error", type=type(exc).__name__, message=str(exc))
    finally:
        scheme.shutdown()
        say(event="done", slowest=slowest)


if __name__ == "__main__":
    main()
