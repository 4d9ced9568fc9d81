"""A throwaway Ray node for tests, examples and benchmarks: ``ray start --block`` in a process
session of its own, with fixed resources and free ports, stopped by signalling exactly that session.

    with RayNode(num_cpus=2, object_store_mib=512) as head:
        ray.init(address=head.address)

``RayNode(head=head.address, prefix=("ip", "netns", "exec", "ns1"))`` joins a second node to it
(e.g. from another network namespace). Nothing is stopped by name: ``stop()`` (also at exit)
signals only the processes of the session this object started.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from wsync_core import free_port

__all__ = ["RayNode", "ray_executable", "session_members"]


def ray_executable() -> str:
    """The ``ray`` command of this Python environment."""
    here = Path(sys.executable).with_name("ray")
    return str(here) if here.exists() else (shutil.which("ray") or "ray")


class RayNode:
    """One Ray node started with ``ray start --block``: a head (``head=None``) or a node joining
    the head at ``head``. ``address`` is the head's GCS address. Raises RuntimeError if the node
    does not come up within ``timeout`` seconds (the node is then stopped).

    ``auth_mode`` is Ray's ``RAY_AUTH_MODE`` for the node's processes: "disabled" (the default,
    for a node only this machine's processes reach) or "token"; a process joining the node must
    use the same mode (set ``RAY_AUTH_MODE`` in its environment). Each node keeps its sockets and
    logs in a temporary directory of its own, removed by ``stop()``. ``preallocate`` has Ray
    touch its whole object store at start (``RAY_preallocate_plasma_memory``), so that putting a
    large object later does not pay for fresh pages; ``free_period_ms`` is how often the node
    deletes objects no one references any more (``RAY_free_objects_period_milliseconds``, Ray's
    default 1000): at 10, a version leaves the store within milliseconds of its last reader
    letting go, instead of piling up for a second. Both are the settings to use for weight sync."""

    def __init__(self, *, num_cpus: int = 2, object_store_mib: int = 512, head: str | None = None,
                 node_ip: str = "127.0.0.1", prefix: Sequence[str] = (), port: int | None = None,
                 env: dict[str, str] | None = None, timeout: float = 90.0, resources: str | None = None,
                 auth_mode: str = "disabled", preallocate: bool = True, free_period_ms: int = 10) -> None:
        self.node_ip, self.is_head = node_ip, head is None
        self.temp_dir = tempfile.mkdtemp(prefix="wsray-", dir="/tmp")
        ports = {} if prefix else {  # in a namespace of its own a node cannot collide with another one
            "--ray-client-server-port": free_port(node_ip), "--dashboard-agent-listen-port": free_port(node_ip),
            "--metrics-export-port": free_port(node_ip)}
        argv = [ray_executable(), "start", "--block", "--disable-usage-stats", f"--num-cpus={num_cpus}",
                f"--object-store-memory={object_store_mib << 20}", f"--node-ip-address={node_ip}",
                *(f"{k}={v}" for k, v in ports.items())]
        if resources:
            argv.append(f"--resources={resources}")
        if head is None:
            port = port or (6379 if prefix else free_port(node_ip))  # a namespace of its own has 6379 free
            self.address = f"{node_ip}:{port}"
            argv += ["--head", f"--port={port}", "--include-dashboard=false", f"--temp-dir={self.temp_dir}"]
            if not prefix:
                argv.append(f"--dashboard-port={free_port(node_ip)}")
        else:
            self.address = head
            argv.append(f"--address={head}")
            argv.append(f"--temp-dir={self.temp_dir}")  # nodes sharing a file system need sockets of their own
        self.log = tempfile.TemporaryFile()
        self.proc: subprocess.Popen | None = subprocess.Popen(
            [*prefix, *argv], stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_die_with_parent,
            env={**os.environ, "RAY_AUTH_MODE": auth_mode,
                 "RAY_preallocate_plasma_memory": "1" if preallocate else "0",
                 "RAY_free_objects_period_milliseconds": str(free_period_ms), **(env or {})})
        atexit.register(self.stop)
        try:
            self._wait_up(timeout, head is None)
        except BaseException:
            self.stop()
            raise

    def _wait_up(self, timeout: float, is_head: bool) -> None:
        proc = self.proc
        assert proc is not None  # (__init__ started it just before)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if proc.poll() is not None:
                raise RuntimeError(f"`ray start` exited with {proc.returncode}:\n{self.output()}")
            if b"Ray runtime started" in self._read():
                return
            time.sleep(0.2)
        raise RuntimeError(f"the Ray node did not start within {timeout:g} s:\n{self.output()}")

    def _read(self) -> bytes:
        self.log.seek(0)
        return self.log.read()

    def output(self) -> str:
        """What ``ray start`` printed so far (its last 4000 characters)."""
        return self._read().decode(errors="replace")[-4000:]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 5.0) -> None:
        """Stop every process of this node (its session: Ray's workers take process groups of their
        own but stay in it): SIGINT to each, as Ctrl-C stops ``ray start --block`` (1.5 s here; SIGTERM
        to each left ``ray start`` and two of Ray's processes running until the SIGKILL), then
        SIGKILL after ``grace`` seconds. A head node first disconnects this process if it joined the
        head's cluster as a driver (Ray ends a driver whose cluster goes: the error that left a ``with``
        block would be lost). Idempotent."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        atexit.unregister(self.stop)
        if self.is_head:
            self._leave()
        sid = proc.pid
        for sig, wait in ((signal.SIGINT, grace), (signal.SIGKILL, 10.0)):
            members = session_members(sid)
            for pid in members:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    continue
            end = time.monotonic() + wait
            while session_members(sid) and time.monotonic() < end:
                proc.poll()  # reaps `ray start` itself once it exits
                time.sleep(0.1)
            if not session_members(sid):
                break
        if proc.poll() is None:
            proc.wait(10)
        self.log.close()
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _leave(self) -> None:
        """``ray.shutdown()`` if this process is a Ray driver of this node's cluster."""
        ray = sys.modules.get("ray")
        if ray is None or not ray.is_initialized():
            return
        host, _, port = ray.get_runtime_context().gcs_address.rpartition(":")
        if port == self.address.rpartition(":")[2] and _local(host):  # Ray names the head by the host's address
            ray.shutdown()

    def __enter__(self) -> RayNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _local(host: str) -> bool:
    """Whether ``host`` is an address of this machine (of this network namespace)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.bind((host, 0))
    except OSError:
        return False
    return True


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the process that started it dies (Linux), so a
    killed test run does not leave a Ray node behind (``ray start`` then stops its processes)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


def session_members(sid: int) -> list[int]:
    """The live processes (zombies excluded) of session ``sid``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
        except OSError:
            continue
        if len(fields) > 4 and int(fields[3]) == sid and fields[0] not in (b"Z", b"X"):
            out.append(int(entry))
    return out
