"""``wsync_core.forked``: what a forked child does with the endpoints it inherits."""

from __future__ import annotations

import os
import socket

from wsync_core import forked


class _Endpoint:
    """Writes its name to ``pipe`` when a forked child makes it let go."""

    def __init__(self, name: bytes, pipe: int, fails: bool = False) -> None:
        self.name, self.pipe, self.fails = name, pipe, fails

    def forget_in_child(self) -> None:
        os.write(self.pipe, self.name + b"\n")
        if self.fails:
            raise RuntimeError(f"{self.name!r} failed")


def test_a_watched_endpoint_lets_go_in_a_forked_child_and_only_there() -> None:
    r, w = os.pipe()
    first, second, gone = _Endpoint(b"first", w), _Endpoint(b"second", w, fails=True), _Endpoint(b"gone", w)
    for endpoint in (first, second, gone):
        forked.watch(endpoint)
    forked.unwatch(gone)
    try:
        pid = os.fork()
        if pid == 0:  # one that raises does not keep the others from letting go
            os._exit(0)
        os.close(w)
        os.waitpid(pid, 0)
        with os.fdopen(r, "rb") as f:
            assert sorted(f.read().split()) == [b"first", b"second"]
    finally:
        forked.unwatch(first)
        forked.unwatch(second)
    assert forked.pid() == os.getpid()  # the parent's own state is untouched


def test_close_inherited_frees_the_parents_port_in_the_child() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    r, w = os.pipe()
    try:
        pid = os.fork()
        if pid == 0:
            forked.close_inherited(ports=[port])
            try:  # the descriptor now points at /dev/null: no socket of the child is bound to the port
                sock = socket.socket(fileno=listener.fileno())
                sock.detach()
                os.write(w, b"socket")
            except OSError:
                os.write(w, b"freed")
            os._exit(0)
        os.close(w)
        os.waitpid(pid, 0)
        with os.fdopen(r, "rb") as f:
            assert f.read() == b"freed"
    finally:
        listener.close()

