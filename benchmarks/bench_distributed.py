"""One run, two ways to move a 256 MiB update to one receiver process over Gloo on this machine.

- raw: ``torch.distributed.broadcast`` of the same bytes on a plain default group, followed by a
  one-byte broadcast back from the receiver (so the time covers arrival, like an ack);
- wsync: ``WeightSyncScheme("distributed", backend="gloo").send()`` (sync: snapshot, bucketed
  broadcast, the receiver applies it to its model, ack).

Both run in the same two processes, interleaved round by round (the order alternates), so load
from elsewhere on the machine hits both alike; wsync's private groups never touch the default
group the raw rounds use. One warm-up round each, then ``--repeats`` timed. Prints medians, their
ratio, and wsync's split from ``scheme.last_report``: the snapshot (with a streaming transport
the broadcast already runs during it) and the rest until the ack. Also the CPU time each round
costs both processes together (all threads; on a machine with few cores, extra CPU work is
extra wall-clock time), and a one-thread memcpy of the same bytes (what the snapshot copies).

    .venv/bin/python benchmarks/bench_distributed.py [--mib 256] [--repeats 7] [--bucket-mb B] [-o stream=false ...]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
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


def _raw_first(i: int) -> bool:
    return i % 2 == 0


def _receiver(args: dict) -> None:
    torch.set_num_threads(1)
    _raw_group(1, args["raw_port"])
    buf = torch.empty(args["mib"] << 20, dtype=torch.uint8)
    one = torch.zeros(1, dtype=torch.uint8)
    scheme = args["scheme"]
    model = _model(args["mib"], -1.0)
    scheme.init_on_receiver(model=model, worker_idx=0)
    scheme.connect()
    cpu: dict[str, list[float]] = {"raw": [], "wsync": []}
    for i in range(args["repeats"] + 1):
        for raw in (_raw_first(i), not _raw_first(i)):
            c0 = time.process_time()
            if raw:
                dist.broadcast(buf, src=0)
                dist.broadcast(one, src=1)
            else:
                while scheme.version < i + 1:
                    scheme.receive(timeout=1.0)
            if i:
                cpu["raw" if raw else "wsync"].append(time.process_time() - c0)
    with open(args["cpu_out"], "w") as f:
        json.dump(cpu, f)
    if not torch.equal(model["weight"], torch.full_like(model["weight"], float(args["repeats"] + 1))):
        raise SystemExit("receiver: the model does not hold the last version")
    scheme.shutdown()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--bucket-mb", type=float, default=None, help="the transport's bucket_mb (default: its own)")
    parser.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                        help="another transport option (VALUE read as JSON when it parses), e.g. -o devices=1")
    parser.add_argument("--json", default=None)
    a = parser.parse_args()

    torch.set_num_threads(1)
    options = {} if a.bucket_mb is None else {"bucket_mb": a.bucket_mb}
    for item in a.option:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"-o needs KEY=VALUE, got {item!r}")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    scheme = WeightSyncScheme("distributed", timeout=300.0, backend="gloo", **options)
    raw_port = _free_port()
    fd, cpu_out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    child = mp.get_context("spawn").Process(
        target=_receiver, args=({"raw_port": raw_port, "mib": a.mib, "repeats": a.repeats, "scheme": scheme,
                                 "cpu_out": cpu_out},))
    child.start()
    try:
        _raw_group(0, raw_port)
        buf = torch.full((a.mib << 20,), 7, dtype=torch.uint8)
        one = torch.zeros(1, dtype=torch.uint8)
        model = _model(a.mib, 0.0)
        scheme.init_on_sender(weights=model, num_workers=1)
        scheme.connect()
        raw, ours, parts, memcpy = [], [], [], []
        cpu: dict[str, list[float]] = {"raw": [], "wsync": []}
        copy_dst = torch.empty_like(buf)
        for i in range(a.repeats + 1):  # round 0 is a warm-up (it also builds wsync's group)
            for is_raw in (_raw_first(i), not _raw_first(i)):
                if is_raw:
                    c0, t0 = time.process_time(), time.perf_counter()
                    dist.broadcast(buf, src=0)
                    dist.broadcast(one, src=1)
                    t1, c1 = time.perf_counter(), time.process_time()
                    if i:
                        raw.append(t1 - t0)
                        cpu["raw"].append(c1 - c0)
                else:
                    model["weight"].fill_(float(i + 1))
                    c0, t0 = time.process_time(), time.perf_counter()
                    scheme.send()
                    t1, c1 = time.perf_counter(), time.process_time()
                    if i:
                        ours.append(t1 - t0)
                        cpu["wsync"].append(c1 - c0)
                        r = scheme.last_report
                        parts.append({"snapshot_s": r.snapshot_s, "ack_s": r.ack_latency[0]})
            t0 = time.perf_counter()
            copy_dst.copy_(buf)
            if i:
                memcpy.append(time.perf_counter() - t0)
        del copy_dst
        scheme.shutdown()
        dist.destroy_process_group()
    finally:
        child.join(120)
        if child.is_alive():
            child.kill()
    if child.exitcode != 0:
        raise SystemExit(f"the receiver process failed (exit code {child.exitcode})")
    with open(cpu_out) as f:
        cpu_receiver = json.load(f)
    os.unlink(cpu_out)
    cpu_s = {k: statistics.median(a + b for a, b in zip(cpu[k], cpu_receiver[k])) for k in cpu}
    raw_s, ours_s = statistics.median(raw), statistics.median(ours)
    snap_s = statistics.median(p["snapshot_s"] for p in parts)
    rest_s = statistics.median(p["ack_s"] - p["snapshot_s"] for p in parts)
    result = {
        "mib": a.mib, "repeats": a.repeats, "bucket_mb": scheme.transport.options["bucket_mb"], "options": options,
        "raw_broadcast_median_s": raw_s, "wsync_send_median_s": ours_s, "ratio": ours_s / raw_s,
        "raw_GBps": (a.mib << 20) / raw_s / 1e9, "wsync_GBps": (a.mib << 20) / ours_s / 1e9,
        "wsync_snapshot_median_s": snap_s, "wsync_after_snapshot_median_s": rest_s,
        "memcpy_median_s": statistics.median(memcpy),
        "cpu_median_s": cpu_s, "cpu_sender_s": cpu, "cpu_receiver_s": cpu_receiver,
        "raw_all_s": raw, "wsync_all_s": ours,
        "wsync_parts": parts,
    }
    shown = ", ".join(f"{k}={v}" for k, v in sorted(options.items()) if k != "bucket_mb")
    print(f"{a.mib} MiB to 1 receiver, gloo, bucket_mb={result['bucket_mb']:g}{', ' + shown if shown else ''}, "
          f"median of {a.repeats} interleaved rounds:")
    print(f"  raw dist.broadcast (+1-byte reply):  {raw_s * 1e3:8.1f} ms  ({result['raw_GBps']:.2f} GB/s)")
    print(f"  wsync distributed send (sync):       {ours_s * 1e3:8.1f} ms  ({result['wsync_GBps']:.2f} GB/s)")
    print(f"    snapshot (broadcast streams during it) {snap_s * 1e3:.1f} ms, then until the ack {rest_s * 1e3:.1f} ms")
    print(f"  CPU time per round, both processes: raw {cpu_s['raw'] * 1e3:.1f} ms, wsync {cpu_s['wsync'] * 1e3:.1f} ms; "
          f"a one-thread memcpy of the same bytes: {result['memcpy_median_s'] * 1e3:.1f} ms")
    print(f"  ratio wsync/raw: {result['ratio']:.2f}x (target <= 1.25x)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
