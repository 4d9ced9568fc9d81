"""wsync's ``ray`` transport beside TorchRL's ``RayWeightSyncScheme``, on one Ray cluster, in one run.

    python benchmarks/bench_ray.py [--sizes 64,512] [--workers 4] [--repeat 20] [--json FILE]

A Ray head node is started on this machine for the run (``wsync_ray.cluster.RayNode``: 2 CPUs,
an object store of ``--store`` (4) times the largest size, preallocated, unreferenced objects deleted
every 10 ms) and stopped after it. The trainer is this process (a Ray
driver); every worker is a Ray actor (``num_cpus=0``, torch on one thread, as TorchRL's
collectors), holding the same float32 module (``wsync_bench.harness.build_model``). Per size:

- **wsync ray**: ``scheme.send()`` with ``sync=True``: the snapshot of the trainer's module, one
  ``ray.put``, every worker taking it from its node's object store and copying it into its
  module (a thread of the actor blocked in ``scheme.receive(timeout=0.1)``), and every ack;
- **TorchRL RayWeightSyncScheme** (gloo, TorchRL 0.14): the trainer's weights copied into one
  reused TensorDict (``buffer.update_(live)``, counted in its time, as in ``wsync bench``), then
  ``scheme.send(weights=buffer)``: a Ray call to each actor's ``_receive_weights_scheme`` and a
  gloo send per tensor per worker, until every actor applied it;
- **floor, one memcpy per receiver**: every worker actor copies the same number of bytes from a
  buffer of its own into another, all at once (the time from the calls to the last reply); and
  **one memcpy**: a single one-thread copy in the trainer. Half their rounds run before the
  systems, half after.

Each row: p50 and p99 of ``--repeat`` timed rounds after 6 warm-ups (with 20 rounds, p99 is
close to the slowest), and the ratio of p50s to the floor. Before each round the trainer's
weights change (a ``fill_`` standing for a training step), untimed for every system. Six warm-ups, for every system: the
first puts at a size land in object-store memory the trainer has not touched yet.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import threading
import time
from typing import Any

import torch

logging.getLogger("wsync").setLevel(logging.ERROR)
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # the bench's own node, reached from this machine only

import ray  # noqa: E402
from wsync_core import WeightSyncScheme  # noqa: E402
from wsync_bench.harness import build_model  # noqa: E402
from wsync_ray.cluster import RayNode  # noqa: E402

MIB = 1 << 20


def _pct(samples: list[float], q: float) -> float:
    xs = sorted(samples)
    if len(xs) == 1:
        return xs[0]
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


@ray.remote(num_cpus=0, max_concurrency=2)
class WsyncWorker:
    """A rollout actor kept in sync by wsync; also runs the memcpy floor."""

    def __init__(self, scheme: Any, worker: int, nbytes: int) -> None:
        torch.set_num_threads(1)
        self.model = build_model(nbytes)
        self.scheme = scheme
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.errors: list[str] = []
        scheme.init_on_receiver(model=self.model, worker_idx=worker)
        self.src = torch.ones(nbytes, dtype=torch.uint8)
        self.dst = torch.zeros(nbytes, dtype=torch.uint8)

    def connect(self) -> int:
        self.scheme.connect(timeout=300.0)
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()
        return self.scheme.version

    def _loop(self) -> None:
        while not self.stop.is_set():
            try:
                self.scheme.receive(timeout=0.1)
            except Exception as exc:  # reported by close()
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def memcpy(self) -> None:
        """One copy of the payload's bytes into memory of this actor's own."""
        self.dst.copy_(self.src)

    def close(self) -> list[str]:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(60)
        self.scheme.shutdown()
        return self.errors


@ray.remote(num_cpus=0)
class TorchRLWorker:
    """A rollout actor as TorchRL's RayWeightSyncScheme expects one (its collectors' two methods)."""

    def __init__(self, scheme: Any, worker: int, nbytes: int) -> None:
        torch.set_num_threads(1)
        self.model = build_model(nbytes)
        self.worker_idx = worker
        scheme.init_on_receiver(model_id="policy", model=self.model, worker_idx=worker)
        self._receiver_schemes = {"policy": scheme}

    def _connect_weights_scheme(self, model_version: int | None = None) -> None:
        for scheme in self._receiver_schemes.values():
            if not scheme.synchronized_on_receiver:
                scheme.connect(worker_idx=self.worker_idx)

    def _receive_weights_scheme(self, model_version: int | None = None) -> None:
        for scheme in self._receiver_schemes.values():
            scheme.receive()

    def first_value(self) -> float:
        return float(next(iter(self.model.parameters())).flatten()[0])


def _bump(model: torch.nn.Module, value: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)


def _rounds(step, repeat: int, warmup: int = 6, prepare=None) -> list[float]:
    """Seconds ``step(i)`` took, for ``repeat`` rounds after ``warmup``; ``prepare(i)`` (the
    training step that changes the weights) runs before each round, untimed."""
    out = []
    for i in range(warmup + repeat):
        if prepare is not None:
            prepare(i)
        t0 = time.perf_counter()
        step(i)
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    return out


def _store_stats() -> dict[str, int]:
    """What Ray's object store did so far: spilled and fallback-allocated bytes, objects now."""
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    st = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address)).store_stats
    return {"spilled_bytes": st.spilled_bytes_total, "fallback_bytes": st.object_store_bytes_fallback,
            "used_bytes": st.object_store_bytes_used, "objects": st.num_local_objects}


def floor_rounds(actors: list, nbytes: int, repeat: int) -> tuple[list[float], list[float]]:
    """(one memcpy per receiver, all at once; one memcpy in this process) round times."""
    per_receiver = _rounds(lambda i: ray.get([a.memcpy.remote() for a in actors]), repeat)
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    torch.set_num_threads(1)
    one = _rounds(lambda i: dst.copy_(src), repeat)
    return per_receiver, one


def run_wsync(nbytes: int, n: int, repeat: int, floor: dict[str, list[float]], **options: Any) -> list[float]:
    """``send()`` latencies of the ray transport with ``options`` (default: as users run it)."""
    model = build_model(nbytes)
    scheme = WeightSyncScheme("ray", timeout=600.0, **options)
    actors = [WsyncWorker.remote(scheme, i, nbytes) for i in range(n)]
    scheme.init_on_sender(model=model, num_workers=n)
    try:
        connects = [a.connect.remote() for a in actors]
        scheme.connect(timeout=600.0)
        ray.get(connects)
        half = max(1, repeat // 2)
        parts: list[tuple[float, float, float]] = []
        a, b = floor_rounds(actors, nbytes, half)
        floor["per_receiver"] += a
        floor["one"] += b

        def step(i: int) -> None:
            scheme.send()
            if i >= 6:
                r = scheme.last_report
                parts.append((r.snapshot_s, r.publish_s, max(r.ack_latency.values())))

        lat = _rounds(step, repeat, prepare=lambda i: _bump(model, float(i + 1)))
        floor["parts"] = [statistics.median(x) for x in zip(*parts)]
        floor["store"] = _store_stats()
        a, b = floor_rounds(actors, nbytes, repeat - half)
        floor["per_receiver"] += a
        floor["one"] += b
        errors = ray.get([a.close.remote() for a in actors])
        if any(errors):
            raise RuntimeError(f"wsync workers failed: {errors}")
        return lat
    finally:
        scheme.shutdown()
        for a in actors:
            ray.kill(a, no_restart=True)


def run_torchrl(nbytes: int, n: int, repeat: int) -> list[float]:
    from tensordict import TensorDict
    from torchrl.weight_update import RayWeightSyncScheme

    model = build_model(nbytes)
    scheme = RayWeightSyncScheme(backend="gloo")
    actors = [TorchRLWorker.remote(scheme, i, nbytes) for i in range(n)]
    ray.get([a.__ray_ready__.remote() for a in actors])
    scheme.init_on_sender(model_id="policy", remote_collectors=actors, model=model)
    scheme._manage_receiver_connect = True  # as TorchRL's RayCollector sets it: connect() connects the actors
    try:
        scheme.connect()
        live = TensorDict.from_module(model)
        buffer = live.detach().clone()

        def step(i: int) -> None:
            with torch.no_grad():
                buffer.update_(live)
            scheme.send(weights=buffer)

        lat = _rounds(step, repeat, prepare=lambda i: _bump(model, float(i + 1)))
        got = ray.get([a.first_value.remote() for a in actors])
        if got != [float(repeat + 6)] * n:
            raise RuntimeError(f"TorchRL workers hold {got}, expected {float(repeat + 6)}")
        return lat
    finally:
        scheme.shutdown()
        for a in actors:
            ray.kill(a, no_restart=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64,512", help="payload sizes in MiB, comma-separated (default 64,512)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--systems", default="wsync,torchrl",
                        help="wsync (its defaults), wsync-unchecked (checksum=False), torchrl; comma-separated")
    parser.add_argument("--store", type=int, default=4,
                        help="object store size in multiples of the largest size (default 4)")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    systems = args.systems.split(",")
    rows: list[dict[str, Any]] = []
    node = RayNode(num_cpus=2, object_store_mib=max(1024, args.store * max(sizes)))
    try:
        ray.init(address=node.address, log_to_driver=False, logging_level=logging.WARNING)
        for mib in sizes:
            nbytes = mib * MIB
            floor: dict[str, Any] = {"per_receiver": [], "one": []}
            measured = {}
            if "wsync" in systems:
                measured["wsync ray"] = run_wsync(nbytes, args.workers, args.repeat, floor)
            if "wsync-unchecked" in systems:
                measured["wsync ray, checksum=False"] = run_wsync(nbytes, args.workers, args.repeat,
                                                                  {"per_receiver": [], "one": []}, checksum=False)
            if "torchrl" in systems:
                try:
                    measured["TorchRL RayWeightSyncScheme"] = run_torchrl(nbytes, args.workers, args.repeat)
                except Exception as exc:  # a row with the error; the run goes on
                    rows.append({"system": "TorchRL RayWeightSyncScheme", "mib": mib, "error": repr(exc)})
            ref = statistics.median(floor["per_receiver"]) if floor["per_receiver"] else None
            for name, lat in [(f"floor: 1 memcpy per receiver ({args.workers} at once)", floor["per_receiver"]),
                              ("one memcpy (1 thread)", floor["one"]), *measured.items()]:
                if not lat:
                    continue
                p50 = statistics.median(lat)
                rows.append({"system": name, "mib": mib, "workers": args.workers, "rounds": len(lat),
                             "samples_ms": [round(x * 1e3, 2) for x in lat],
                             "p50_ms": p50 * 1e3, "p99_ms": _pct(lat, 0.99) * 1e3,
                             "x_floor": None if ref is None else p50 / ref})
            _print(rows, mib)
            if floor.get("parts"):
                snap, pub, last = (x * 1e3 for x in floor["parts"])
                print(f"wsync ray, medians: snapshot {snap:.1f} ms, publish (ray.put + post) {pub:.1f} ms, "
                      f"last ack {last:.1f} ms after the send began; object store: {floor['store']}")
                rows.append({"system": "wsync ray parts", "mib": mib, "snapshot_ms": snap, "publish_ms": pub,
                             "last_ack_ms": last, "store": floor["store"]})
    finally:
        if ray.is_initialized():
            ray.shutdown()
        node.stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "ray": ray.__version__, "torch": torch.__version__,
                       "cpus": os.cpu_count()}, f, indent=2)
    return 0


def _print(rows: list[dict[str, Any]], mib: int) -> None:
    print(f"\n{mib} MiB")
    print(f"{'system':<48} {'p50 ms':>9} {'p99 ms':>9} {'x floor':>8}")
    for r in rows:
        if r["mib"] != mib or "p50_ms" not in r and "error" not in r:
            continue
        if "error" in r:
            print(f"{r['system']:<48} error: {r['error']}")
            continue
        x = "-" if r["x_floor"] is None else f"{r['x_floor']:.2f}"
        print(f"{r['system']:<48} {r['p50_ms']:>9.1f} {r['p99_ms']:>9.1f} {x:>8}")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
