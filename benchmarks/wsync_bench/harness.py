"""The measurement behind ``wsync bench``: time one synchronous update per transport and model size, against this machine's floor.

Each measurement runs in its own sender process (spawned, in its own process group so a hung
system can be ended whole) with real worker processes. One update is what a trainer pays per
step: snapshot, deliver, and every worker's ack (``send()`` with ``sync=True``). The floor is a
single-thread memcpy of the same bytes, measured in the same run; network transports also get a
raw loopback TCP send of the same bytes. On CUDA models (``device="cuda"``) the floors are the
raw device copies an isolated update needs (``cuda_floor``). ``compare=["torchrl"]`` adds TorchRL's
``SharedMemWeightSyncScheme`` and ``MultiProcessWeightSyncScheme`` given explicit weights copied
into a reused buffer (their cheapest update that leaves the trainer's live tensors alone).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing
import os
import pickle
import platform
import selectors
import signal
import socket
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "BenchConfig",
    "Row",
    "Report",
    "parse_size",
    "format_size",
    "build_model",
    "split_system",
    "memcpy_floor",
    "cuda_floor",
    "tcp_floor",
    "run",
    "format_table",
    "write_json",
    "plot",
    "machine_info",
    "main",
]

#: systems that ``compare`` can add, and the TorchRL schemes they stand for
TORCHRL_SCHEMES = {"torchrl SharedMem": "SharedMemWeightSyncScheme",
                   "torchrl MultiProcess": "MultiProcessWeightSyncScheme"}
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_LAYERS = 4


# -- configuration and results ----------------------------------------------------------------
@dataclass
class BenchConfig:
    """What to time: wsync transports by name, model sizes in bytes, workers, repeats, comparisons."""

    transports: list[str]
    sizes: list[int]
    workers: int = 2
    repeat: int = 10
    warmup: int = 2
    compare: list[str] = field(default_factory=list)
    #: the scheme's timeout for every call (seconds)
    timeout: float = 60.0
    #: how long one measurement (start-up included) may take before its processes are ended
    job_timeout: float | None = None
    #: where the trainer's and every worker's model live: ``cpu`` or ``cuda``
    device: str = "cpu"


@dataclass
class Row:
    """One system at one size: latencies of each timed update, or the error that stopped it."""

    system: str
    kind: str  # "wsync", "torchrl" or "floor"
    nbytes: int
    workers: int | None
    latencies_s: list[float] = field(default_factory=list)
    error: str | None = None
    #: sender's peak resident memory above the model during connect + sends (bytes)
    sender_peak_above_model: int | None = None
    connect_s: float | None = None
    #: median time spent taking the snapshot, part of each update (wsync only)
    snapshot_s: float | None = None
    #: median latency over the floor's: the memcpy on CPU, the isolation copies on CUDA (``run``)
    x_memcpy: float | None = None
    #: torch threads of the process that copies (the sender's snapshot, or the memcpy floor)
    threads: int | None = None
    #: median seconds a worker took to read every weight once, right after applying a version
    #: (a zero-copy receiver pays its deferred page faults here), and to read them again
    first_read_s: float | None = None
    warm_read_s: float | None = None

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.latencies_s) if self.latencies_s else None

    @property
    def p10_s(self) -> float | None:
        return _percentile(self.latencies_s, 0.10)

    @property
    def p90_s(self) -> float | None:
        return _percentile(self.latencies_s, 0.90)

    @property
    def p99_s(self) -> float | None:
        return _percentile(self.latencies_s, 0.99)

    @property
    def gib_per_s(self) -> float | None:
        m = self.median_s
        return self.nbytes / m / 2**30 if m and self.system != UNIX_FLOOR else None  # the unix floor moves 16 bytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(size=format_size(self.nbytes), median_s=self.median_s, p10_s=self.p10_s, p90_s=self.p90_s,
                 p99_s=self.p99_s, gib_per_s=self.gib_per_s)
        return d


@dataclass
class Report:
    """A whole run: its configuration, the machine, and every row."""

    config: BenchConfig
    machine: dict[str, Any]
    rows: list[Row]

    def to_dict(self) -> dict[str, Any]:
        return {"config": asdict(self.config), "machine": self.machine, "rows": [r.to_dict() for r in self.rows]}


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def parse_size(text: str) -> int:
    """Bytes from ``"10KiB"``, ``"64MiB"``, ``"1.5GiB"``, ``"1MB"`` or ``"4096"``; raises ValueError."""
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("kmgib")
    unit = t[len(num):]
    try:
        value = float(num) * _UNITS[unit]
    except (KeyError, ValueError):
        raise ValueError(f"bad size {text!r}: expected a number with an optional unit "
                         f"(B, KiB, MiB, GiB, KB, MB, GB), e.g. 64MiB") from None
    if value < 4:
        raise ValueError(f"bad size {text!r}: a model needs at least 4 bytes")
    return int(value)


def format_size(nbytes: int) -> str:
    """``10KiB``, ``512MiB``, ``1.5GiB``: the shortest binary-unit spelling."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            v = nbytes / scale
            return f"{v:g}{unit}" if v == round(v, 2) else f"{v:.2f}{unit}"
    return f"{nbytes}B"


# -- the model --------------------------------------------------------------------------------
class _BenchModel(nn.Module):
    """``_LAYERS`` square linear layers and a running-stats buffer that make up the byte size exactly."""

    def __init__(self, dim: int, extra: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim, device="meta") for _ in range(_LAYERS if dim else 0))
        self.register_buffer("stats", torch.empty(extra, device="meta"))


def _model_dim(floats: int) -> int:
    """The largest layer width whose ``_LAYERS`` layers leave at least one float for the buffer."""
    dim = int(math.sqrt(max(floats - 1, 0) / _LAYERS))
    while dim > 0 and _LAYERS * (dim * dim + dim) > floats - 1:
        dim -= 1
    return dim


def build_model(nbytes: int, device: str = "cpu") -> nn.Module:
    """A float32 module of ``max(nbytes // 4, 1) * 4`` bytes on ``device``: a few matrices, biases
    and one buffer.

    Values are deterministic, not random: filling is cheap and the bytes moved are the same.
    """
    floats = max(nbytes // 4, 1)
    dim = _model_dim(floats)
    model = _BenchModel(dim, floats - _LAYERS * (dim * dim + dim))
    model.to_empty(device=device)
    with torch.no_grad():
        for i, t in enumerate(_tensors(model)):
            t.fill_(_fill(i))
    return model


def _tensors(model: nn.Module) -> list[torch.Tensor]:
    """The model's parameters, then its buffers."""
    return list(model.parameters()) + list(model.buffers())


def _fill(i: int) -> float:
    """What ``build_model`` fills its i-th tensor with."""
    return 0.001 * (i + 1)


def _bump(model: nn.Module) -> None:
    """What a training step does to the weights, in place (not timed: done on a GPU too on return)."""
    with torch.no_grad():
        for t in _tensors(model):
            t.add_(1.0)
    _synchronize(model)


def _synchronize(model: nn.Module) -> None:
    """Wait for the GPU work queued on ``model``'s device, if it is on one."""
    device = next(iter(model.buffers())).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- memory ------------------------------------------------------------------------------------
def _status_kib(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Reset this process's peak RSS (Linux ``clear_refs``); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# -- worker processes --------------------------------------------------------------------------
def _parent_alive() -> bool:
    parent = multiprocessing.parent_process()
    return parent is None or parent.is_alive()


def _tell(conn: Any, **msg: Any) -> None:
    """Harness messages between our own processes travel as JSON, never pickled."""
    conn.send_bytes(json.dumps(msg).encode())


def _one_thread(go: Any) -> None:
    """Worker processes run torch on one thread, as TorchRL's collectors set up theirs.

    Several processes with a full intra-op thread pool each, on few cores, spend the CPU
    spinning in idle OpenMP threads; a thread-based worker (inproc) keeps the process's setting.
    """
    if not isinstance(go, threading.Event):
        torch.set_num_threads(1)


def _wsync_worker(scheme: Any, worker_idx: int, nbytes: int, device: str, go: Any, stop: Any, conn: Any) -> None:
    try:
        _one_thread(go)
        model = build_model(nbytes, device)
        _tell(conn, ready=worker_idx)
        if not go.wait(300):
            raise RuntimeError("the sender never started")
        scheme.init_on_receiver(model=model, worker_idx=worker_idx)
        scheme.connect()
        held = None
        while not stop.is_set() and _parent_alive():
            version = scheme.receive(timeout=0.1)
            if version is not None:  # read as a rollout would, then warm; untimed
                held = version
                _tell(conn, worker=worker_idx, read=[_read_all(model), _read_all(model)])
        if held is not None:  # once the timing is over: work here would move the worker's next wake-up
            _check_exact(model, held)
    except Exception as exc:  # reported to the sender, which puts it in the row
        _tell(conn, error=f"worker {worker_idx}: {type(exc).__name__}: {exc}", trace=traceback.format_exc())
    finally:
        scheme.shutdown()


def _check_exact(model: nn.Module, version: int) -> None:
    """Raise RuntimeError unless the first and last weight of every tensor are what ``version``
    training steps made of them: ``build_model``'s fill plus ``version`` float32 additions of 1."""
    tensors = _tensors(model)
    want = torch.tensor([_fill(i) for i in range(len(tensors))], dtype=torch.float32)
    for _ in range(version):
        want.add_(1.0)
    for i, t in enumerate(tensors):
        got = t.detach().flatten()[[0, -1]].cpu()
        if not torch.equal(got, want[i].expand(2)):
            raise RuntimeError(f"version {version}: tensor {i} holds {got.tolist()}, expected {want[i].item()}")


def _read_all(model: nn.Module) -> float:
    """Seconds to read every byte of the model's weights once (a sum per tensor)."""
    t0 = time.perf_counter()
    with torch.no_grad():
        for t in _tensors(model):
            t.sum()
    _synchronize(model)
    return time.perf_counter() - t0


def _torchrl_worker(scheme: Any, worker_idx: int, nbytes: int, device: str, go: Any, stop: Any, conn: Any) -> None:
    try:
        _one_thread(go)
        model = build_model(nbytes, device)
        _tell(conn, ready=worker_idx)
        if not go.wait(300):  # TorchRL's receiver waits only 10 s for its initial weights
            raise RuntimeError("the sender never started")
        scheme.init_on_receiver(model_id="policy", model=model, worker_idx=worker_idx)
        scheme.connect(worker_idx=worker_idx)
        while not stop.wait(0.2) and _parent_alive():
            pass
    except Exception as exc:
        _tell(conn, error=f"worker {worker_idx}: {type(exc).__name__}: {exc}", trace=traceback.format_exc())
    finally:
        scheme.shutdown()


class _Workers:
    """N receivers: spawned processes, or threads for a transport that cannot cross processes."""

    def __init__(self, target: Callable[..., None], scheme: Any, n: int, nbytes: int, device: str,
                 threads: bool) -> None:
        self.ctx = multiprocessing.get_context("spawn")
        self.go = threading.Event() if threads else self.ctx.Event()
        self.stop = threading.Event() if threads else self.ctx.Event()
        self.conns = []
        self.procs: list[Any] = []
        self.ready: set[int] = set()
        #: [first read, warm read] seconds after each applied version, by worker
        self.reads: dict[int, list[list[float]]] = {i: [] for i in range(n)}
        for i in range(n):
            mine, theirs = self.ctx.Pipe(duplex=False)
            # each worker holds its own copy of the scheme, as it would in another process
            args = (pickle.loads(pickle.dumps(scheme)) if threads else scheme, i, nbytes, device, self.go, self.stop,
                    theirs)
            p = threading.Thread(target=target, args=args, daemon=True) if threads else self.ctx.Process(
                target=target, args=args, name=f"wsync-bench-worker-{i}")
            self.conns.append((mine, theirs))
            self.procs.append(p)

    def start(self, timeout: float) -> None:
        """Start every worker, wait until each has built its model, then let them connect.

        Raises RuntimeError if one fails or does not start by the timeout.
        """
        for p in self.procs:
            p.start()
        deadline = time.monotonic() + timeout
        while len(self.ready) < len(self.procs):
            self.check()
            if time.monotonic() > deadline:
                waiting = sorted(set(range(len(self.procs))) - self.ready)
                raise RuntimeError(f"workers {waiting} did not start within {timeout:g} s")
            time.sleep(0.02)
        self.go.set()

    def check(self) -> None:
        """Raise RuntimeError with the first worker error or death seen so far."""
        for i, (conn, _) in enumerate(self.conns):
            self._read(conn)
            p = self.procs[i]
            if isinstance(p, multiprocessing.process.BaseProcess) and p.exitcode not in (None, 0):
                raise RuntimeError(f"worker {i} exited with code {p.exitcode}")

    def wait_reads(self, count: int, timeout: float) -> None:
        """Wait until every worker has read its weights after ``count`` versions (the next update
        must not wait for a worker still reading the last one). Raises RuntimeError on expiry."""
        deadline = time.monotonic() + timeout
        while any(len(r) < count for r in self.reads.values()):
            self.check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers did not read version {count}'s weights within {timeout:g} s")
            time.sleep(0.0002)

    def _read(self, conn: Any) -> None:
        """Take in a worker's messages so far; raise RuntimeError with the error one reports."""
        while conn.poll(0):
            msg = json.loads(conn.recv_bytes())
            if "error" in msg:
                raise RuntimeError(msg["error"])
            if "read" in msg:
                self.reads[msg["worker"]].append(msg["read"])
            else:
                self.ready.add(msg["ready"])

    def close(self) -> str | None:
        """Stop the workers and end them; returns the first error one reported while stopping
        (its check of the weights it held last), or None."""
        self.stop.set()
        for p in self.procs:
            if p.ident is not None:
                p.join(timeout=30)
        for p in self.procs:
            if isinstance(p, multiprocessing.process.BaseProcess) and p.is_alive():
                p.kill()
                p.join(timeout=5)
        error = None
        for a, b in self.conns:
            try:
                self._read(a)
            except RuntimeError as exc:
                error = error or str(exc)
            a.close()
            b.close()
        return error


# -- one measurement, in the sender process -----------------------------------------------------
def _time_sends(model: nn.Module, repeat: int, warmup: int, send: Callable[[], None],
                workers: _Workers, settle: Callable[[int], None] | None = None) -> list[float]:
    """Time ``send`` after each training step; ``settle(k)`` (untimed) waits for the workers to
    be done with the k versions sent so far."""
    lat = []
    for k in range(warmup + repeat):
        if settle is not None:
            settle(k)
        _bump(model)
        t0 = time.perf_counter()
        send()
        dt = time.perf_counter() - t0
        if k >= warmup:
            lat.append(dt)
        workers.check()
    return lat


def _run_wsync(job: dict[str, Any]) -> dict[str, Any]:
    from wsync_core import WeightSyncScheme, get_transport

    nbytes, n, device = job["nbytes"], job["workers"], job["device"]
    name, options = split_system(job["system"])
    threads = not get_transport(name).capabilities.processes
    model = build_model(nbytes, device)
    rss0 = _status_kib("VmRSS")
    tracked = _reset_peak_rss() and rss0 is not None
    scheme = WeightSyncScheme(name, timeout=job["timeout"], **options)
    scheme.init_on_sender(model=model, num_workers=n)
    workers = _Workers(_wsync_worker, scheme, n, nbytes, device, threads)
    snapshots: list[float] = []
    try:
        workers.start(job["start_timeout"])
        t0 = time.perf_counter()
        scheme.connect()
        connect_s = time.perf_counter() - t0

        def send() -> None:
            scheme.send()
            snapshots.append(scheme.last_report.snapshot_s)

        lat = _time_sends(model, job["repeat"], job["warmup"], send, workers,
                          lambda k: workers.wait_reads(k, job["timeout"]))
        peak = _status_kib("VmHWM") if tracked else None
    finally:
        logging.getLogger("wsync").setLevel(logging.ERROR)  # workers leaving now is the plan, not news
        held_wrong = workers.close()
        scheme.shutdown()
    if held_wrong is not None:
        raise RuntimeError(held_wrong)
    reads = [r for per in workers.reads.values() for r in per[job["warmup"]:]]
    return {"latencies_s": lat, "connect_s": connect_s, "threads": torch.get_num_threads(),
            "first_read_s": statistics.median(r[0] for r in reads) if reads else None,
            "warm_read_s": statistics.median(r[1] for r in reads) if reads else None,
            "snapshot_s": statistics.median(snapshots[job["warmup"]:]) if len(snapshots) > job["warmup"] else None,
            "sender_peak_above_model": None if peak is None else max(0, (peak - rss0) * 1024)}


def _run_torchrl(job: dict[str, Any]) -> dict[str, Any]:
    import torchrl.weight_update as wu
    from tensordict import TensorDict

    nbytes, n, device = job["nbytes"], job["workers"], job["device"]
    ctx = multiprocessing.get_context("spawn")
    model = build_model(nbytes, device)
    live = TensorDict.from_module(model)
    rss0 = _status_kib("VmRSS")
    tracked = _reset_peak_rss() and rss0 is not None
    buffer = live.detach().clone()  # reused: the trainer copies into it before every send
    scheme = getattr(wu, TORCHRL_SCHEMES[job["system"]])()
    # SharedMem shares `buffer` itself with the workers (their models alias it): one copy per
    # update. MultiProcess gets a separate initial copy, so each send really moves `buffer`.
    initial = buffer if job["system"] == "torchrl SharedMem" else live.detach().clone()
    scheme.init_on_sender(model_id="policy", weights=initial, devices=[torch.device(device)] * n, ctx=ctx)
    workers = _Workers(_torchrl_worker, scheme, n, nbytes, device, threads=False)
    try:
        workers.start(job["start_timeout"])
        t0 = time.perf_counter()
        scheme.connect()
        connect_s = time.perf_counter() - t0

        def send() -> None:
            with torch.no_grad():
                buffer.update_(live)
            scheme.send(weights=buffer)
            _synchronize(model)

        lat = _time_sends(model, job["repeat"], job["warmup"], send, workers)
        peak = _status_kib("VmHWM") if tracked else None
    finally:
        scheme.shutdown()
        workers.close()
    return {"latencies_s": lat, "connect_s": connect_s,
            "sender_peak_above_model": None if peak is None else max(0, (peak - rss0) * 1024)}


def _sender_main(conn: Any, job: dict[str, Any]) -> None:
    """Entry point of a spawned sender: run one job, send back its figures as JSON."""
    os.setpgid(0, 0)  # own process group: the parent can end this sender and its workers together
    try:
        result = _run_torchrl(job) if job["kind"] == "torchrl" else _run_wsync(job)
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    _tell(conn, **result)


def _run_job(job: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run ``job`` in a fresh sender process; end its whole process group if it overruns."""
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_sender_main, args=(theirs, job), name=f"wsync-bench-{job['system']}")
    proc.start()
    theirs.close()
    reported = False
    try:
        if not mine.poll(timeout):
            return {"error": f"timed out after {timeout:g} s (sender and workers ended)"}
        reported = True
        try:
            return json.loads(mine.recv_bytes())
        except EOFError:
            proc.join(timeout=30)
            return {"error": f"sender process exited with code {proc.exitcode} before reporting"}
    finally:
        if reported:
            proc.join(timeout=30)  # a sender that reported cleans up and exits by itself
        _kill_group(proc.pid)  # the sender if it overran, and any worker it left behind
        if proc.is_alive():  # ended before it made its own process group
            proc.kill()
        proc.join(timeout=10)
        mine.close()


def _kill_group(pgid: int | None) -> None:
    if pgid is None:
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# -- floors, in this process ---------------------------------------------------------------------
#: torch threads a fresh process starts with: the sender's snapshot copies with as many
SENDER_THREADS = torch.get_num_threads()


def memcpy_floor(nbytes: int, repeat: int, threads: int = SENDER_THREADS) -> list[float]:
    """Seconds for copies of ``nbytes`` between two touched uint8 tensors on ``threads`` torch
    threads (by default as many as the sender's snapshot uses: the floor gets the same resources)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _timed_copies([(dst, src)], repeat)
    finally:
        torch.set_num_threads(previous)


def cuda_floor(nbytes: int, repeat: int, workers: int, kind: str) -> list[float]:
    """Seconds for the raw copies of ``nbytes`` that one update to ``workers`` CUDA receivers needs,
    in this process, waited for on the GPU: ``"copy"`` one device-to-device copy; ``"isolation"``
    one for the trainer's snapshot and one into each receiver's own model; ``"staged"`` the
    snapshot to host memory and one host-to-device copy per receiver (a slot in shared memory)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    if kind == "copy":
        pairs = [(torch.zeros_like(src), src)]
    elif kind == "isolation":
        snapshot = torch.zeros_like(src)
        pairs = [(snapshot, src)] + [(torch.zeros_like(src), snapshot) for _ in range(workers)]
    elif kind == "staged":
        host = torch.zeros(nbytes, dtype=torch.uint8)
        pairs = [(host, src)] + [(torch.zeros_like(src), host) for _ in range(workers)]
    else:
        raise ValueError(f"no CUDA floor {kind!r}")
    return _timed_copies(pairs, repeat)


def _timed_copies(pairs: list[tuple[torch.Tensor, torch.Tensor]], repeat: int) -> list[float]:
    """Seconds for each of ``max(repeat, 5)`` rounds of ``dst.copy_(src)`` over ``pairs``, in order,
    after one untimed round (a round on a GPU ends when the GPU is done)."""
    cuda = any(t.is_cuda for pair in pairs for t in pair)
    out = []
    for k in range(1 + max(repeat, 5)):
        t0 = time.perf_counter()
        for dst, src in pairs:
            dst.copy_(src)
        if cuda:
            torch.cuda.synchronize()
        if k:
            out.append(time.perf_counter() - t0)
    return out


def tcp_floor(nbytes: int, repeat: int) -> list[float]:
    """Seconds to send ``nbytes`` over loopback TCP and get a one-byte answer (a raw socket's floor)."""
    src = memoryview(torch.ones(nbytes, dtype=torch.uint8).numpy())
    sink = memoryview(bytearray(nbytes))
    server = socket.create_server(("127.0.0.1", 0))
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            conn, _ = server.accept()
            with conn:
                for _ in range(1 + max(repeat, 5)):
                    got = 0
                    while got < nbytes:
                        k = conn.recv_into(sink[got:], nbytes - got)
                        if k == 0:
                            return
                        got += k
                    conn.sendall(b"k")
        except OSError as exc:
            errors.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    out = []
    try:
        with socket.create_connection(server.getsockname()[:2], timeout=60) as c:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for k in range(1 + max(repeat, 5)):
                t0 = time.perf_counter()
                c.sendall(src)
                if c.recv(1) != b"k":
                    raise OSError("raw TCP floor: the loopback peer closed early")
                if k:
                    out.append(time.perf_counter() - t0)
    finally:
        server.close()
        thread.join(timeout=10)
    if errors:
        raise errors[0]
    return out


#: the floors of a run on CUDA models (``cuda_floor``'s kinds); the ratio column is over the
#: isolation copies, what no transport that keeps every worker's model its own can skip
CUDA_FLOORS = {"cuda copy": "copy", "cuda isolation copies": "isolation", "cuda staged copies": "staged"}

#: the floors' names: never a transport's (``unix`` and ``tcp`` are transports too)
UNIX_FLOOR, TCP_FLOOR = "raw unix", "raw tcp"
#: the unix floor is measured at model sizes up to this one, where a control round trip matters
UNIX_FLOOR_MAX_BYTES = 1 << 20


def unix_floor(workers: int, repeat: int) -> list[float]:
    """Seconds for a 16-byte message to each of ``workers`` processes over Unix sockets and a
    one-byte answer from each: the control round trip a transport between processes on one host
    cannot avoid (the payload's copy is the memcpy floor). The processes wait blocked in
    ``recv``, as workers do."""
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(workers)]
    children = []
    for i, (mine, theirs) in enumerate(pairs):
        pid = os.fork()
        if pid == 0:  # the child: answer each message until the socket closes; touches no torch
            code = 0
            try:
                for a, b in pairs:
                    a.close()
                    if b is not theirs:
                        b.close()
                while theirs.recv(64):
                    theirs.send(b"k")
            except OSError:
                code = 1
            finally:
                os._exit(code)
        children.append(pid)
        theirs.close()
    out = []
    try:
        with selectors.DefaultSelector() as sel:
            for mine, _ in pairs:
                sel.register(mine, selectors.EVENT_READ)
            message = b"0123456789abcdef"
            for k in range(1 + max(repeat, 5)):
                t0 = time.perf_counter()
                for mine, _ in pairs:
                    mine.send(message)
                waiting = workers
                while waiting:
                    for key, _ in sel.select(60):
                        if key.fileobj.recv(64) != b"k":
                            raise OSError("raw Unix floor: a worker process closed early")
                        waiting -= 1
                if k:
                    out.append(time.perf_counter() - t0)
    finally:
        for mine, _ in pairs:
            mine.close()
        for pid in children:
            os.waitpid(pid, 0)
    return out


# -- the run -----------------------------------------------------------------------------------
class _Progress:
    """tqdm when it is installed, else one updating line on stderr."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=total, unit="run", file=sys.stderr, dynamic_ncols=True)

    def step(self, label: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_description(label)
            return
        end = "\r" if sys.stderr.isatty() else "\n"
        width = 24
        filled = width * self.done // max(self.total, 1)
        print(f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {label:<40}", end=end,
              file=sys.stderr, flush=True)

    def advance(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and sys.stderr.isatty():
            print(file=sys.stderr)


def _systems(config: BenchConfig) -> list[tuple[str, str]]:
    systems = [(t, "wsync") for t in config.transports]
    for c in config.compare:
        if c != "torchrl":
            raise ValueError(f"--compare takes 'torchrl', got {c!r}")
        systems += [(name, "torchrl") for name in TORCHRL_SCHEMES]
    return systems


def split_system(system: str) -> tuple[str, dict[str, Any]]:
    """``"shm:cuda_ipc=true"`` -> ``("shm", {"cuda_ipc": True})``: a transport's name, then its
    options as ``:KEY=VALUE`` items. Raises ValueError for an item without '='."""
    from wsync_core.transport import parse_options

    name, *pairs = system.split(":")
    return name.strip(), parse_options(pairs)


def _unavailable(system: str, kind: str, device: str = "cpu") -> str | None:
    """Why ``system`` cannot run here on ``device`` models, or None."""
    if kind == "torchrl":
        try:
            import torchrl.weight_update  # noqa: F401
        except ImportError as exc:
            return f"TorchRL is not installed ({exc}); pip install torchrl"
        return None
    from wsync_core import UnknownTransportError, get_transport
    from wsync_core.transport import check_options

    try:
        name, options = split_system(system)
        cls = get_transport(name)
        check_options(cls, options)
    except (UnknownTransportError, ValueError) as exc:
        return str(exc)
    if device == "cuda" and not cls.capabilities.cuda:
        return f"transport {name!r} does not declare the 'cuda' capability"
    return None


def _network(system: str) -> bool:
    from wsync_core import get_transport

    try:
        return get_transport(split_system(system)[0]).capabilities.multi_host
    except Exception:  # an unknown transport has no floor of its own; its row carries the error
        return False


def run(config: BenchConfig, progress: bool = True) -> Report:
    """Time every system at every size; failures become rows with ``error`` set, never exceptions."""
    if config.workers < 1 or config.repeat < 1:
        raise ValueError(f"workers and repeat must be >= 1, got {config.workers} and {config.repeat}")
    systems = _systems(config)
    network = any(kind == "wsync" and _network(s) for s, kind in systems)
    floors = (["memcpy"] if config.device == "cpu" else list(CUDA_FLOORS)) + ([TCP_FLOOR] if network else [])
    bar = _Progress(len(config.sizes) * (len(floors) + len(systems)), progress)
    rows: list[Row] = []
    try:
        for nbytes in config.sizes:
            nbytes = max(nbytes // 4, 1) * 4  # what the model really holds
            # on a GPU the wake-up and ack can outweigh the copy at any size
            unix = nbytes <= UNIX_FLOOR_MAX_BYTES or config.device == "cuda"
            here = floors + ([UNIX_FLOOR] if unix else [])
            floor_rows = [Row(name, "floor", nbytes, config.workers if name in (UNIX_FLOOR, *CUDA_FLOORS) else None,
                              threads=SENDER_THREADS if name == "memcpy" else None)
                          for name in here]
            rows += floor_rows
            for row in floor_rows:  # half the floor's samples before the systems ...
                bar.step(f"{row.system} {format_size(nbytes)}")
                _measure_floor(row, config.repeat)
                bar.advance()
            for system, kind in systems:
                bar.step(f"{system} {format_size(nbytes)} x{config.workers}")
                row = Row(system, kind, nbytes, config.workers)
                row.error = _unavailable(system, kind, config.device)
                if row.error is None:
                    job = {"system": system, "kind": kind, "nbytes": nbytes, "workers": config.workers,
                           "repeat": config.repeat, "warmup": config.warmup, "timeout": config.timeout,
                           "device": config.device,
                           "start_timeout": 120.0 + 15.0 * config.workers}
                    result = _run_job(job, config.job_timeout or _job_timeout(config, nbytes))
                    row.error = result.get("error")
                    for key in ("latencies_s", "connect_s", "snapshot_s", "sender_peak_above_model", "threads",
                                "first_read_s", "warm_read_s"):
                        if key in result:
                            setattr(row, key, result[key])
                rows.append(row)
                bar.advance()
            for row in floor_rows:  # ... and half after, so a noisy spell weighs on both sides
                _measure_floor(row, config.repeat)
    finally:
        bar.close()
    base = "memcpy" if config.device == "cpu" else "cuda isolation copies"
    floor = {r.nbytes: r.median_s for r in rows if r.system == base}
    for r in rows:
        if r.median_s and floor.get(r.nbytes) and r.system != UNIX_FLOOR:
            r.x_memcpy = r.median_s / floor[r.nbytes]
    return Report(config, machine_info(config.device), rows)


def _measure_floor(row: Row, repeat: int) -> None:
    if row.error is not None:
        return
    try:
        if row.system == "memcpy":
            row.latencies_s += memcpy_floor(row.nbytes, repeat)
        elif row.system in CUDA_FLOORS:
            row.latencies_s += cuda_floor(row.nbytes, repeat, row.workers, CUDA_FLOORS[row.system])
        elif row.system == UNIX_FLOOR:
            row.latencies_s += unix_floor(row.workers, repeat)
        else:
            row.latencies_s += tcp_floor(row.nbytes, repeat)
    except OSError as exc:
        row.error = f"{type(exc).__name__}: {exc}"


def _job_timeout(config: BenchConfig, nbytes: int) -> float:
    # start-up (spawning and importing on a loaded machine), then generous per-update time
    per_update = 2.0 + nbytes / 20e6
    return 180.0 + 20.0 * config.workers + (config.repeat + config.warmup) * per_update


# -- output ------------------------------------------------------------------------------------
def machine_info(device: str = "cpu") -> dict[str, Any]:
    """Where the figures come from: OS, CPU, cores, memory, Python, torch, wsync and its transports,
    and the GPU on ``cuda``."""
    from wsync_core import __version__, list_transports

    cpu = platform.processor() or platform.machine()
    mem = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except OSError:
        pass
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_bytes": mem,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "wsync_core": __version__,
        "transports": {i.name: {"distribution": i.distribution, "version": i.version, "error": i.error}
                       for i in list_transports()},
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "device": device,
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    try:
        import importlib.metadata

        info["torchrl"] = importlib.metadata.version("torchrl")
    except importlib.metadata.PackageNotFoundError:
        info["torchrl"] = None
    return info


def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    ms = v * 1e3
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:.0f}"


def format_table(report: Report) -> str:
    """The report as an aligned text table (Markdown-compatible), one line per system and size."""
    ratio = "x memcpy" if report.config.device == "cpu" else "x isolation"
    head = ("system", "size", "workers", "threads", "median ms", "p10 ms", "p90 ms", "p99 ms", "GiB/s", ratio,
            "1st read ms", "warm read ms", "sender +MiB")
    lines = [head]
    for r in report.rows:
        if r.error:
            lines.append((r.system, format_size(r.nbytes), str(r.workers or "-"), str(r.threads or "-"),
                          "error: " + r.error.splitlines()[0], *[""] * (len(head) - 5)))
            continue
        lines.append((
            r.system, format_size(r.nbytes), str(r.workers or "-"), str(r.threads or "-"), _ms(r.median_s),
            _ms(r.p10_s), _ms(r.p90_s), _ms(r.p99_s), f"{r.gib_per_s:.2f}" if r.gib_per_s else "-",
            f"{r.x_memcpy:.2f}" if r.x_memcpy else "-", _ms(r.first_read_s), _ms(r.warm_read_s),
            "-" if r.sender_peak_above_model is None else f"{r.sender_peak_above_model / 2**20:.0f}",
        ))
    widths = [max(len(line[c]) for line in lines if not line[c].startswith("error: ")) for c in range(len(head))]
    out = []
    for k, line in enumerate(lines):
        error = line[4].startswith("error: ")
        cells = [line[c].ljust(widths[c]) if c < 3 else line[c].rjust(widths[c]) for c in range(len(head))]
        if error:
            cells = [line[c].ljust(widths[c]) for c in range(4)] + [line[4]]
        out.append("| " + " | ".join(cells) + " |" if error else "| " + " | ".join(cells).rstrip() + " |")
        if k == 0:
            out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)


def write_json(report: Report, path: str) -> None:
    """Every figure of ``report``, with the machine's description, as JSON at ``path``."""
    with open(path, "w") as f:
        json.dump(report.to_dict(), f, indent=2)
        f.write("\n")


#: how ``plot`` draws each floor (line style, gray level)
_FLOOR_STYLES = {"memcpy": ("--", "black"), TCP_FLOOR: ("-.", "0.45"), UNIX_FLOOR: (":", "0.45")}


def plot(report: Report, path: str) -> None:
    """Median latency against model size, log-log, one line per system, floors dashed; PNG at ``path``.

    Raises ImportError naming matplotlib if it is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(f"--plot needs matplotlib ({exc}); pip install matplotlib") from None
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=100)
    names = list(dict.fromkeys(r.system for r in report.rows))
    for name in names:
        pts = sorted(((r.nbytes, r) for r in report.rows if r.system == name and r.median_s), key=lambda p: p[0])
        if not pts:
            continue
        xs = [n / 2**20 for n, _ in pts]
        ys = [r.median_s * 1e3 for _, r in pts]
        floor = pts[0][1].kind == "floor"
        label = {"memcpy": "memcpy floor", UNIX_FLOOR: "raw Unix round trip to the workers",
                 TCP_FLOOR: "raw TCP loopback floor"}.get(name, name)
        style, color = _FLOOR_STYLES.get(name, ("--", "0.45")) if floor else ("-o", None)  # floors in grays:
        line, = ax.plot(xs, ys, style, label=label, color=color,  # the systems keep the colors apart
                        linewidth=1.2 if floor else 1.8, markersize=4)
        if not floor:
            ax.fill_between(xs, [r.p10_s * 1e3 for _, r in pts], [r.p90_s * 1e3 for _, r in pts],
                            color=line.get_color(), alpha=0.15, linewidth=0)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("model size (MiB)")
    ax.set_ylabel("one synchronous update (ms, median; band p10-p90)")
    m = report.machine
    ax.set_title(f"wsync bench: {report.config.workers} worker processes, {m.get('cores')} cores, "
                 f"{m.get('cpu')}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    """``wsync bench``: run, print the table, write JSON and a plot if asked. Exit 1 if a wsync transport failed."""
    try:
        config = BenchConfig(
            transports=[t.strip() for t in args.transports.split(",") if t.strip()],
            sizes=[parse_size(s) for s in args.sizes.split(",") if s.strip()],
            workers=args.workers,
            repeat=args.repeat,
            compare=[c.strip() for c in (args.compare or "").split(",") if c.strip()],
            device=args.device,
        )
        _systems(config)
        if config.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: CUDA is not available on this machine")
        if config.workers < 1 or config.repeat < 1:
            raise ValueError(f"--workers and --repeat must be >= 1, got {config.workers} and {config.repeat}")
        unknown = [why for name in config.transports if (why := _unavailable(name, "wsync", config.device))]
        if unknown:
            raise ValueError("; ".join(unknown))
    except ValueError as exc:
        print(f"wsync bench: {exc}", file=sys.stderr)
        return 2
    report = run(config, progress=True)
    print(format_table(report))
    if args.json_file:
        write_json(report, args.json_file)
        print(f"wrote {args.json_file}")
    if args.plot:
        plot(report, args.plot)
        print(f"wrote {args.plot}")
    failed = [r for r in report.rows if r.kind == "wsync" and r.error]
    return 1 if failed else 0
