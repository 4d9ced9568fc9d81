"""Several "hosts" on one machine: Linux network namespaces joined by a bridge (needs root and ``ip``).

``with hosts(3) as (a, b, c):`` gives three namespaces on one /24, each reachable from the others at
``.address``; ``.run(argv)`` starts a process inside one, ``.cut()``/``.restore()`` take its link down
and up. The bridge sits in a namespace of its own, so nothing is added to this machine's network
(unless ``local=True`` makes this process one of the hosts), and everything is deleted on exit.
What a killed process left behind (its pid is in every name) is deleted by the next ``hosts``,
and a ``local`` host's subnet is one no link of this machine uses: a leftover route to the same
/24 would take its packets elsewhere.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

__all__ = ["Host", "hosts", "available"]

_counter = itertools.count()
#: held while one process reaps leftovers and picks a subnet for a local link, then makes that link
_LOCK_PATH = "/tmp/wsync-netns.lock"
#: the names ``hosts`` gives, with the pid of the process that made them
_OURS = re.compile(r"^(?:wsync(\d+)-\d+(?:sw|h\d+)|ws(\d+)c\d+)$")


def _ip(*args: str) -> None:
    """Run ``ip ARGS``; raises RuntimeError with its stderr if it fails."""
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if result.returncode:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")


def _ids() -> tuple[int, int]:
    """This process's id and a count of calls: names unique across processes and calls."""
    return os.getpid(), next(_counter)


def _listed(*args: str) -> str:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    return result.stdout if result.returncode == 0 else ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _reap_orphans() -> None:
    """Delete the namespaces and links that ``hosts`` made in processes now dead (a run killed
    before its cleanup): a leftover local link keeps a route to its /24."""
    for line in _listed("netns", "list").splitlines():
        name = line.split(" ", 1)[0]
        found = _OURS.match(name)
        if found and found.group(1) and not _pid_alive(int(found.group(1))):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    for line in _listed("-o", "link", "show").splitlines():
        parts = line.split(": ", 2)
        name = parts[1].split("@", 1)[0] if len(parts) > 1 else ""
        found = _OURS.match(name)
        if found and found.group(2) and not _pid_alive(int(found.group(2))):
            subprocess.run(["ip", "link", "del", name], capture_output=True, timeout=30)


def _free_subnet(start: int) -> str:
    """The first 10.233.N (N from ``start``, wrapping in 1..250) that no address here is on."""
    used = set(re.findall(r"inet 10\.233\.(\d+)\.", _listed("-4", "-o", "addr", "show")))
    for i in range(250):
        n = (start - 1 + i) % 250 + 1
        if str(n) not in used:
            return f"10.233.{n}"
    raise RuntimeError("every subnet 10.233.1-250.0/24 is in use on this machine")


@contextlib.contextmanager
def _machine_lock() -> Iterator[None]:
    with open(_LOCK_PATH, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def available() -> str | None:
    """None if this machine lets this process build network namespaces, else why not (a skip reason)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux only (this is {sys.platform})"
    if os.geteuid() != 0:
        return "needs root to make network namespaces"
    if shutil.which("ip") is None:
        return "needs the `ip` command (iproute2) to make network namespaces"
    probe = "wsync{}-{}probe".format(*_ids())
    try:
        _ip("netns", "add", probe)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"this machine does not allow network namespaces: {exc}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


class Host:
    """One host: a network namespace (``name``; None for this process's own) at ``address``."""

    def __init__(self, name: str | None, address: str, switch: str, port: str) -> None:
        self.name = name
        self.address = address
        self._switch, self._port = switch, port
        self._procs: list[subprocess.Popen] = []

    @property
    def prefix(self) -> tuple[str, ...]:
        """What to put before a command line to run it on this host (``ip netns exec NAME``)."""
        return () if self.name is None else ("ip", "netns", "exec", self.name)

    def run(self, argv: Sequence[str], **popen: Any) -> subprocess.Popen:
        """Start ``argv`` on this host (``popen`` goes to Popen); it is killed when ``hosts`` exits."""
        proc = subprocess.Popen([*self.prefix, *argv], **popen)
        self._procs.append(proc)
        return proc

    def cut(self) -> None:
        """Take this host's link to the bridge down: nothing reaches it or leaves it until ``restore``."""
        _ip("-n", self._switch, "link", "set", self._port, "down")

    def restore(self) -> None:
        """Bring this host's link back up."""
        _ip("-n", self._switch, "link", "set", self._port, "up")

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.address!r})"


@contextmanager
def hosts(n: int, subnet: str | None = None, *, local: bool = False) -> Iterator[list[Host]]:
    """``n`` hosts on one bridge, at ``SUBNET.1`` .. ``SUBNET.n`` (/24); all deleted on exit, whatever happens.

    ``subnet`` is three octets ("10.231.0"); by default a 10.233.N no address here is on. With
    ``local=True`` the first host is this process's own namespace (for an in-process sender): its
    address is then on a veth link here, removed on exit. Raises RuntimeError naming the ``ip``
    command that failed (call ``available()`` first to skip where namespaces cannot be made).
    """
    if not 1 <= n <= 250:
        raise ValueError(f"hosts(n) takes 1 to 250 hosts, got {n}")
    pid, k = _ids()
    tag = f"wsync{pid}-{k}"
    switch = f"{tag}sw"
    made: list[str] = []  # namespaces, deleted in reverse; deleting one deletes its ends of the links
    here = f"ws{pid}c{k}" if local else None  # this namespace's end of the first host's link (<= 15 chars)
    made_here = False
    out: list[Host] = []
    try:
        with _machine_lock():  # no other process picks the same subnet before this one's link holds it
            _reap_orphans()
            subnet = subnet or _free_subnet((pid + k) % 250 + 1)
            _ip("netns", "add", switch)
            made.append(switch)
            if here is not None:
                _ip("link", "add", here, "type", "veth", "peer", "name", "p0", "netns", switch)
                made_here = True
                _ip("addr", "add", f"{subnet}.1/24", "dev", here)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for i in range(n):
            port, address = f"p{i}", f"{subnet}.{i + 1}"
            if here is not None and i == 0:
                _ip("link", "set", here, "up")
                name = None
            else:
                name = f"{tag}h{i}"
                _ip("netns", "add", name)
                made.append(name)
                _ip("-n", name, "link", "set", "lo", "up")
                _ip("-n", switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", name)
                _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", switch, "link", "set", port, "master", "br0")
            _ip("-n", switch, "link", "set", port, "up")
            out.append(Host(name, address, switch, port))
        yield out
    finally:
        for host in out:
            host._kill()
        if made_here and here is not None:  # (made only with a name)
            subprocess.run(["ip", "link", "del", here], capture_output=True, timeout=30)
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
