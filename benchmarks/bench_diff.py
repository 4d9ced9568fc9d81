"""Where a delta send's comparison goes: the sender's ``Mirror.update`` and ``Mirror.encode`` on a
bfloat16 model with some elements changed at scattered places, op by op, in one process.

    python benchmarks/bench_diff.py [--mib 256] [--changed 0.01] [--threads 2] [--repeat 5]

Every figure is the best of ``--repeat`` runs and is also given as a ratio to one memcpy of the
model (``dst.copy_(src)``, both tensors already touched) with the same torch threads: a full send
on shared memory costs about one such copy. The op rows replay ``delta._changed``'s steps on the
whole model in ``delta._CHUNK_BYTES`` steps (the mask, the changed words, the copy of those words
into the mirror, the elements inside them), then ``update`` and ``encode`` themselves.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from wsync_core import delta as D
from wsync_core.layout import Layout

__all__ = ["main"]


def _best(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _steps(mirror: torch.Tensor, src: torch.Tensor, times: dict[str, float]) -> None:
    """``delta._update``'s steps for a bfloat16 flat pair, each timed into ``times``."""
    step = D._CHUNK_BYTES // 2
    mask = torch.empty(step // 4, dtype=torch.bool)
    clock = time.perf_counter
    for a in range(0, mirror.numel(), step):
        s, m = src[a:a + step].view(torch.int64), mirror[a:a + step].view(torch.int64)
        t0 = clock()
        torch.ne(s, m, out=mask[:s.numel()])
        t1 = clock()
        words = mask[:s.numel()].nonzero().view(-1)
        t2 = clock()
        new, old = s.index_select(0, words), m.index_select(0, words)
        t3 = clock()
        m.index_copy_(0, words, new)
        t4 = clock()
        inner = torch.ne(old.view(torch.int16), new.view(torch.int16)).nonzero().view(-1)
        t5 = clock()
        words.index_select(0, inner >> 2).mul_(4).add_(inner & 3).add_(a)
        t6 = clock()
        for name, d in (("compare words (ne -> mask)", t1 - t0), ("changed words (nonzero)", t2 - t1),
                        ("gather old+new words", t3 - t2), ("mirror: copy changed words", t4 - t3),
                        ("elements inside (ne+nonzero)", t5 - t4), ("element indices", t6 - t5)):
            times[name] += d


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--changed", type=float, default=0.01)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    n = (args.mib << 20) // 2
    g = torch.Generator().manual_seed(0)
    base = torch.randn(n, generator=g).to(torch.bfloat16)
    src = base.clone()
    where = torch.randint(0, n, (int(n * args.changed),), generator=g)
    src[where] = (src[where].float() + 1.0).to(torch.bfloat16)
    dst = torch.empty_like(base)
    dst.copy_(base)
    memcpy = _best(lambda: dst.copy_(base), args.repeat)
    print(f"{args.mib} MiB bfloat16, {args.changed:.2%} of the elements changed, torch threads {args.threads}")
    print(f"{'memcpy':34s} {memcpy * 1e3:8.2f} ms  1.00x")
    rows: dict[str, float] = {}
    for _ in range(args.repeat):
        times: dict[str, float] = defaultdict(float)
        mirror = base.clone()
        _steps(mirror, src, times)
        for k, v in times.items():
            rows[k] = min(rows.get(k, float("inf")), v)
    for k, v in rows.items():
        print(f"  {k:32s} {v * 1e3:8.2f} ms  {v / memcpy:.2f}x")
    print(f"  {'sum of the steps':32s} {sum(rows.values()) * 1e3:8.2f} ms  {sum(rows.values()) / memcpy:.2f}x")
    model = {"w": src}
    layout = Layout.of({"w": base})
    mirrors = []
    for _ in range(args.repeat + 1):
        m = D.Mirror(layout, None, 2, torch.device("cpu"))
        m.reset({"w": base}, 0)
        mirrors.append(m)
    it = iter(mirrors)
    update = _best(lambda: next(it).update(model, 1, None), args.repeat)
    print(f"{'Mirror.update (the diff_s)':34s} {update * 1e3:8.2f} ms  {update / memcpy:.2f}x")
    mirror = mirrors[0]
    changes = mirror.since(0)
    buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
    encoded = mirror.encode(changes, buffer)
    enc = _best(lambda: mirror.encode(changes, buffer), args.repeat)
    print(f"{'Mirror.encode':34s} {enc * 1e3:8.2f} ms  {enc / memcpy:.2f}x  "
          f"({encoded.nbytes / layout.nbytes:.2%} of a full payload)")


if __name__ == "__main__":
    main()
