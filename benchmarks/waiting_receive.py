"""A worker back from a rollout: the time of a ``receive()`` that finds the next version waiting.

The trainer changes a weight, calls ``send_async()``, trains for ``--step-ms`` in Python (holding
the GIL, as a training loop's Python does between kernels) and waits for the ack; one spawned
worker runs a ``--rollout-ms`` rollout (longer than the step, so a version is waiting when it
comes back), then times ``receive(timeout=1.0)``. What it prints is what a rollout loop pays per
update to take a version that is already there, p50 / p90 / p99::

    python benchmarks/waiting_receive.py mp --seconds 15
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from typing import Any

import torch
from wsync_core import WeightSyncScheme


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _worker(scheme: Any, rollout_s: float, conn: Any, stop: Any) -> None:
    torch.set_num_threads(1)
    scheme.init_on_receiver(model=torch.nn.Linear(50, 50), worker_idx=0)
    scheme.connect()
    took = []
    try:
        while not stop.is_set():
            _busy(rollout_s)
            t0 = time.perf_counter()
            version = scheme.receive(timeout=1.0)
            if version is not None:
                took.append(time.perf_counter() - t0)
    finally:
        conn.send_bytes(json.dumps(took).encode())
        scheme.shutdown()


def run(transport: str, step_s: float, rollout_s: float, seconds: float) -> list[float]:
    """Seconds per ``receive()`` that returned a version, in the worker."""
    ctx = multiprocessing.get_context("spawn")
    model = torch.nn.Linear(50, 50)
    scheme = WeightSyncScheme(transport, timeout=30.0)
    scheme.init_on_sender(model=model, num_workers=1)
    stop = ctx.Event()
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_worker, args=(scheme, rollout_s, writer, stop), daemon=True)
    proc.start()
    try:
        scheme.connect()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            with torch.no_grad():
                model.weight.add_(1.0)
            handle = scheme.send_async()
            _busy(step_s)
            handle.wait()
        stop.set()
        took = json.loads(reader.recv_bytes())
    finally:
        stop.set()
        proc.join(30)
        scheme.shutdown()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("transport", help="transport name, e.g. shm or mp")
    parser.add_argument("--step-ms", type=float, default=10.0, help="the trainer's step, in Python")
    parser.add_argument("--rollout-ms", type=float, default=15.0, help="the worker's rollout between receives")
    parser.add_argument("--seconds", type=float, default=15.0)
    args = parser.parse_args()
    took = sorted(run(args.transport, args.step_ms / 1e3, args.rollout_ms / 1e3, args.seconds))
    if not took:
        raise SystemExit("no receive returned a version")
    at = [took[min(len(took) - 1, int(len(took) * q))] * 1e3 for q in (0.5, 0.9, 0.99)]
    print(f"{args.transport} {len(took)} receives: p50 {at[0]:.3f} ms, p90 {at[1]:.3f} ms, p99 {at[2]:.3f} ms")


if __name__ == "__main__":
    main()
