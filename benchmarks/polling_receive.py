"""An inference worker that polls: ``receive(timeout=0)`` at every step while large versions arrive.

A spawned trainer sends a ``--mib`` model (``sync=False``), pausing ``--pause-ms`` between
sends, for ``--seconds``; the worker (this process) calls ``receive(timeout=0)`` in a loop with a
1 ms step between calls. What a serving loop pays per step: the calls that found nothing new
(p50 / p99 / p99.9 / max, which must stay small while a version's bytes come in), and apart the
calls that applied a version; and the trainer's side, each ``send()``, which must not wait for
the bytes of the versions before it to be written::

    python benchmarks/polling_receive.py tcp --mib 256 --seconds 12
"""

from __future__ import annotations

import argparse
import multiprocessing
import pickle
import time
from typing import Any

import torch
from wsync_core import WeightSyncScheme


def _model(mib: int) -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(mib << 18)}


def _trainer(blob: Any, transport: str, options: dict, mib: int, pause_s: float, seconds: float,
             sends: Any) -> None:
    torch.set_num_threads(1)
    model = _model(mib)
    scheme = WeightSyncScheme(transport, sync=False, timeout=60.0, **options)
    scheme.init_on_sender(model=model, num_workers=1)
    blob.put(pickle.dumps(scheme))
    scheme.connect()
    end = time.monotonic() + seconds
    version, took = 0, []
    while time.monotonic() < end:
        version += 1
        model["w"].fill_(version)
        t0 = time.perf_counter()
        scheme.send()
        took.append(time.perf_counter() - t0)
        time.sleep(pause_s)
    scheme.shutdown()
    sends.put(took)


def _quantiles(samples: list[float]) -> str:
    if not samples:
        return "none"
    samples = sorted(samples)
    at = lambda q: samples[min(len(samples) - 1, int(q * len(samples)))] * 1e3  # noqa: E731
    return f"p50 {at(0.5):.3f}  p99 {at(0.99):.3f}  p99.9 {at(0.999):.3f}  max {samples[-1] * 1e3:.3f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("transport")
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--pause-ms", type=float, default=50.0)
    parser.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                        help="a transport option (a string), e.g. -o directory=/tmp/x")
    args = parser.parse_args()
    options = dict(o.split("=", 1) for o in args.option)
    torch.set_num_threads(1)
    ctx = multiprocessing.get_context("spawn")
    blob, sends = ctx.Queue(), ctx.Queue()
    trainer = ctx.Process(target=_trainer, args=(blob, args.transport, options, args.mib, args.pause_ms / 1e3,
                                                 args.seconds, sends))
    trainer.start()
    scheme = pickle.loads(blob.get(timeout=120))
    scheme.init_on_receiver(model=_model(args.mib), worker_idx=0)
    scheme.connect()
    idle: list[float] = []
    applying: list[float] = []
    end = time.monotonic() + args.seconds - 1.0
    while time.monotonic() < end:
        t0 = time.perf_counter()
        version = scheme.receive(timeout=0.0)
        took = time.perf_counter() - t0
        (idle if version is None else applying).append(took)
        if version is None:
            time.sleep(0.001)  # the serving loop's step
    scheme.shutdown()
    took = sends.get(timeout=120)
    trainer.join(120)
    print(f"{args.transport}, {args.mib} MiB versions every send + {args.pause_ms:g} ms, {args.seconds:g} s")
    print(f"  receive(timeout=0) finding nothing new ({len(idle)} calls): {_quantiles(idle)}")
    print(f"  receive(timeout=0) applying a version ({len(applying)} calls): {_quantiles(applying)}")
    print(f"  the trainer's send() with sync=False ({len(took)} calls): {_quantiles(took)}")


if __name__ == "__main__":
    main()
