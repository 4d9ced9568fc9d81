"""A model on a GPU synced to worker processes whose models are on the same GPU, against the copies
isolation needs, measured raw in the same run (issue 21).

The trainer holds a module of four float32 parameters on ``--device``; each worker process holds
its own module on that device. ``send()`` (sync) is timed after warm-up sends. The floor is what
no transport that keeps workers isolated can skip: one copy of the snapshot off the device (here:
into host memory, as shm's slot) and one copy onto the device per worker; the floor's copies are
timed in the trainer's process with the same sizes (device to pageable host, pageable host to
device; the workers' copies onto the device run side by side, so the floor counts one).

``--transport torchrl:SharedMem`` (or ``torchrl:MultiProcess``) runs TorchRL's scheme of that
name the way its collectors do (a TensorDict of the trainer's weights, ``send(weights=...)``
after copying the live weights into it; its workers apply them in a thread of their own), in the
same harness.

    python benchmarks/device_sync.py --transport shm --sizes 10MiB,1GiB --workers 2 --repeat 20
    python benchmarks/device_sync.py --transport shm -o cuda_ipc=true --sizes 10MiB,1GiB
    python benchmarks/device_sync.py --transport torchrl:SharedMem --sizes 10MiB,1GiB
    python benchmarks/device_sync.py --device cpu --sizes 1MiB --repeat 3    (a smoke run)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import torch

from wsync_bench.harness import format_size, parse_size
from wsync_core import WeightSyncScheme


class _Policy(torch.nn.Module):
    """Four float32 parameters of ``nbytes`` in all, zeros, on ``device``."""

    def __init__(self, nbytes: int, device: str) -> None:
        super().__init__()
        n = max(1, nbytes // 16)
        for i in range(4):
            self.register_parameter(f"w{i}", torch.nn.Parameter(torch.zeros(n, device=device), requires_grad=False))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _worker(scheme, idx: int, nbytes: int, device: str, ready, stop, out) -> None:
    model = _Policy(nbytes, device)
    torchrl = not isinstance(scheme, WeightSyncScheme)
    if torchrl:
        scheme.init_on_receiver(model_id="policy", model=model, worker_idx=idx)
        scheme.connect(worker_idx=idx)
    else:
        scheme.init_on_receiver(model=model, worker_idx=idx)
        scheme.connect()
    ready.put(idx)
    while not stop.is_set():
        if torchrl:  # its schemes apply weights in a thread of their own (or alias the trainer's)
            stop.wait(0.2)
        else:
            scheme.receive(timeout=0.2)
    # what the worker holds: its device, the sum of its first tensor and its version (checked by the trainer)
    out.put((idx, str(model.w0.device), float(model.w0.detach().double().sum()), -1 if torchrl else scheme.version))
    scheme.shutdown()


def _torchrl_sender(kind: str, model: torch.nn.Module, workers: int, device: str, ctx):
    """TorchRL's scheme ``kind`` set up as its collectors do; returns (scheme, send)."""
    import torchrl.weight_update as wu
    from tensordict import TensorDict

    live = TensorDict.from_module(model)
    buffer = live.detach().clone()  # the trainer copies into it before every send
    scheme = getattr(wu, f"{kind}WeightSyncScheme")()
    # SharedMem shares `buffer` itself with the workers (their models alias it); MultiProcess moves it
    initial = buffer if kind == "SharedMem" else live.detach().clone()
    scheme.init_on_sender(model_id="policy", weights=initial, devices=[torch.device(device)] * workers, ctx=ctx)

    def send() -> None:
        with torch.no_grad():
            buffer.update_(live)
        scheme.send(weights=buffer)

    return scheme, send


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


def run(transport: str, nbytes: int, workers: int, repeat: int, device: str, options: dict | None = None) -> str:
    """One size: the sends' p50/p99, the floor and their ratio, and what each worker held."""
    ctx = mp.get_context("spawn")
    off, on = _floor(nbytes, device, repeat)  # first: nothing else runs yet
    model = _Policy(nbytes, device)
    if transport.startswith("torchrl:"):
        sender, send = _torchrl_sender(transport.removeprefix("torchrl:"), model, workers, device, ctx)
    else:
        sender = WeightSyncScheme(transport, timeout=120.0, **(options or {}))
        sender.init_on_sender(model=model, num_workers=workers)
        send = sender.send
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
                model.w0.add_(1.0)
            _sync(device)
            t0 = time.perf_counter()
            last = send()
            times.append(time.perf_counter() - t0)
        time.sleep(0.5)  # (TorchRL's workers apply in their next receive(): not timed, but checked)
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
    want = float(model.w0.detach().double().sum())
    exact = all(h[2] == want and h[3] == (-1 if last is None else last) for h in held)
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
    p.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a transport option (a JSON value, else a string), e.g. cuda_ipc=true")
    args = p.parse_args()
    options = {}
    for item in args.option:
        key, _, text = item.partition("=")
        try:
            options[key] = json.loads(text)
        except ValueError:
            options[key] = text
    if args.device.startswith("cuda"):
        print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    for size in args.sizes.split(","):
        print(run(args.transport, parse_size(size), args.workers, args.repeat, args.device, options), flush=True)


if __name__ == "__main__":
    main()
