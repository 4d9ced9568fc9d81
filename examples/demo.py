"""The main job: a trainer updates a policy and syncs it to 4 worker processes after every step.

Each version's latency (snapshot + delivery + every worker's ack) and throughput are printed,
then a summary, and every worker's final weights are checked bit for bit against the trainer's.

    python examples/demo.py [--transport shm] [--workers 4] [--steps 20]
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import statistics
import threading
import time

import torch
from torch import nn

from wsync_core import WeightSyncScheme, get_transport, list_transports


def make_policy(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(128, 1024), nn.LayerNorm(1024), nn.Tanh(),
                         nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 8))


def fingerprint(model: nn.Module) -> str:
    h = hashlib.sha256()
    for key, t in sorted(model.state_dict().items()):
        h.update(key.encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def worker(scheme: WeightSyncScheme, idx: int, stop, results) -> None:
    """A rollout worker: acts with its local policy, picking up new weights at safe points."""
    torch.set_num_threads(1)
    policy = make_policy(seed=1000 + idx)  # deliberately different until connect()
    scheme.init_on_receiver(model=policy, worker_idx=idx)
    scheme.connect()
    obs = torch.randn(32, 128)
    steps = 0
    while not stop.is_set():
        scheme.receive(timeout=0.01)  # a safe point: between rollout steps
        with torch.no_grad():
            policy(obs)
        steps += 1
    results.put((idx, scheme.version, fingerprint(policy), steps))
    scheme.shutdown()


def default_transport() -> str:
    names = {i.name for i in list_transports() if not i.error}
    return "shm" if "shm" in names else "inproc"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", default=None, help="transport name (default: shm if installed)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    name = args.transport or default_transport()

    trainer_policy = make_policy(seed=0)
    optimizer = torch.optim.Adam(trainer_policy.parameters(), lr=1e-3)
    nbytes = sum(t.numel() * t.element_size() for t in trainer_policy.state_dict().values())
    scheme = WeightSyncScheme(name, timeout=60.0)
    scheme.init_on_sender(model=trainer_policy, num_workers=args.workers)

    in_processes = get_transport(name).capabilities.processes
    ctx = mp.get_context("spawn")
    stop = ctx.Event() if in_processes else threading.Event()
    results = ctx.Queue() if in_processes else __import__("queue").Queue()
    start = ctx.Process if in_processes else threading.Thread
    where = "processes" if in_processes else "threads"
    print(f"wsync demo: transport {name!r}, {args.workers} worker {where}, policy of {nbytes / 2**20:.1f} MiB")
    workers = [start(target=worker, args=(scheme, i, stop, results)) for i in range(args.workers)]
    for w in workers:
        w.start()

    t0 = time.perf_counter()
    scheme.connect()
    print(f"connected: every worker holds version 0 ({(time.perf_counter() - t0) * 1e3:.0f} ms)")
    latencies = []
    print(f"{'version':>7}  {'latency ms':>10}  {'MiB/s':>8}  {'slowest ack':>11}")
    for _ in range(args.steps):
        batch = torch.randn(256, 128)
        loss = trainer_policy(batch).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        t = time.perf_counter()
        version = scheme.send()
        dt = time.perf_counter() - t
        latencies.append(dt)
        report = scheme.last_report
        slowest = max(report.ack_latency, key=report.ack_latency.get)
        print(f"{version:>7}  {dt * 1e3:>10.2f}  {nbytes / dt / 2**20:>8.0f}  {'worker ' + str(slowest):>11}")

    expected = fingerprint(trainer_policy)
    stop.set()
    final = sorted(results.get(timeout=60) for _ in workers)
    for w in workers:
        w.join(60)
    scheme.shutdown()

    ok = all(v == scheme.version and fp == expected for _, v, fp, _ in final)
    lat = sorted(latencies)
    print(f"\nsummary: {len(lat)} versions of {nbytes / 2**20:.1f} MiB to {args.workers} workers over {name!r}")
    print(f"  latency median {statistics.median(lat) * 1e3:.2f} ms, p90 {lat[int(0.9 * (len(lat) - 1))] * 1e3:.2f} ms, "
          f"best {lat[0] * 1e3:.2f} ms; throughput {nbytes / statistics.median(lat) / 2**20:.0f} MiB/s per version")
    for idx, v, fp, steps in final:
        print(f"  worker {idx}: version {v}, {steps} rollout steps, weights {fp} "
              f"{'== trainer' if fp == expected else '!= trainer ' + expected}")
    print("all workers hold the trainer's final weights, bit for bit" if ok else "MISMATCH")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
