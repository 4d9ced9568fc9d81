import torch, multiprocessing as mp, sys
sys.path.insert(0, "benchmarks")
from wsync_bench.delta import run_delta, format_delta_table
if __name__ == "__main__":
    import logging; logging.basicConfig(level=logging.INFO)
    rows = run_delta(["shm"], 256 << 10, 1, 2, 1)
    for r in rows: print(r.case, r.payload_bytes, r.changed, r.error)
