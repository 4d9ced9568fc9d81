"""One run, two ways to move a 256 MiB update to N receiver processes over Gloo on this machine.

- raw: ``torch.distributed.broadcast`` of the same bytes from rank 0 on a plain default group of
  the same N + 1 processes, followed by an all-reduce of one byte (so the time covers arrival at
  every receiver, like the acks);
- wsync: ``WeightSyncScheme("distributed", backend="gloo").send()`` (sync: snapshot, one link
  per receiver, each receiver applies the version to its model and acks).

Both run in the same processes, interleaved round by round (the order alternates), so load from
elsewhere on the machine hits both alike; wsync's private links never touch the default group
the raw rounds use. One warm-up round each, then ``--repeats`` timed. For each N in
``--workers`` (fresh processes per N), prints p50 and p99 of both, their ratios, and wsync's
snapshot time (the links already send during it). p99 is the nearest-rank percentile: with
fewer than 100 rounds, the slowest round.

    .venv/bin/python benchmarks/bench_distributed.py [--mib 256] [--workers 2,4] [--repeats 15]
        [-o KEY=VALUE ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
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


def _raw_group(rank: int, world: int, port: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))


def _raw_round(buf: torch.Tensor, one: torch.Tensor) -> None:
    dist.broadcast(buf, src=0)
    dist.all_reduce(one)


def _raw_first(i: int) -> bool:
    return i % 2 == 0


def _receiver(args: dict, idx: int) -> None:
    torch.set_num_threads(1)
    _raw_group(idx + 1, args["workers"] + 1, args["raw_port"])
    buf = torch.empty(args["mib"] << 20, dtype=torch.uint8)
    one = torch.zeros(1, dtype=torch.uint8)
    scheme = args["scheme"]
    model = _model(args["mib"], -1.0)
    scheme.init_on_receiver(model=model, worker_idx=idx)
    scheme.connect()
    for i in range(args["repeats"] + 1):
        for raw in (_raw_first(i), not _raw_first(i)):
            if raw:
                _raw_round(buf, one)
            else:
                while scheme.version < i + 1:
                    scheme.receive(timeout=1.0)
    if not torch.equal(model["weight"], torch.full_like(model["weight"], float(args["repeats"] + 1))):
        raise SystemExit(f"receiver {idx}: the model does not hold the last version")
    scheme.shutdown()
    dist.destroy_process_group()


def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0-100) of ``values``."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def run(mib: int, workers: int, repeats: int, options: dict) -> dict:
    """One measurement: ``workers`` receiver processes, ``repeats`` interleaved rounds after a warm-up."""
    scheme = WeightSyncScheme("distributed", timeout=300.0, backend="gloo", **options)
    raw_port = _free_port()
    args = {"raw_port": raw_port, "mib": mib, "repeats": repeats, "scheme": scheme, "workers": workers}
    ctx = mp.get_context("spawn")
    children = [ctx.Process(target=_receiver, args=(args, i)) for i in range(workers)]
    for child in children:
        child.start()
    try:
        _raw_group(0, workers + 1, raw_port)
        buf = torch.full((mib << 20,), 7, dtype=torch.uint8)
        one = torch.zeros(1, dtype=torch.uint8)
        model = _model(mib, 0.0)
        scheme.init_on_sender(weights=model, num_workers=workers)
        scheme.connect()
        raw, ours, snapshots = [], [], []
        for i in range(repeats + 1):  # round 0 is a warm-up (it also makes wsync's links)
            for is_raw in (_raw_first(i), not _raw_first(i)):
                if is_raw:
                    t0 = time.perf_counter()
                    _raw_round(buf, one)
                    t1 = time.perf_counter()
                    if i:
                        raw.append(t1 - t0)
                else:
                    model["weight"].fill_(float(i + 1))
                    t0 = time.perf_counter()
                    scheme.send()
                    t1 = time.perf_counter()
                    if i:
                        ours.append(t1 - t0)
                        snapshots.append(scheme.last_report.snapshot_s)
        scheme.shutdown()
        dist.destroy_process_group()
    finally:
        for child in children:
            child.join(300)
            if child.is_alive():
                child.kill()
    failed = [c.exitcode for c in children if c.exitcode != 0]
    if failed:
        raise SystemExit(f"receiver processes failed (exit codes {failed})")
    stats = {}
    for name, values in (("raw", raw), ("wsync", ours)):
        stats[name] = {"p50_s": statistics.median(values), "p99_s": _percentile(values, 99), "all_s": values}
    return {
        "mib": mib, "workers": workers, "repeats": repeats, "options": options,
        "bucket_mb": scheme.transport.options["bucket_mb"], **stats,
        "ratio_p50": stats["wsync"]["p50_s"] / stats["raw"]["p50_s"],
        "ratio_p99": stats["wsync"]["p99_s"] / stats["raw"]["p99_s"],
        "wsync_snapshot_p50_s": statistics.median(snapshots),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--workers", default="2,4", help="receiver counts, comma-separated (default 2,4)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                        help="a transport option (VALUE read as JSON when it parses), e.g. -o bucket_mb=32")
    parser.add_argument("--json", default=None)
    a = parser.parse_args()

    torch.set_num_threads(1)
    options: dict = {}
    for item in a.option:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"-o needs KEY=VALUE, got {item!r}")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    results = []
    for n in [int(x) for x in a.workers.split(",")]:
        r = run(a.mib, n, a.repeats, options)
        results.append(r)
        shown = ", ".join(f"{k}={v}" for k, v in sorted(options.items()))
        print(f"{a.mib} MiB to {n} receivers, gloo, bucket_mb={r['bucket_mb']:g}{', ' + shown if shown else ''}, "
              f"{a.repeats} interleaved rounds:")
        for name, label in (("raw", "raw dist.broadcast (+1-byte all-reduce)"), ("wsync", "wsync distributed send (sync)")):
            s = r[name]
            gbps = (a.mib << 20) / s["p50_s"] / 1e9
            print(f"  {label:40s} p50 {s['p50_s'] * 1e3:8.1f} ms  p99 {s['p99_s'] * 1e3:8.1f} ms  ({gbps:.2f} GB/s)")
        print(f"  wsync snapshot p50 {r['wsync_snapshot_p50_s'] * 1e3:.1f} ms (the links send during it)")
        print(f"  ratio wsync/raw: p50 {r['ratio_p50']:.2f}x, p99 {r['ratio_p99']:.2f}x (target <= 1.25x)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
