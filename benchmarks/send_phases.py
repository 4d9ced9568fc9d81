"""Where a large synchronous send's time goes: the snapshot, then publish to the last ack, against
a memcpy of the same bytes with the same threads, in the same run.

The trainer and ``--workers`` spawned worker processes hold ``wsync bench``'s model
(``wsync_bench.harness.build_model``); each worker reads every weight twice after each receive
(as a rollout would), and the trainer waits for those reads before its next step. Before each
send the weights change by ``add_`` (a training step, untimed). Per send: the whole ``send()``,
its snapshot (``SendReport.snapshot_s``: taking a buffer and copying the model into it) and the
rest (publish to the last ack)::

    python benchmarks/send_phases.py shm --workers 8 --mib 512 --repeat 20
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from typing import Any

import torch
from wsync_core import WeightSyncScheme

from wsync_bench.harness import _bump, _read_all, build_model, memcpy_floor


def _worker(scheme: Any, idx: int, nbytes: int, conn: Any, stop: Any) -> None:
    torch.set_num_threads(1)
    model = build_model(nbytes)
    scheme.init_on_receiver(model=model, worker_idx=idx)
    scheme.connect()
    try:
        while not stop.is_set():
            if scheme.receive(timeout=0.1) is not None:
                _read_all(model)
                _read_all(model)
                conn.send_bytes(b"read")
    finally:
        scheme.shutdown()


def measure(transport: str, workers: int, nbytes: int, repeat: int, warmup: int = 3) -> list[tuple[float, float]]:
    """(whole send, snapshot) seconds for ``repeat`` synchronous sends after ``warmup``."""
    model = build_model(nbytes)
    scheme = WeightSyncScheme(transport, timeout=120.0)
    scheme.init_on_sender(model=model, num_workers=workers)
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    pipes = [ctx.Pipe(duplex=False) for _ in range(workers)]
    procs = [ctx.Process(target=_worker, args=(scheme, i, nbytes, pipes[i][1], stop), daemon=True)
             for i in range(workers)]
    for p in procs:
        p.start()
    out: list[tuple[float, float]] = []
    try:
        scheme.connect()
        for k in range(warmup + repeat):
            _bump(model)
            t0 = time.perf_counter()
            scheme.send()
            took = time.perf_counter() - t0
            for reader, _ in pipes:
                if not reader.poll(120.0):
                    raise RuntimeError("a worker did not report its reads within 120 s")
                reader.recv_bytes()
            if k >= warmup:
                out.append((took, scheme.last_report.snapshot_s))
    finally:
        stop.set()
        for p in procs:
            p.join(30)
        scheme.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("transport")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    nbytes = args.mib << 20
    rows = measure(args.transport, args.workers, nbytes, args.repeat, args.warmup)
    floor = memcpy_floor(nbytes, args.repeat)

    def ms(values: list[float], q: float) -> str:
        return f"{statistics.quantiles(values, n=100)[int(q) - 1] * 1e3:.2f}" if len(values) > 1 else f"{values[0] * 1e3:.2f}"

    def p50(values: list[float]) -> str:
        return f"{statistics.median(values) * 1e3:.2f}"

    sends, snaps = [r[0] for r in rows], [r[1] for r in rows]
    after = [a - b for a, b in rows]
    print(f"{args.transport}, {args.workers} workers, {args.mib} MiB, {len(rows)} sends"
          f", p50 / p99 ms: "
          f"send {p50(sends)} / {ms(sends, 99)}, snapshot {p50(snaps)} / {ms(snaps, 99)}, "
          f"publish to last ack {p50(after)} / {ms(after, 99)}; "
          f"memcpy ({torch.get_num_threads()} threads) {p50(floor)} / {ms(floor, 99)}; "
          f"send x memcpy {statistics.median(sends) / statistics.median(floor):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
