"""wsync's zmq transport against raw pyzmq moving the same bytes, in one run, over TCP loopback.

    python benchmarks/bench_zmq.py [--mib 256 | --kib 10] [--repeats 9]

wsync: ``scheme.send()`` with ``sync=True``: snapshot into the send buffer, deliver to one worker
process, which checks and applies it into its model, then acks. Raw: a ROUTER sends the same
tensor's bytes as one zero-copy frame; the worker process copies them into a preallocated buffer
and acks. All three pipelines are up at once and their round trips are interleaved, so a noisy
machine slows them alike; each row gives p50 and p99 of ``--repeats`` timed round trips after a
warm-up, and the ratio of the p50s to raw (``raw_zmq.py`` is the raw pipeline).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable

import torch

from raw_zmq import Raw, percentile
from wsync_core import WeightSyncScheme


def _weights(kib: int, fill: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((kib << 8,), fill, dtype=torch.float32)}  # float32: kib KiB


def _wsync_worker(address: str, checksum: bool, kib: int, profile: str | None = None) -> None:
    model = _weights(kib, 0.0)
    scheme = WeightSyncScheme("zmq", address=address, checksum=checksum, timeout=300.0)
    scheme.init_on_receiver(model=model, worker_idx=0)
    scheme.connect()
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    while model["w"][0].item() >= 0:  # the sender's last version, all -1, says stop
        scheme.receive(timeout=5.0)
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile)
    scheme.shutdown()


class Wsync:
    def __init__(self, kib: int, checksum: bool, profile: str | None = None) -> None:
        self.name = f"wsync zmq, checksum={checksum}" + (" (default)" if checksum else "")
        self.weights = _weights(kib, 1.0)
        self.scheme = WeightSyncScheme("zmq", checksum=checksum, timeout=300.0)
        self.scheme.init_on_sender(weights=self.weights, num_workers=1)
        self.proc = mp.get_context("spawn").Process(
            target=_wsync_worker, args=(self.scheme.transport.options["address"], checksum, kib, profile))
        self.proc.start()
        self.scheme.connect()

    def round_trip(self) -> None:
        self.scheme.send()

    def close(self) -> None:
        self.weights["w"].fill_(-1.0)
        self.scheme.send()
        self.proc.join(60)
        self.scheme.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="update size in MiB (default 256)")
    parser.add_argument("--kib", type=int, default=None, help="update size in KiB (instead of --mib)")
    parser.add_argument("--repeats", type=int, default=9, help="timed round trips per row (default 9)")
    parser.add_argument("--profile", default=None, help="write a cProfile of the default wsync row's sender here (and of its worker to PATH.worker)")
    args = parser.parse_args()
    kib = args.kib if args.kib is not None else args.mib << 10
    size = f"{kib} KiB" if args.kib is not None else f"{args.mib} MiB"
    makers: list[Callable[[], object]] = [lambda: Raw(kib << 10), lambda: Wsync(kib, False),
                                          lambda: Wsync(kib, True, args.profile and args.profile + ".worker")]
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
    pipes = []
    try:
        for make in makers:
            pipes.append(make())
        times: dict[str, list[float]] = {p.name: [] for p in pipes}
        for i in range(args.repeats + 1):
            for p in pipes:
                if isinstance(p, Wsync):
                    p.weights["w"].add_(1.0)
                profiling = profiler is not None and i and p is pipes[-1]
                if profiling:
                    profiler.enable()
                t0 = time.perf_counter()
                p.round_trip()
                if i:  # round 0 warms up
                    times[p.name].append(time.perf_counter() - t0)
                if profiling:
                    profiler.disable()
    finally:
        for p in pipes:
            p.close()
    raw = statistics.median(times[pipes[0].name])
    print(f"{size} update to 1 receiver over TCP loopback, {args.repeats} interleaved round trips each")
    print(f"{'method':<36} {'p50 ms':>9} {'p99 ms':>9} {'GB/s':>6} {'p50 vs raw':>10}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<36} {med * 1e3:>9.3f} {percentile(ts, 99) * 1e3:>9.3f} {(kib << 10) / med / 1e9:>6.2f} "
              f"{med / raw:>9.2f}x")
    if profiler is not None:
        profiler.dump_stats(args.profile)


if __name__ == "__main__":
    main()
