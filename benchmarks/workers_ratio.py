"""What more workers cost: ``wsync bench`` at one size with few and with many workers, the two
alternating round by round (issue 20: 512 MiB to 8 workers within 1.2x of 2 workers).

On a shared machine whose speed drifts, two runs minutes apart compare the drift as much as the
worker count. Here each round times the few-worker case, then the many-worker case (then the
other way round in the next round), each a full ``wsync bench`` job with its own processes; each
round's ratio is the many-worker p50 over the few-worker p50 of that round, and the summary is
the median of the rounds' ratios, with every round's figures::

    python benchmarks/workers_ratio.py shm --size 512MiB --few 2 --many 8 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics

from wsync_bench.harness import BenchConfig, format_size, parse_size, run


def _p50_ms(transport: str, nbytes: int, workers: int, repeat: int) -> tuple[float, float]:
    """p50 and p99 ms of one ``wsync bench`` job; raises RuntimeError with the row's error."""
    report = run(BenchConfig(transports=[transport], sizes=[nbytes], workers=workers, repeat=repeat), progress=False)
    (row,) = [r for r in report.rows if r.system == transport]
    if row.error or row.median_s is None:
        raise RuntimeError(f"{transport} to {workers} workers: {row.error}")
    return row.median_s * 1e3, row.p99_s * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("transport")
    p.add_argument("--size", default="512MiB")
    p.add_argument("--few", type=int, default=2)
    p.add_argument("--many", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeat", type=int, default=10)
    args = p.parse_args()
    nbytes = parse_size(args.size)
    ratios = []
    for k in range(args.rounds):
        order = (args.few, args.many) if k % 2 == 0 else (args.many, args.few)
        got = {w: _p50_ms(args.transport, nbytes, w, args.repeat) for w in order}
        ratios.append(got[args.many][0] / got[args.few][0])
        print(f"round {k + 1}: {args.few} workers p50 {got[args.few][0]:.2f} ms p99 {got[args.few][1]:.2f} ms; "
              f"{args.many} workers p50 {got[args.many][0]:.2f} ms p99 {got[args.many][1]:.2f} ms; "
              f"ratio {ratios[-1]:.2f}", flush=True)
    print(f"{args.transport} {format_size(nbytes)}: {args.many} workers over {args.few}, median of {args.rounds} "
          f"rounds {statistics.median(ratios):.2f}x (min {min(ratios):.2f}, max {max(ratios):.2f})")


if __name__ == "__main__":
    main()
