"""``update_policy_weights_()`` inside a real TorchRL ``MultiSyncCollector`` (issue 18).

    .venv/bin/python benchmarks/bench_torchrl.py [--sizes 10KiB,64MiB] [--workers 2] [--repeat 200,40] [--json FILE]

For each policy size, one collector per scheme (wsync ``shm`` and ``mp`` through
``wsync_torchrl.WsyncScheme``; TorchRL's ``MultiProcessWeightSyncScheme`` and
``SharedMemWeightSyncScheme``), 2 worker processes, a first batch collected, then
``update_policy_weights_()`` timed ``repeat`` times (the trainer's in-place step before each is
not timed), p50 and p99, against one memcpy of the weights (the floor: a single-thread copy
between two touched tensors, as in ``wsync bench``), timed just before each update so both see
the same machine load; ``x_memcpy`` is the ratio of the two medians. (TorchRL's collector leaves
its trainer process one torch thread per spare core: one on a 2-core machine.) TorchRL's schemes
alias the trainer's memory in their workers (no isolation): a speed reference, not peers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.collectors import MultiSyncCollector
from torchrl.data import Bounded, Composite, Unbounded
from torchrl.envs import EnvBase

from wsync_bench.harness import build_model, format_size, parse_size

__all__ = ["main", "run"]


class _Env(EnvBase):
    """A one-number environment: rollouts cost next to nothing, so only the update is timed."""

    def __init__(self) -> None:
        super().__init__(batch_size=torch.Size([]))
        self.observation_spec = Composite(observation=Unbounded(shape=(1,)))
        self.action_spec = Bounded(low=-1.0, high=1.0, shape=(1,))
        self.reward_spec = Unbounded(shape=(1,))

    def _reset(self, tensordict=None, **kwargs):
        return TensorDict({"observation": torch.zeros(1), "done": torch.zeros(1, dtype=torch.bool),
                           "terminated": torch.zeros(1, dtype=torch.bool)})

    def _step(self, tensordict):
        return TensorDict({"observation": torch.zeros(1), "reward": torch.zeros(1),
                           "done": torch.zeros(1, dtype=torch.bool), "terminated": torch.zeros(1, dtype=torch.bool)})

    def _set_seed(self, seed):
        return None


class _Policy(nn.Module):
    """Holds ``nbytes`` of weights (wsync's benchmark model); its action reads one of them."""

    def __init__(self, nbytes: int) -> None:
        super().__init__()
        self.body = build_model(nbytes)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return observation * 0 + self.body.stats[:1]


def _schemes() -> dict[str, Callable[[], Any]]:
    from torchrl.weight_update import MultiProcessWeightSyncScheme, SharedMemWeightSyncScheme

    from wsync_torchrl import WsyncScheme

    return {
        "wsync shm": lambda: WsyncScheme("shm", timeout=120),
        "wsync mp": lambda: WsyncScheme("mp", timeout=120),
        "torchrl MultiProcess": MultiProcessWeightSyncScheme,
        "torchrl SharedMem": SharedMemWeightSyncScheme,
    }


def _percentiles(values: list[float]) -> tuple[float, float]:
    s = sorted(values)
    return statistics.median(s), s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]


def _memcpy(nbytes: int, repeat: int) -> list[float]:
    """Single-thread copies of ``nbytes`` between two touched tensors (the floor)."""
    src = torch.ones(max(nbytes // 4, 1))
    dst = torch.empty_like(src)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dst.copy_(src)
        out = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            dst.copy_(src)
            out.append(time.perf_counter() - t0)
        return out
    finally:
        torch.set_num_threads(threads)


def _bump(policy: nn.Module) -> None:
    with torch.no_grad():
        for t in list(policy.parameters()) + list(policy.buffers()):
            t.add_(1.0)


def _time_updates(name: str, make: Callable[[], Any], nbytes: int, workers: int,
                  repeat: int) -> tuple[list[float], list[float]]:
    """Update times, and single-thread memcpy times of the same bytes taken just before each
    (same machine load)."""
    policy = TensorDictModule(_Policy(nbytes), in_keys=["observation"], out_keys=["action"])
    collector = MultiSyncCollector([_Env] * workers, policy, frames_per_batch=2 * workers, total_frames=-1,
                                   weight_sync_schemes={"policy": make()})
    src = torch.ones(max(nbytes // 4, 1))
    dst = torch.empty_like(src)
    try:
        it = iter(collector)
        next(it)
        out, floor = [], []
        threads = torch.get_num_threads()  # TorchRL leaves the trainer one thread per spare core
        for i in range(repeat + 3):
            _bump(policy)
            torch.set_num_threads(1)
            t0 = time.perf_counter()
            dst.copy_(src)
            t1 = time.perf_counter()
            torch.set_num_threads(threads)
            collector.update_policy_weights_()
            t2 = time.perf_counter()
            if i >= 3:  # warm-up
                floor.append(t1 - t0)
                out.append(t2 - t1)
        expect = policy.module.body.stats[:1].item()
        data = next(it)
        if name.startswith("wsync") and not torch.all(data["action"] == expect):
            raise AssertionError(f"{name}: workers did not run the last version")
        return out, floor
    finally:
        collector.shutdown()


def run(sizes: list[int], workers: int, repeats: list[int]) -> list[dict[str, Any]]:
    """One row per (size, system): p50/p99 seconds and the ratio to the memcpy floor."""
    rows = []
    for nbytes, repeat in zip(sizes, repeats):
        floor = _memcpy(nbytes, max(repeat, 20))
        f50, f99 = _percentiles(floor)
        rows.append({"size": format_size(nbytes), "system": "memcpy (floor)", "p50_ms": f50 * 1e3, "p99_ms": f99 * 1e3,
                     "x_memcpy": 1.0})
        for name, make in _schemes().items():
            try:
                times, floor_here = _time_updates(name, make, nbytes, workers, repeat)
            except Exception as exc:  # noqa: BLE001 - a failing system is reported in its row, the rest still run
                rows.append({"size": format_size(nbytes), "system": name, "error": f"{type(exc).__name__}: {exc}"})
                continue
            p50, p99 = _percentiles(times)
            m50 = statistics.median(floor_here)
            rows.append({"size": format_size(nbytes), "system": name, "p50_ms": p50 * 1e3, "p99_ms": p99 * 1e3,
                         "memcpy_p50_ms": m50 * 1e3, "x_memcpy": p50 / m50, "n": len(times)})
            print(_format(rows[-1]), file=sys.stderr, flush=True)
    return rows


def _format(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"{row['size']:>8}  {row['system']:<22} ERROR {row['error']}"
    floor = f"  (memcpy alongside: {row['memcpy_p50_ms']:.3f} ms)" if "memcpy_p50_ms" in row else ""
    return (f"{row['size']:>8}  {row['system']:<22} p50 {row['p50_ms']:9.3f} ms  p99 {row['p99_ms']:9.3f} ms  "
            f"{row['x_memcpy']:7.2f}x memcpy{floor}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10KiB,64MiB")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", default="200,40", help="updates timed per size (one number, or one per size)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    repeats = [int(r) for r in args.repeat.split(",")]
    repeats = (repeats * len(sizes))[:len(sizes)] if len(repeats) == 1 else repeats
    rows = run(sizes, args.workers, repeats)
    print(f"update_policy_weights_() in a MultiSyncCollector, {args.workers} workers, torch {torch.__version__}")
    for row in rows:
        print(_format(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
