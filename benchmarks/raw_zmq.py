"""The floor for the zmq transport: raw pyzmq moving the same bytes to another process, with an ack.

    python benchmarks/raw_zmq.py [--kib 10] [--repeats 2000]

A ROUTER sends the payload as one zero-copy frame over TCP loopback; the worker process (a
DEALER) copies it into a preallocated buffer and answers a 3-byte ack. One round trip is the
smallest a weight update over zmq can cost: ``bench_zmq.py`` measures wsync against it.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch
import zmq

__all__ = ["Raw", "percentile"]


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def _raw_worker(address: str, nbytes: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    sock.send(b"hello")
    target = torch.empty(nbytes, dtype=torch.uint8)
    while True:
        frame = sock.recv(copy=False)
        if len(frame) == 0:
            break
        target.copy_(torch.frombuffer(frame.buffer, dtype=torch.uint8))
        sock.send(b"ack")
    sock.close(linger=0)
    ctx.term()


class Raw:
    """A raw pyzmq pipeline to one worker process: ``round_trip()`` sends ``nbytes`` and waits for the ack."""

    name = "raw pyzmq (send, copy, ack)"

    def __init__(self, nbytes: int) -> None:
        self.payload = torch.ones(nbytes, dtype=torch.uint8)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.proc = mp.get_context("spawn").Process(target=_raw_worker, args=(f"tcp://127.0.0.1:{port}", nbytes))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kib", type=int, default=10, help="payload in KiB (default 10)")
    parser.add_argument("--repeats", type=int, default=2000, help="timed round trips (default 2000)")
    args = parser.parse_args()
    raw = Raw(args.kib << 10)
    times = []
    try:
        for i in range(args.repeats + 10):
            t0 = time.perf_counter()
            raw.round_trip()
            if i >= 10:
                times.append(time.perf_counter() - t0)
    finally:
        raw.close()
    print(f"raw pyzmq, {args.kib} KiB round trip over TCP loopback, {args.repeats} repeats: "
          f"p50 {statistics.median(times) * 1e3:.3f} ms, p99 {percentile(times, 99) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
