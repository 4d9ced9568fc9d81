"""What a process holds (threads, file descriptors, child processes, shared memory, inproc
channels, listening sockets), so the suite can prove that ``shutdown()`` frees it all."""

from __future__ import annotations

import glob
import os
import threading
import time
from collections.abc import Collection
from typing import Any

__all__ = ["snapshot", "leaks", "shm_entries", "listening_sockets", "wait_for_no_leaks"]

_SHM = "/dev/shm"


def demand_s() -> float:
    """Seconds this process's threads have run or waited to run (``/proc/self/task/*/schedstat``):
    what a busy loop takes is the same however loaded the machine is, where CPU time alone shrinks
    with a busy loop's share of the cores. ``time.process_time()`` where the kernel keeps no such
    figures."""
    by_thread = demand_by_thread()
    return sum(by_thread.values()) if by_thread else time.process_time()


def demand_by_thread() -> dict[int, float]:
    """``demand_s`` of each of this process's threads, by native thread id; {} where the kernel
    keeps no such figures."""
    out: dict[int, float] = {}
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ():
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                on_cpu, waiting = f.read().split()[:2]
        except (OSError, ValueError):  # a thread that ended meanwhile
            continue
        out[int(tid)] = (int(on_cpu) + int(waiting)) / 1e9
    return out


def busiest_threads(before: dict[int, float], after: dict[int, float], n: int = 3) -> str:
    """The ``n`` threads that ran or waited to run most between two ``demand_by_thread`` readings,
    with their Python names where they have one: ``"MainThread 0.98 s, wsync-probe (...) 0.01 s"``."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    spent = sorted(((after[t] - before.get(t, 0.0), t) for t in after), reverse=True)[:n]
    return ", ".join(f"{names.get(t, f'thread {t}')} {s:.2f} s" for s, t in spent) or "no figures"


def _fds() -> dict[str, str]:
    base = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    out = {}
    for fd in os.listdir(base):
        try:
            out[fd] = os.readlink(os.path.join(base, fd))
        except OSError:  # closed between listdir and readlink (e.g. the listdir fd itself)
            continue
    return out


def _children() -> list[int]:
    pids: set[int] = set()
    for path in glob.glob("/proc/self/task/*/children"):
        try:
            with open(path) as f:
                pids.update(int(p) for p in f.read().split())
        except OSError:
            continue
    return sorted(pids)


def _shm_mapped() -> list[str]:
    found = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if _SHM + "/" in line:
                    found.add(line.split(None, 5)[-1].strip().replace(" (deleted)", ""))
    except OSError:
        pass
    for target in _fds().values():
        if target.startswith(_SHM + "/"):
            found.add(target.replace(" (deleted)", ""))
    return sorted(found)


def shm_entries() -> set[str]:
    """Paths of the shared-memory segments that exist now (machine-wide)."""
    try:
        return {os.path.join(_SHM, n) for n in os.listdir(_SHM)}
    except OSError:
        return set()


def _inproc_channels() -> list[str]:
    from wsync_core.inproc import open_channels

    return open_channels()


def snapshot(exclude_threads: set[int] | None = None) -> dict[str, Any]:
    """This process's resources now (JSON-serialisable)."""
    threads = {str(t.ident): t.name for t in threading.enumerate()
               if t.ident is not None and t.ident not in (exclude_threads or set())}
    fds = {fd: target for fd, target in _fds().items()}
    return {
        "pid": os.getpid(),
        "threads": threads,
        "fds": fds,
        "children": _children(),
        "shm_mapped": _shm_mapped(),
        "inproc_channels": _inproc_channels(),
        "listening": listening_sockets(),
    }


def leaks(before: dict[str, Any], after: dict[str, Any], ignore_children: Collection[int] = frozenset()) -> list[str]:
    """What ``after`` holds that ``before`` did not, one line per resource (empty: nothing leaked)."""
    out = []
    for ident, name in after["threads"].items():
        if ident not in before["threads"]:
            out.append(f"thread {name!r} (ident {ident}) still running")
    for fd, target in after["fds"].items():
        if before["fds"].get(fd) != target and not target.startswith("/proc/"):
            out.append(f"file descriptor {fd} -> {target} still open")
    for pid in after["children"]:
        if pid not in before["children"] and pid not in ignore_children:
            out.append(f"child process {pid} still alive")
    for path in after["shm_mapped"]:
        if path not in before["shm_mapped"]:
            out.append(f"shared memory {path} still mapped or open")
    for name in after["inproc_channels"]:
        if name not in before["inproc_channels"]:
            out.append(f"inproc channel {name!r} still open")
    for sock in after["listening"]:
        if sock not in before["listening"]:
            out.append(f"socket still listening on {sock}")
    return out


def wait_for_no_leaks(before: dict[str, Any], take, grace: float = 5.0, **kw) -> list[str]:
    """Re-take the snapshot (``take()``) until nothing leaked or ``grace`` seconds pass."""
    end = time.monotonic() + grace
    while True:
        found = leaks(before, take(), **kw)
        if not found or time.monotonic() > end:
            return found
        time.sleep(0.1)


def _socket_inodes() -> set[str]:
    out = set()
    for target in _fds().values():
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def _decode_addr(hexaddr: str) -> str:
    addr, port = hexaddr.split(":")
    if len(addr) == 8:
        ip = ".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0))
    else:
        words = [addr[i:i + 8] for i in range(0, 32, 8)]
        raw = b"".join(bytes.fromhex(w)[::-1] for w in words)
        ip = ":".join(raw[i:i + 2].hex() for i in range(0, 16, 2))
    return f"{ip}:{int(port, 16)}"


def listening_sockets() -> list[str]:
    """``ip:port`` of the TCP sockets this process listens on (Linux; empty elsewhere)."""
    inodes = _socket_inodes()
    out = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if parts[3] == "0A" and parts[9] in inodes:  # 0A: LISTEN
                        out.append(_decode_addr(parts[1]))
        except (OSError, StopIteration):
            continue
    return sorted(out)


def is_loopback(addr: str) -> bool:
    """True for 127.0.0.0/8, ::1 and IPv4-mapped loopback addresses."""
    ip = addr.rsplit(":", 1)[0]
    return (ip.startswith("127.") or ip == "0000:0000:0000:0000:0000:0000:0000:0001"
            or ip.startswith("0000:0000:0000:0000:0000:ffff:7f"))
