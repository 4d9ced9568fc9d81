"""One run, two ways to move a 256 MiB update to one receiver process over Gloo on this machine.

- raw: ``torch.distributed.broadcast`` of the same bytes on a plain default group, followed by a
  one-byte broadcast back from the receiver (so the time covers arrival, like an ack);
- wsync: ``WeightSyncScheme("distributed", backend="gloo").send()`` (sync: snapshot, bucketed
  broadcast, apply into the receiver's model, ack).

Both run in the same two processes, one after the other. Prints medians and their ratio.

    .venv/bin/python benchmarks/bench_distributed.py [--mib 256] [--repeats 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from wsync_core import WeightSyncScheme


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(mib: int, value: float) -> dict[str, torch.Tensor]:
    return {"weight": torch.full((mib << 18,), value, dtype=torch.float32)}


def _raw_group(rank: int, port: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=120))


def _receiver(args: dict) -> None:
    torch.set_num_threads(1)
    _raw_group(1, args["raw_port"])
    buf = torch.empty(args["mib"] << 20, dtype=torch.uint8)
    one = torch.zeros(1, dtype=torch.uint8)
    for _ in range(args["repeats"] + 1):
        dist.broadcast(buf, src=0)
        dist.broadcast(one, src=1)
    dist.destroy_process_group()
    del buf
    scheme = args["scheme"]
    model = _model(args["mib"], -1.0)
    scheme.init_on_receiver(model=model, worker_idx=0)
    scheme.connect()
    while scheme.version < args["repeats"] + 1:
        scheme.receive(timeout=1.0)
    scheme.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--json", default=None)
    a = parser.parse_args()

    torch.set_num_threads(1)
    scheme = WeightSyncScheme("distributed", timeout=300.0, backend="gloo", bucket_mb=a.bucket_mb)
    raw_port = _free_port()
    child = mp.get_context("spawn").Process(
        target=_receiver, args=({"raw_port": raw_port, "mib": a.mib, "repeats": a.repeats, "scheme": scheme},))
    child.start()
    try:
        _raw_group(0, raw_port)
        buf = torch.full((a.mib << 20,), 7, dtype=torch.uint8)
        one = torch.zeros(1, dtype=torch.uint8)
        raw = []
        for i in range(a.repeats + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            dist.broadcast(buf, src=0)
            dist.broadcast(one, src=1)
            if i:
                raw.append(time.perf_counter() - t0)
        dist.destroy_process_group()
        del buf

        model = _model(a.mib, 0.0)
        scheme.init_on_sender(weights=model, num_workers=1)
        scheme.connect()
        ours, parts = [], []
        for v in range(1, a.repeats + 2):
            model["weight"].fill_(float(v))
            t0 = time.perf_counter()
            scheme.send()
            if v > 1:  # the first send builds the group: a warm-up, like the raw one
                ours.append(time.perf_counter() - t0)
                r = scheme.last_report
                parts.append({"snapshot_s": r.snapshot_s, "publish_s": r.publish_s})
        scheme.shutdown()
    finally:
        child.join(120)
        if child.is_alive():
            child.kill()
    raw_s, ours_s = statistics.median(raw), statistics.median(ours)
    result = {
        "mib": a.mib, "repeats": a.repeats, "bucket_mb": a.bucket_mb,
        "raw_broadcast_median_s": raw_s, "wsync_send_median_s": ours_s, "ratio": ours_s / raw_s,
        "raw_GBps": (a.mib << 20) / raw_s / 1e9, "wsync_GBps": (a.mib << 20) / ours_s / 1e9,
        "wsync_snapshot_median_s": statistics.median(p["snapshot_s"] for p in parts),
        "raw_all_s": raw, "wsync_all_s": ours,
    }
    print(f"{a.mib} MiB to 1 receiver, gloo, median of {a.repeats}:")
    print(f"  raw dist.broadcast (+1-byte reply): {raw_s * 1e3:8.1f} ms  ({result['raw_GBps']:.2f} GB/s)")
    print(f"  wsync distributed send (sync):      {ours_s * 1e3:8.1f} ms  ({result['wsync_GBps']:.2f} GB/s)"
          f"  of which snapshot {result['wsync_snapshot_median_s'] * 1e3:.1f} ms")
    print(f"  ratio wsync/raw: {result['ratio']:.2f}x (target <= 1.25x)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
