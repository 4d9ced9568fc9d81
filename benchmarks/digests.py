"""Candidate payload checksums at memory speed: 256 MiB hashed in 16 MiB chunks, against a memcpy.

    python benchmarks/digests.py

zlib.crc32 and xxhash (a wsync-core dependency) always; crc32c and blake3 when installed. This
is how the core's checksum (XXH3-64 per ``CHECKSUM_CHUNK``) was chosen.
"""

from __future__ import annotations

import importlib
import statistics
import time
import zlib
from collections.abc import Callable

import torch
import xxhash

from wsync_core.protocol import CHECKSUM_CHUNK, checksum


def main() -> None:
    tensor = torch.randint(0, 255, (256 << 20,), dtype=torch.uint8)
    data = tensor.numpy().data
    target = torch.empty_like(tensor)

    def per_chunk(fn: Callable) -> Callable[[], object]:
        return lambda: [fn(data[i:i + CHECKSUM_CHUNK]) for i in range(0, len(data), CHECKSUM_CHUNK)]

    rows: dict[str, Callable[[], object]] = {
        "memcpy (preallocated)": lambda: target.copy_(tensor),
        "zlib.crc32": per_chunk(zlib.crc32),
        "xxh3_64": per_chunk(xxhash.xxh3_64_intdigest),
        "xxh3_128": per_chunk(xxhash.xxh3_128_intdigest),
        "wsync checksum (xxh3_64)": lambda: checksum(tensor),
    }
    for module, name, fn in (("crc32c", "crc32c", "crc32c"), ("blake3", "blake3 (1 thread)", "blake3")):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        f = getattr(mod, fn)
        rows[name] = per_chunk((lambda c, f=f: f(c).digest()) if module == "blake3" else f)
    print("256 MiB, 7 runs each (p50 and worst)")
    for name, run in rows.items():
        ts = []
        for _ in range(7):
            t0 = time.perf_counter()
            run()
            ts.append(time.perf_counter() - t0)
        p50 = statistics.median(ts)
        print(f"{name:<38} p50 {p50 * 1e3:7.1f} ms  max {max(ts) * 1e3:7.1f} ms  {0.25 / p50:6.2f} GiB/s")


if __name__ == "__main__":
    main()
