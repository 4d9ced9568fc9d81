"""A model on a GPU synced to worker processes whose models are on the same GPU, against the copies
isolation needs, measured raw in the same run (issue 21).

The trainer holds a state_dict of four float32 tensors on ``--device``; each worker process holds
its own model on that device. ``send()`` (sync) is timed after warm-up sends. The floor is what
no transport that keeps workers isolated can skip: one copy of the snapshot off the device (here:
into host memory, as shm's slot) and one copy onto the device per worker; the floor's copies are
timed in the trainer's process with the same sizes (device to pageable host, pageable host to
device; the workers' copies onto the device run side by side, so the floor counts one).

    python benchmarks/device_sync.py --transport shm --sizes 10MiB,1GiB --workers 2 --repeat 20
    python benchmarks/device_sync.py --device cpu --sizes 1MiB --repeat 3    (a smoke run)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch

from wsync_bench.harness import format_size, parse_size
from wsync_core import WeightSyncScheme


def _model(nbytes: int, device: str) -> dict[str, torch.Tensor]:
    n = max(1, nbytes // 16)
    return {f"w{i}": torch.zeros(n, dtype=torch.float32, device=device) for i in range(4)}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _worker(scheme: WeightSyncScheme, idx: int, nbytes: int, device: str, ready, stop, out) -> None:
    model = _model(nbytes, device)
    scheme.init_on_receiver(model=model, worker_idx=idx)
    scheme.connect()
    ready.put(idx)
    while not stop.is_set():
        scheme.receive(timeout=0.2)
    # what the worker holds: its device, and the sum of the first tensor (the trainer checks it)
    out.put((idx, str(model["w0"].device), float(model["w0"].double().sum()), scheme.version))
    scheme.shutdown()


def _percentiles(times: list[float]) -> tuple[float, float]:
    s = sorted(times)
    return statistics.median(s), s[min(len(s) - 1, int(len(s) * 0.99))]


def _floor(nbytes: int, device: str, repeat: int) -> tuple[float, float]:
    """p50 of one copy off the device into pageable host memory, and of one copy back onto it."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8)
    off, on = [], []
    for _ in range(repeat + 2):
        _sync(device)
        t0 = time.perf_counter()
        host.copy_(src)
        _sync(device)
        t1 = time.perf_counter()
        src.copy_(host)
        _sync(device)
        t2 = time.perf_counter()
        off.append(t1 - t0)
        on.append(t2 - t1)
    return _percentiles(off[2:])[0], _percentiles(on[2:])[0]


def run(transport: str, nbytes: int, workers: int, repeat: int, device: str) -> str:
    """One size: the sends' p50/p99, the floor and their ratio, and what each worker held."""
    ctx = mp.get_context("spawn")
    model = _model(nbytes, device)
    sender = WeightSyncScheme(transport, timeout=120.0)
    sender.init_on_sender(model=model, num_workers=workers)
    ready, stop, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(sender, i, nbytes, device, ready, stop, out))  # the scheme pickles
             for i in range(workers)]
    for p in procs:
        p.start()
    try:
        sender.connect()
        for _ in procs:
            ready.get(timeout=300)
        times, last = [], -1
        for _ in range(repeat + 3):
            with torch.no_grad():
                model["w0"].add_(1.0)
            _sync(device)
            t0 = time.perf_counter()
            last = sender.send()
            times.append(time.perf_counter() - t0)
        stop.set()
        held = sorted(out.get(timeout=120) for _ in procs)
    finally:
        stop.set()
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
        sender.shutdown()
    p50, p99 = _percentiles(times[3:])
    off, on = _floor(nbytes, device, repeat)
    want = float(model["w0"].double().sum())
    exact = all(h[2] == want and h[3] == last for h in held)
    where = ",".join(sorted({h[1] for h in held}))
    return (f"{transport} {format_size(nbytes)} to {workers} workers on {device}: p50 {p50 * 1e3:.3f} ms, "
            f"p99 {p99 * 1e3:.3f} ms; floor {(off + on) * 1e3:.3f} ms (off the device {off * 1e3:.3f}, onto it "
            f"{on * 1e3:.3f}): {p50 / (off + on):.2f}x; workers' models on {where}, "
            f"{'exact' if exact else 'NOT EXACT'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transport", default="shm")
    p.add_argument("--sizes", default="10MiB,1GiB")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    if args.device.startswith("cuda"):
        print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    for size in args.sizes.split(","):
        print(run(args.transport, parse_size(size), args.workers, args.repeat, args.device), flush=True)


if __name__ == "__main__":
    main()
