"""``wsync bench --delta``: a delta send side by side with a full one, on the same model and steps.

The model: ``nbytes`` of bfloat16 in square layers (a frozen base) plus a small adapter (two
thin matrices per layer). Four cases per transport, each timed over ``repeat`` sends after
``warmup`` (``send()`` with sync=True, from the snapshot to the last worker's ack):

- ``full``: delta=False, 1% of the elements changed per step;
- ``delta``: delta=True, the same steps (on a zero-copy transport it measures whether diffing
  pays and may switch to full sends: see ``WeightSyncScheme``);
- ``always``: delta="always", the same steps: deltas every time, the fewest bytes;
- ``adapter``: delta=True, ``send(keys=<adapter>)`` after a step that changes the adapter only
  (compare with ``full``: what a full send of the same model costs).

Each row reports the bytes each worker's payload took on the wire (``SendReport.nbytes``) and
the latencies' median and 99th percentile.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["DeltaRow", "build_adapter_model", "run_delta", "format_delta_table", "CASES"]

CASES = ("full", "delta", "always", "adapter")
_LAYERS = 8
_RANK = 16


@dataclass
class DeltaRow:
    transport: str
    case: str
    nbytes_model: int
    workers: int
    payload_bytes: list[int] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)
    diff_s: list[float] = field(default_factory=list)
    changed: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.latencies_s) if self.latencies_s else None

    @property
    def p99_s(self) -> float | None:
        if not self.latencies_s:
            return None
        s = sorted(self.latencies_s)
        return s[min(len(s) - 1, round(0.99 * (len(s) - 1)))]

    @property
    def bytes_median(self) -> int | None:
        return int(statistics.median(self.payload_bytes)) if self.payload_bytes else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(median_s=self.median_s, p99_s=self.p99_s, bytes_median=self.bytes_median)
        return d


class _AdapterModel(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.base = nn.ParameterList(nn.Parameter(torch.empty(dim, dim, dtype=torch.bfloat16, device="meta"))
                                     for _ in range(_LAYERS))
        self.adapter_a = nn.ParameterList(nn.Parameter(torch.empty(_RANK, dim, dtype=torch.bfloat16, device="meta"))
                                          for _ in range(_LAYERS))
        self.adapter_b = nn.ParameterList(nn.Parameter(torch.empty(dim, _RANK, dtype=torch.bfloat16, device="meta"))
                                          for _ in range(_LAYERS))


def build_adapter_model(nbytes: int, seed: int = 0) -> nn.Module:
    """About ``nbytes`` of bfloat16 base layers plus a rank-16 adapter per layer, random values."""
    dim = max(16, int((nbytes / 2 / _LAYERS) ** 0.5))
    model = _AdapterModel(dim)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32))
    return model


def adapter_keys(model: nn.Module) -> list[str]:
    return [k for k, _ in model.named_parameters() if k.startswith("adapter")]


def _step(model: nn.Module, share: float, g: torch.Generator, adapter_only: bool) -> None:
    """A training step's effect (untimed): ``share`` of the elements of each tensor changed, or
    the whole adapter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.view(-1)
            if adapter_only:
                if name.startswith("adapter"):
                    flat.add_(0.01)
                continue
            idx = torch.randint(0, flat.numel(), (max(1, int(flat.numel() * share)),), generator=g)
            flat[idx] += 0.5


def _worker(idx: int, nbytes: int, jobs: Any, ready: Any, stop: Any) -> None:
    """One worker for every case: takes a scheme from ``jobs`` (None: exit), receives until ``stop``."""
    from wsync_core import WsyncError

    torch.set_num_threads(1)
    model = build_adapter_model(nbytes, seed=99)
    while True:
        scheme = jobs.get()
        if scheme is None:
            return
        scheme.init_on_receiver(model=model, worker_idx=idx)
        ready.put(idx)
        try:
            scheme.connect()
            while not stop.is_set():
                try:
                    scheme.receive(timeout=0.05)
                except WsyncError:  # the sender shut down first: the case is over
                    if stop.is_set():
                        break
                    raise
        finally:
            scheme.shutdown()
            ready.put(-1 - idx)


def _measure(transport: str, case: str, nbytes: int, workers: list[Any], repeat: int, warmup: int, share: float,
             pool: tuple[Any, Any]) -> DeltaRow:
    from wsync_core import WeightSyncScheme

    ready, stop = pool
    row = DeltaRow(transport, case, nbytes, len(workers))
    model = build_adapter_model(nbytes)
    keys = adapter_keys(model)
    scheme = WeightSyncScheme(transport, delta={"full": False, "always": "always"}.get(case, True), timeout=120.0)
    scheme.init_on_sender(model=model, num_workers=len(workers))
    stop.clear()
    for jobs in workers:
        jobs.put(scheme)
    try:
        for _ in workers:
            ready.get(timeout=300)
        scheme.connect(timeout=300)
        g = torch.Generator().manual_seed(1)
        for k in range(warmup + repeat):
            _step(model, share, g, adapter_only=case == "adapter")
            t0 = time.perf_counter()
            scheme.send(keys=keys if case == "adapter" else None)
            dt = time.perf_counter() - t0
            if k >= warmup:
                report = scheme.last_report
                row.latencies_s.append(dt)
                row.payload_bytes.append(report.nbytes)
                row.diff_s.append(report.diff_s)
                if report.changed is not None:
                    row.changed.append(report.changed)
    except Exception as exc:  # the row says what stopped it
        row.error = f"{type(exc).__name__}: {exc}"
    finally:
        stop.set()
        scheme.shutdown()
        for _ in workers:
            ready.get(timeout=120)
    return row


def run_delta(transports: list[str], nbytes: int = 256 << 20, workers: int = 2, repeat: int = 20, warmup: int = 3,
              share: float = 0.01) -> list[DeltaRow]:
    """Every case on every transport, with the same worker processes (``zmq`` runs over TCP on this host)."""
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Queue(), ctx.Event()
    queues = [ctx.Queue() for _ in range(workers)]
    procs = [ctx.Process(target=_worker, args=(i, nbytes, q, ready, stop), daemon=True) for i, q in enumerate(queues)]
    for p in procs:
        p.start()
    rows = []
    try:
        for transport in transports:
            for case in CASES:
                rows.append(_measure(transport, case, nbytes, queues, repeat, warmup, share, (ready, stop)))
    finally:
        for q in queues:
            q.put(None)
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    return rows


def main(args: Any) -> int:
    """``wsync bench --delta``: print the table, write JSON if asked; exit 1 if a row failed."""
    import json
    import sys

    from .harness import machine_info, parse_size

    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    if len(sizes) != 1 or args.workers < 1 or args.repeat < 1:
        print("wsync bench --delta: give one --sizes, --workers >= 1 and --repeat >= 1", file=sys.stderr)
        return 2
    rows = run_delta(transports, sizes[0], args.workers, args.repeat, share=args.changed)
    print(format_delta_table(rows))
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump({"machine": machine_info(), "changed": args.changed, "rows": [r.to_dict() for r in rows]}, f,
                      indent=1)
        print(f"wrote {args.json_file}")
    return 1 if any(r.error for r in rows) else 0


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f} MiB"


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.1f}"


def format_delta_table(rows: list[DeltaRow]) -> str:
    """Rows side by side: bytes per worker and latencies, each against the same transport's full send."""
    full = {r.transport: r for r in rows if r.case == "full"}
    lines = [f"{'transport':<10} {'case':<8} {'bytes/worker':>14} {'vs full':>8} {'p50 ms':>9} {'p99 ms':>9} "
             f"{'vs full':>8} {'diff ms':>8}"]
    for r in rows:
        if r.error:
            lines.append(f"{r.transport:<10} {r.case:<8} error: {r.error}")
            continue
        f = full.get(r.transport)
        b = r.bytes_median / f.bytes_median if f and f.bytes_median and r.bytes_median is not None else None
        t = r.median_s / f.median_s if f and f.median_s and r.median_s else None
        diff = statistics.median(r.diff_s) if r.diff_s else None
        lines.append(f"{r.transport:<10} {r.case:<8} {_mib(r.bytes_median):>14} "
                     f"{'-' if b is None else f'{b:.2%}':>8} {_ms(r.median_s):>9} {_ms(r.p99_s):>9} "
                     f"{'-' if t is None else f'{t:.2f}x':>8} {_ms(diff):>8}")
    return "\n".join(lines)
