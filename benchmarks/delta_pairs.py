"""``wsync bench --delta``'s cases in an order of your choosing, so that two cases can be timed
side by side in alternation: on a machine whose speed drifts over minutes, a fixed order (full
first, then delta) puts the drift between them.

    python benchmarks/delta_pairs.py --transport shm --cases full,delta,full,delta,full,delta

Prints each case's p50 in ms, in the order run (the same model, steps, workers and repeats as
``wsync bench --delta``; each case a fresh sender, the workers shared).
"""

from __future__ import annotations

import argparse
import statistics

from wsync_bench import delta as cases
from wsync_bench.harness import parse_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", default="shm")
    parser.add_argument("--cases", default="full,delta,full,delta", help="comma-separated, from " + ",".join(cases.CASES))
    parser.add_argument("--size", default="256MiB")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    order = tuple(args.cases.split(","))
    unknown = [c for c in order if c not in cases.CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}: choose from {', '.join(cases.CASES)}")
    cases.CASES = order  # run_delta runs CASES in order, once each
    rows = cases.run_delta([args.transport], parse_size(args.size), args.workers, args.repeat)
    print(" ".join(f"{r.case} {statistics.median(r.latencies_s) * 1e3:.1f}" if not r.error else f"{r.case} {r.error}"
                   for r in rows))


if __name__ == "__main__":
    main()
