"""Forked children: this process's id without a system call, and what a child does with the
endpoints it inherits (it lets go of its copies of their descriptors); and the list of this
process's sockets that finds them.

A forked child inherits every descriptor of its parent. A copy of a listening socket keeps the
parent's address taken after the parent closes it (a new sender cannot bind there) and a copy of
a connection keeps it open (peers never see the end). An endpoint that holds descriptors calls
``watch(self)`` when it opens them and ``unwatch(self)`` when it closes them; in a child forked
meanwhile its ``forget_in_child()`` runs (``close_inherited`` lets go of sockets by address).
"""

from __future__ import annotations

import os
import socket
import weakref
from collections.abc import Iterable
from typing import Protocol

__all__ = ["Inherited", "close_inherited", "pid", "socket_descriptors", "unwatch", "watch"]

_pid = [os.getpid()]


class Inherited(Protocol):
    """What ``watch`` takes: an object whose copy in a forked child lets go of its descriptors."""

    def forget_in_child(self) -> None:
        """In a forked child: close this process's copies of the descriptors, touching nothing of
        the parent's (no goodbye to a peer, no unlink, no unlock). It must not raise."""


_watched: weakref.WeakSet[Inherited] = weakref.WeakSet()


def watch(endpoint: Inherited) -> None:
    """Until ``unwatch(endpoint)`` (or ``endpoint`` is gone): in every child this process forks,
    call ``endpoint.forget_in_child()``."""
    _watched.add(endpoint)


def unwatch(endpoint: Inherited) -> None:
    """Stop watching ``endpoint`` (it closed its descriptors); nothing if it was not watched."""
    _watched.discard(endpoint)


def _after_fork_in_child() -> None:
    _pid[0] = os.getpid()
    endpoints = list(_watched)
    _watched.clear()  # the child's copies: none is the child's own to close later
    failed: BaseException | None = None
    for endpoint in endpoints:  # each, whatever one before it raised (as one at-fork hook per endpoint)
        try:
            endpoint.forget_in_child()
        except Exception as exc:  # noqa: BLE001 - raised below, after the others ran
            failed = failed or exc
    if failed is not None:
        raise failed  # Python reports it (sys.unraisablehook) and the child goes on


os.register_at_fork(after_in_child=_after_fork_in_child)


def pid() -> int:
    """This process's id, as ``os.getpid()``, without its system call (called on every send and
    receive, to notice a scheme or a lease that crossed a fork)."""
    return _pid[0]


def _local(sock: socket.socket) -> int | str | None:
    """The TCP port or Unix socket path ``sock`` is bound to locally (None: neither)."""
    try:
        name = sock.getsockname()
    except OSError:
        return None
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        return name[1]
    if sock.family == socket.AF_UNIX and isinstance(name, (str, bytes)) and name:
        return name.decode(errors="replace") if isinstance(name, bytes) else name
    return None


def socket_descriptors() -> set[int]:
    """The descriptors of this process's sockets, from /proc (empty where there is none)."""
    try:
        entries = os.listdir("/proc/self/fd")
    except OSError:
        return set()
    found = set()
    for entry in entries:
        try:
            if os.readlink(f"/proc/self/fd/{entry}").startswith("socket:"):
                found.add(int(entry))
        except OSError:  # closed meanwhile (the listing's own descriptor)
            continue
    return found


def close_inherited(ports: Iterable[int] = (), paths: Iterable[str] = ()) -> None:
    """In a forked child: let go of this process's copies of the sockets bound locally to TCP
    ``ports`` or Unix ``paths`` (listening ones and the connections they accepted). Each such
    descriptor is pointed at /dev/null rather than closed, so an object of the child that still
    owns the number closes /dev/null later, never an unrelated file that took the number. The
    parent's sockets stay open; nothing is said to any peer."""
    wanted = set(ports) | set(paths)
    if not wanted:
        return
    found = []
    for fd in socket_descriptors():
        try:
            sock = socket.socket(fileno=fd)
        except OSError:  # closed meanwhile
            continue
        if _local(sock) in wanted:
            found.append(fd)
        sock.detach()
    if found:
        null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        try:
            for fd in found:
                os.dup2(null, fd, inheritable=False)
        finally:
            os.close(null)
