"""A receiver process for the tests: builds its own scheme from options given on the command line.

Prints one JSON line per event: {"event": "applied", "version": v, "sum": ..., "lo": ..., "hi": ...}
(lo/hi: the smallest and largest value in the whole model) or {"event": "error", ...}, and last
{"event": "done", "version": v, "lo": ..., "hi": ..., "slowest": s} (the model as it ends, and the
longest a ``receive()`` call took, in seconds); each line also has "at" (``time.time()``). With
``"keep_going": true`` a TransportError from ``receive()`` is printed and the loop goes
on. With ``"stacks": path`` it writes every thread's stack to ``path`` on SIGUSR1 (to see where a
test's worker hangs). With ``"hold": {"at": v, "file": path}`` it stops calling ``receive()``
once it holds version v and checks, again and again until ``path`` exists, that its model still holds exactly v (deliveries
keep arriving in the background meanwhile); then prints {"event": "held", "checks": n, "bad": k,
"pool": receive buffers} and goes on. Run as ``python dist_worker.py '<json>'`` (also under
``ip netns exec``).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time

import torch
from wsync_core import TransportError, WeightSyncScheme, WsyncError


def weights(variant: str, value: float = 0.0) -> dict[str, torch.Tensor]:
    """The test model: 'base' (a few tensors), 'other' (one shape differs), 'kibN' (N KiB), 'bigN'
    (N MiB) or 'mixedN' (N MiB of float32, then a small float64 tensor)."""
    if variant.startswith("kib"):
        return {"w": torch.full((int(variant[3:]) << 8,), value, dtype=torch.float32)}
    if variant.startswith("big"):
        mib = int(variant[3:] or 16)
        return {"w": torch.full((mib << 18,), value, dtype=torch.float32)}
    if variant.startswith("mixed"):
        mib = int(variant[5:] or 16)
        return {"a": torch.full((mib << 18,), value, dtype=torch.float32),
                "b": torch.full((3,), value, dtype=torch.float64)}
    shape = (8, 5) if variant == "other" else (8, 4)
    return {"a": torch.full(shape, value), "b": torch.full((3,), value, dtype=torch.float64),
            "c": torch.zeros((), dtype=torch.int64) + int(value)}


def send_versions(scheme: WeightSyncScheme, w: dict[str, torch.Tensor], proc, versions: list[int]) -> list[dict]:
    """For the tests' sender side: connect, send each version (every tensor filled with it), shut
    down; returns the worker process's "applied" lines."""
    try:
        scheme.connect()
        for v in versions:
            for t in w.values():
                t.fill_(v)
            assert scheme.send() == v
    finally:
        scheme.shutdown()
    return [line for line in proc.lines() if line["event"] == "applied"]


def main() -> None:
    cfg = json.loads(sys.argv[1])
    if "stacks" in cfg:  # a path: every thread's stack is written there on SIGUSR1
        stacks = open(cfg["stacks"], "w")  # noqa: SIM115 (open until the process ends)
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    scheme = WeightSyncScheme("distributed", timeout=cfg.get("timeout", 60.0), **cfg["options"])
    model = {k: t.to(cfg.get("device", "cpu")) for k, t in weights(cfg.get("variant", "base"), -1.0).items()}
    scheme.init_on_receiver(model=model, worker_idx=cfg["idx"])

    def say(**kw):
        print(json.dumps({**kw, "at": time.time()}), flush=True)

    def bounds() -> tuple[float, float]:
        return (min(float(t.min()) for t in model.values() if t.numel()),
                max(float(t.max()) for t in model.values() if t.numel()))

    def applied(version: int) -> None:
        lo, hi = bounds()
        say(event="applied", version=version, sum=float(model["a" if "a" in model else "w"].sum()), lo=lo, hi=hi)

    slowest = 0.0

    try:
        scheme.connect()
        applied(scheme.version)
        end = time.monotonic() + cfg.get("run_s", 60.0)
        hold = cfg.get("hold")
        while time.monotonic() < end and scheme.version < cfg.get("until", 0):
            if hold and scheme.version == hold["at"]:
                checks = bad = 0
                while not os.path.exists(hold["file"]) and time.monotonic() < end:
                    checks += 1
                    bad += sum(not bool((t == hold["at"]).all()) for t in model.values())
                    time.sleep(0.01)
                say(event="held", checks=checks, bad=bad, pool=len(scheme._role.endpoint.pool))
                hold = None
            t0 = time.monotonic()
            try:
                v = scheme.receive(timeout=0.5)
            except TransportError as exc:
                if not cfg.get("keep_going"):
                    raise
                say(event="error", type=type(exc).__name__, message=str(exc))
                time.sleep(0.5)
                continue
            finally:
                slowest = max(slowest, time.monotonic() - t0)
            if v is not None:
                applied(v)
    except WsyncError as exc:
        say(event="error", type=type(exc).__name__, message=str(exc))
    finally:
        lo, hi = bounds()
        version = scheme.version
        t0 = time.monotonic()
        scheme.shutdown()
        left = sorted(t.name for t in threading.enumerate() if t.name.startswith("wsync"))
        say(event="done", version=version, lo=lo, hi=hi, slowest=slowest, shutdown_s=time.monotonic() - t0,
            threads=left)


if __name__ == "__main__":
    main()
