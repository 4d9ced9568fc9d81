"""wsync's zmq transport against raw pyzmq moving the same bytes, in one run, over TCP loopback.

    python benchmarks/bench_zmq.py [--mib 256] [--repeats 9]

wsync: ``scheme.send()`` with ``sync=True``: snapshot into the send buffer, deliver to one worker
process, which checks and applies it into its model, then acks. Raw: a ROUTER sends the same
tensor's bytes as one zero-copy frame; the worker process copies them into a preallocated buffer
and acks. All three pipelines are up at once and their round trips are interleaved, so a noisy
machine slows them alike; each row is the median of ``--repeats`` timed round trips after a
warm-up, and the ratio is to raw.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable

import torch
import zmq

from wsync_core import WeightSyncScheme


def _weights(mib: int, fill: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((mib << 18,), fill, dtype=torch.float32)}  # float32: mib MiB


def _wsync_worker(address: str, checksum: bool, mib: int) -> None:
    model = _weights(mib, 0.0)
    scheme = WeightSyncScheme("zmq", address=address, checksum=checksum, timeout=300.0)
    scheme.init_on_receiver(model=model, worker_idx=0)
    scheme.connect()
    while model["w"][0].item() >= 0:  # the sender's last version, all -1, says stop
        scheme.receive(timeout=5.0)
    scheme.shutdown()


def _raw_worker(address: str, mib: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    sock.send(b"hello")
    target = torch.empty(mib << 20, dtype=torch.uint8)
    while True:
        frame = sock.recv(copy=False)
        if len(frame) == 0:
            break
        target.copy_(torch.frombuffer(frame.buffer, dtype=torch.uint8))
        sock.send(b"ack")
    sock.close(linger=0)
    ctx.term()


class Raw:
    name = "raw pyzmq (send, copy, ack)"

    def __init__(self, mib: int) -> None:
        self.payload = _weights(mib, 1.0)["w"].view(torch.uint8)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.proc = mp.get_context("spawn").Process(target=_raw_worker, args=(f"tcp://127.0.0.1:{port}", mib))
        self.proc.start()
        self.rid = self.sock.recv_multipart()[0]

    def round_trip(self) -> None:
        self.sock.send_multipart([self.rid, self.payload.numpy()], copy=False)
        self.sock.recv_multipart()

    def close(self) -> None:
        self.sock.send_multipart([self.rid, b""])
        self.proc.join(60)
        self.sock.close(linger=0)
        self.ctx.term()


class Wsync:
    def __init__(self, mib: int, checksum: bool) -> None:
        self.name = f"wsync zmq, checksum={checksum}" + (" (default)" if checksum else "")
        self.weights = _weights(mib, 1.0)
        self.scheme = WeightSyncScheme("zmq", checksum=checksum, timeout=300.0)
        self.scheme.init_on_sender(weights=self.weights, num_workers=1)
        self.proc = mp.get_context("spawn").Process(
            target=_wsync_worker, args=(self.scheme.transport.options["address"], checksum, mib))
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
    parser.add_argument("--repeats", type=int, default=9, help="timed round trips per row (default 9)")
    args = parser.parse_args()
    makers: list[Callable[[], object]] = [lambda: Raw(args.mib), lambda: Wsync(args.mib, False),
                                          lambda: Wsync(args.mib, True)]
    pipes = []
    try:
        for make in makers:
            pipes.append(make())
        times: dict[str, list[float]] = {p.name: [] for p in pipes}
        for i in range(args.repeats + 1):
            for p in pipes:
                if isinstance(p, Wsync):
                    p.weights["w"].add_(1.0)
                t0 = time.perf_counter()
                p.round_trip()
                if i:  # round 0 warms up
                    times[p.name].append(time.perf_counter() - t0)
    finally:
        for p in pipes:
            p.close()
    raw = statistics.median(times[pipes[0].name])
    print(f"{args.mib} MiB update to 1 receiver over TCP loopback, median of {args.repeats} interleaved round trips")
    print(f"{'method':<36} {'median ms':>10} {'min ms':>8} {'GB/s':>6} {'vs raw':>7}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<36} {med * 1e3:>10.1f} {min(ts) * 1e3:>8.1f} {(args.mib << 20) / med / 1e9:>6.2f} "
              f"{med / raw:>6.2f}x")


if __name__ == "__main__":
    main()
