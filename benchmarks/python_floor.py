"""The floor of a small update in Python: only the steps a shared-memory update cannot skip.

A trainer and ``--workers`` forked processes share one file of memory under /dev/shm. Per
update the trainer locks it (``flock``), copies a 10 KiB model (9 tensors, as ``wsync bench``'s)
into it with one ``_foreach_copy_``, unlocks, and sends each worker a short message over its own
Unix socket; each worker, blocked in ``recv``, takes a shared lock, copies the 9 tensors into its
model, unlocks and replies; the trainer waits for every reply with ``epoll``. No versions, no
checks, no headers, no model walk: what is left of wsync's fixed cost once all of that is gone,
with the same wake-ups of the same processes on the same cores (issue 20)::

    python benchmarks/python_floor.py --workers 2 --updates 2000
"""

from __future__ import annotations

import argparse
import fcntl
import mmap
import multiprocessing
import os
import select
import socket
import statistics
import time
import uuid

import torch

_TENSORS = 9
_FLOATS = 256  # 9 x 1 KiB: the 10 KiB model's size and tensor count


def _views(buffer: mmap.mmap) -> list[torch.Tensor]:
    flat = torch.frombuffer(buffer, dtype=torch.float32)
    return [flat[i * _FLOATS:(i + 1) * _FLOATS] for i in range(_TENSORS)]


def _worker(sock: socket.socket, path: str, inherited: list[socket.socket]) -> None:
    for other in inherited:  # the trainer's ends of earlier workers' sockets: theirs must see EOF
        other.close()
    torch.set_num_threads(1)
    fd = os.open(path, os.O_RDWR)
    shared = _views(mmap.mmap(fd, _TENSORS * _FLOATS * 4))
    model = [torch.zeros(_FLOATS) for _ in range(_TENSORS)]
    while True:
        data = sock.recv(64)
        if not data:
            return
        fcntl.flock(fd, fcntl.LOCK_SH)
        with torch.no_grad():
            torch._foreach_copy_(model, shared)
        fcntl.flock(fd, fcntl.LOCK_UN)
        sock.send(data)


def run(workers: int, updates: int, warmup: int) -> list[float]:
    """Seconds per update (copy in, notify every worker, every reply), after ``warmup`` untimed ones."""
    path = f"/dev/shm/wsync-floor-{uuid.uuid4().hex[:12]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    took: list[float] = []
    ctx = multiprocessing.get_context("fork")
    socks: list[socket.socket] = []
    procs = []
    try:
        os.ftruncate(fd, _TENSORS * _FLOATS * 4)
        shared = _views(mmap.mmap(fd, _TENSORS * _FLOATS * 4))
        model = [torch.ones(_FLOATS) for _ in range(_TENSORS)]
        for _ in range(workers):
            mine, theirs = socket.socketpair()
            p = ctx.Process(target=_worker, args=(theirs, path, list(socks) + [mine]), daemon=True)
            p.start()
            theirs.close()
            socks.append(mine)
            procs.append(p)
        by_fd = {s.fileno(): s for s in socks}
        poller = select.epoll()
        for s in socks:
            poller.register(s.fileno(), select.EPOLLIN)
        for step in range(warmup + updates):
            with torch.no_grad():
                model[0].add_(1.0)
            t0 = time.perf_counter()
            fcntl.flock(fd, fcntl.LOCK_EX)
            with torch.no_grad():
                torch._foreach_copy_(shared, model)
            fcntl.flock(fd, fcntl.LOCK_UN)
            message = b"%d" % step
            for s in socks:
                s.send(message)
            replies = 0
            while replies < workers:
                for ready, _ in poller.poll():
                    by_fd[ready].recv(64)
                    replies += 1
            if step >= warmup:
                took.append(time.perf_counter() - t0)
        poller.close()
    finally:
        for s in socks:
            s.close()
        for p in procs:
            p.join(30)
        os.close(fd)
        os.unlink(path)
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--updates", type=int, default=2000, help="timed updates")
    parser.add_argument("--warmup", type=int, default=200)
    args = parser.parse_args()
    took = sorted(run(args.workers, args.updates, args.warmup))
    p99 = took[min(len(took) - 1, int(len(took) * 0.99))]
    print(f"python floor, {args.workers} workers, {len(took)} updates: p50 {statistics.median(took) * 1e3:.3f} ms, "
          f"p99 {p99 * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
