"""The floor of a small update in Python: only the steps a shared-memory update cannot skip.

A trainer and ``--workers`` forked processes share one file of memory under /dev/shm. Per
update the trainer locks it (``flock``), copies a 10 KiB model (9 tensors, as ``wsync bench``'s)
into it with one ``_foreach_copy_``, unlocks, and sends each worker a short message over its own
Unix socket; each worker, blocked in ``recv``, takes a shared lock, copies the 9 tensors into its
model, unlocks and replies; the trainer waits for every reply with ``epoll``. No versions, no
checks, no headers, no model walk: what is left of wsync's fixed cost once all of that is gone,
with the same wake-ups of the same processes on the same cores (issue 20)::

    python benchmarks/python_floor.py --workers 2 --updates 2000

``--checked`` adds what wsync does to the model on every update and may not skip (a worker's
model may have been replaced, re-pointed or shared since the last one): both sides hold
``wsync bench``'s module, and each update walks it (``flatten``), checks every tensor
(``Layout.ready``) and copies with wsync's one native call (``Layout.pack``/``unpack``). What
is left between this and ``wsync bench`` is the protocol: versions, headers, acks, slots.
The CPU each process spent per update is printed too (the trainer's own, and each worker's).

``--against shm,mp`` then runs the same loop through wsync in the same run (a sender and
``--workers`` spawned workers in a ``receive()`` loop, ``send()`` after each step, the
workers' CPU read from ``/proc``, Linux only), so the two lines compare the same work::

    python benchmarks/python_floor.py --checked --against shm,mp --workers 2
"""

from __future__ import annotations

import argparse
import fcntl
import mmap
import multiprocessing
import os
import resource
import select
import socket
import statistics
import time
import uuid
from typing import Any, Callable

import torch

_TENSORS = 9
_FLOATS = 256  # 9 x 1 KiB: the 10 KiB model's size and tensor count
_FILE = 1 << 16  # room for either model, with the layout's alignment


def _plain(buffer: mmap.mmap, ones: bool) -> Callable[[bool], None]:
    """The unchecked copy: 9 tensors of 1 KiB in or out of the file, one ``_foreach_copy_``."""
    flat = torch.frombuffer(buffer, dtype=torch.float32)
    shared = [flat[i * _FLOATS:(i + 1) * _FLOATS] for i in range(_TENSORS)]
    model = [(torch.ones if ones else torch.zeros)(_FLOATS) for _ in range(_TENSORS)]

    def copy(into_file: bool) -> None:
        if into_file:
            model[0].add_(1.0)
        with torch.no_grad():
            torch._foreach_copy_(*((shared, model) if into_file else (model, shared)))
    return copy


def _checked(buffer: mmap.mmap, ones: bool) -> Callable[[bool], None]:
    """The copy wsync makes: walk the module, check its tensors, one native copy."""
    from wsync_bench.harness import build_model
    from wsync_core.layout import Layout
    from wsync_core.weights import flatten

    module = build_model(_TENSORS * _FLOATS * 4)
    layout = Layout.of(flatten(module))
    flat = torch.frombuffer(buffer, dtype=torch.uint8)

    def copy(into_file: bool) -> None:
        if into_file:
            with torch.no_grad():
                next(module.parameters()).add_(1.0)
            tensors = flatten(module)
            layout.pack(tensors, flat, ready=layout.ready(tensors, write=False))
        else:
            targets = flatten(module, detach=False)
            layout.unpack(flat, targets, ready=layout.ready(targets))
    return copy


def _worker(sock: socket.socket, path: str, inherited: list[socket.socket], checked: bool) -> None:
    for other in inherited:  # the trainer's ends of earlier workers' sockets: theirs must see EOF
        other.close()
    torch.set_num_threads(1)
    fd = os.open(path, os.O_RDWR)
    copy = (_checked if checked else _plain)(mmap.mmap(fd, _FILE), ones=False)
    while True:
        data = sock.recv(64)
        if not data:
            return
        fcntl.flock(fd, fcntl.LOCK_SH)
        copy(False)
        fcntl.flock(fd, fcntl.LOCK_UN)
        sock.send(data)


def run(workers: int, updates: int, warmup: int, checked: bool = False) -> tuple[list[float], float, float]:
    """Seconds per update (copy in, notify every worker, every reply), after ``warmup`` untimed
    ones; and the CPU seconds per update of the trainer and of each worker (their mean)."""
    path = f"/dev/shm/wsync-floor-{uuid.uuid4().hex[:12]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    took: list[float] = []
    ctx = multiprocessing.get_context("fork")
    socks: list[socket.socket] = []
    procs = []
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        os.ftruncate(fd, _FILE)
        copy = (_checked if checked else _plain)(mmap.mmap(fd, _FILE), ones=True)
        for _ in range(workers):
            mine, theirs = socket.socketpair()
            p = ctx.Process(target=_worker, args=(theirs, path, list(socks) + [mine], checked), daemon=True)
            p.start()
            theirs.close()
            socks.append(mine)
            procs.append(p)
        by_fd = {s.fileno(): s for s in socks}
        poller = select.epoll()
        for s in socks:
            poller.register(s.fileno(), select.EPOLLIN)
        cpu0 = time.process_time()
        for step in range(warmup + updates):
            t0 = time.perf_counter()
            fcntl.flock(fd, fcntl.LOCK_EX)
            copy(True)  # (the unchecked trainer's step, one add_, is inside the timing: a few µs)
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
        trainer_cpu = time.process_time() - cpu0
        poller.close()
    finally:
        for s in socks:
            s.close()
        for p in procs:
            p.join(30)
        os.close(fd)
        os.unlink(path)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # (the workers, reaped: their whole lives)
    workers_cpu = (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / max(workers, 1)
    return took, trainer_cpu / (warmup + updates), workers_cpu / (warmup + updates)


def _proc_cpu(pid: int) -> float:
    """CPU seconds (user and system) process ``pid`` has used so far, from ``/proc``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wsync_worker(scheme: Any, worker_idx: int, go: Any, stop: Any) -> None:
    from wsync_bench.harness import build_model

    torch.set_num_threads(1)
    model = build_model(_TENSORS * _FLOATS * 4)
    go.wait()
    scheme.init_on_receiver(model=model, worker_idx=worker_idx)
    scheme.connect()
    try:
        while not stop.is_set():
            scheme.receive(timeout=0.1)
    finally:
        scheme.shutdown()


def run_wsync(transport: str, workers: int, updates: int, warmup: int) -> tuple[list[float], float, float]:
    """As ``run``, through wsync's ``transport``: seconds per ``send()`` (sync: every ack), and
    the CPU per update of the sender and of each worker (their mean) over the timed updates."""
    from wsync_bench.harness import build_model
    from wsync_core import WeightSyncScheme

    ctx = multiprocessing.get_context("spawn")
    model = build_model(_TENSORS * _FLOATS * 4)
    scheme = WeightSyncScheme(transport)
    scheme.init_on_sender(model=model, num_workers=workers)
    go, stop = ctx.Event(), ctx.Event()
    procs = [ctx.Process(target=_wsync_worker, args=(scheme, i, go, stop), daemon=True) for i in range(workers)]
    for p in procs:
        p.start()
    pids = [p.pid for p in procs if p.pid is not None]
    took: list[float] = []
    try:
        go.set()
        scheme.connect()
        for step in range(warmup + updates):
            if step == warmup:
                cpu0, procs0 = time.process_time(), [_proc_cpu(pid) for pid in pids]
            with torch.no_grad():
                next(model.parameters()).add_(1.0)
            t0 = time.perf_counter()
            scheme.send()
            took.append(time.perf_counter() - t0)
        sender_cpu = time.process_time() - cpu0
        workers_cpu = sum([_proc_cpu(pid) - c for pid, c in zip(pids, procs0)]) / workers
    finally:
        stop.set()
        for p in procs:
            p.join(30)
        scheme.shutdown()
    return took[warmup:], sender_cpu / updates, workers_cpu / updates


def _report(what: str, workers: int, took: list[float], trainer: float, worker: float) -> None:
    took = sorted(took)
    p99 = took[min(len(took) - 1, int(len(took) * 0.99))]
    print(f"{what}, {workers} workers, {len(took)} updates: p50 {statistics.median(took) * 1e3:.3f} ms, "
          f"p99 {p99 * 1e3:.3f} ms; CPU per update: trainer {trainer * 1e6:.0f} us, each worker {worker * 1e6:.0f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--updates", type=int, default=2000, help="timed updates")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--checked", action="store_true",
                        help="walk, check and copy the model as wsync must on every update")
    parser.add_argument("--against", default="", help="wsync transports to run the same loop through, e.g. shm,mp")
    args = parser.parse_args()
    _report("python floor" + (", checked" if args.checked else ""), args.workers,
            *run(args.workers, args.updates, args.warmup, args.checked))
    for transport in filter(None, args.against.split(",")):
        _report(f"wsync {transport}", args.workers, *run_wsync(transport, args.workers, args.updates, args.warmup))


if __name__ == "__main__":
    main()
