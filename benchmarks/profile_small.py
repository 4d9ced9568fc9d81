"""The Python cost of a small update, without wake-ups (issue 20).

A sender and ``--workers`` receivers of one transport in this one process (the receivers
connect in threads, then are driven in turn from the main thread): each round bumps the model, calls
``send_async()``, has every receiver ``receive()`` it, then ``wait()``s for the acks. Each call
is timed in this thread's CPU time (``time.thread_time``), so what it prints is the CPU each
step costs, not the waiting a loaded machine adds. ``--profile`` prints a cProfile instead.

    python benchmarks/profile_small.py --transport shm --workers 2 --rounds 2000
"""

from __future__ import annotations

import argparse
import cProfile
import pickle
import pstats
import statistics
import threading
import time

import torch

from wsync_bench.harness import _bump, build_model, parse_size
from wsync_core import WeightSyncScheme


def main() -> None:
    """Parse arguments, connect, time ``--rounds`` rounds after 200 untimed ones, print p50/p99."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transport", default="shm")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--size", default="10KiB")
    p.add_argument("--rounds", type=int, default=2000)
    p.add_argument("--profile", action="store_true", help="print a cProfile of the rounds (sorted by own time)")
    args = p.parse_args()
    torch.set_num_threads(1)
    nbytes = parse_size(args.size)
    model = build_model(nbytes)
    sender = WeightSyncScheme(args.transport, sync=False)
    sender.init_on_sender(model=model, num_workers=args.workers)
    receivers = []
    for w in range(args.workers):
        r: WeightSyncScheme = pickle.loads(pickle.dumps(sender))  # our own object: how a worker gets it
        r.init_on_receiver(model=build_model(nbytes), worker_idx=w)
        receivers.append(r)
    threads = [threading.Thread(target=r.connect) for r in receivers]
    for t in threads:
        t.start()
    sender.connect()
    for t in threads:
        t.join()
    times: dict[str, list[float]] = {"send_async": [], "receive (each)": [], "wait": []}

    def rounds(n: int) -> None:
        for _ in range(n):
            _bump(model)
            t0 = time.thread_time()
            handle = sender.send_async()
            t1 = time.thread_time()
            for r in receivers:
                while r.receive(timeout=1.0) is None:
                    pass
            t2 = time.thread_time()
            handle.wait()
            t3 = time.thread_time()
            times["send_async"].append(t1 - t0)
            times["receive (each)"].append((t2 - t1) / len(receivers))
            times["wait"].append(t3 - t2)

    try:
        rounds(200)
        for v in times.values():
            v.clear()
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            rounds(args.rounds)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(40)
        else:
            rounds(args.rounds)
            for name, v in times.items():
                v.sort()
                print(f"{name:15s} p50 {statistics.median(v) * 1e6:7.1f} us   p99 {v[int(len(v) * 0.99)] * 1e6:7.1f} us")
    finally:
        for r in receivers:
            r.shutdown()
        sender.shutdown()


if __name__ == "__main__":
    main()
