"""One send loop, public API only, to compare two commits of wsync with the same program.

``wsync bench`` lives in the repository and changes with it (what its workers do between
updates, what the sender waits for), so running each commit's own ``wsync bench`` compares two
programs as well as two commits. This loop does not change: a ``Linear(50, 50)`` policy (10 KiB),
``--workers`` spawned processes that receive in a loop and report each version over a pipe, the
trainer changing a weight, timing a synchronous ``send()`` and waiting for every report before
the next step. Run it from each checkout (``PYTHONPATH`` pointing there), alternating::

    python benchmarks/same_loop.py mp --updates 1000
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from typing import Any

import torch
from wsync_core import WeightSyncScheme


def _policy() -> torch.nn.Module:
    return torch.nn.Linear(50, 50)


def _worker(scheme: Any, idx: int, conn: Any, stop: Any) -> None:
    torch.set_num_threads(1)
    model = _policy()
    scheme.init_on_receiver(model=model, worker_idx=idx)
    scheme.connect()
    try:
        while not stop.is_set():
            version = scheme.receive(timeout=0.1)
            if version is not None:
                conn.send_bytes(str(version).encode())
    finally:
        scheme.shutdown()


def run(transport: str, workers: int, updates: int, warmup: int) -> list[float]:
    """Seconds per synchronous ``send()``, after ``warmup`` untimed ones."""
    ctx = multiprocessing.get_context("spawn")
    model = _policy()
    scheme = WeightSyncScheme(transport, timeout=30.0)
    scheme.init_on_sender(model=model, num_workers=workers)
    stop = ctx.Event()
    pipes = [ctx.Pipe(duplex=False) for _ in range(workers)]
    procs = [ctx.Process(target=_worker, args=(scheme, i, pipes[i][1], stop), daemon=True) for i in range(workers)]
    for p in procs:
        p.start()
    took = []
    try:
        scheme.connect()
        for step in range(warmup + updates):
            with torch.no_grad():
                model.weight.add_(1.0)
            t0 = time.perf_counter()
            version = scheme.send()
            dt = time.perf_counter() - t0
            for reader, _ in pipes:  # every worker reports the version before the next step
                while int(reader.recv_bytes()) < version:
                    pass
            if step >= warmup:
                took.append(dt)
    finally:
        stop.set()
        for p in procs:
            p.join(30)
        scheme.shutdown()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("transport", help="transport name, e.g. shm or mp")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--updates", type=int, default=1000, help="timed sends")
    parser.add_argument("--warmup", type=int, default=100)
    args = parser.parse_args()
    took = sorted(run(args.transport, args.workers, args.updates, args.warmup))
    p99 = took[min(len(took) - 1, int(len(took) * 0.99))]
    print(f"{args.transport} {args.workers} workers, {len(took)} sends: p50 {statistics.median(took) * 1e3:.3f} ms, "
          f"p99 {p99 * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
