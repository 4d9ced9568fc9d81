"""A rollout worker as a Ray actor, for the tests: it receives in a thread of its own and answers
questions about what it holds."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import ray
import torch


@ray.remote(num_cpus=0, max_concurrency=4)
class Rollout:
    """Worker ``worker``: a model of ``numel`` float32 values, kept in sync by ``scheme``."""

    def __init__(self, scheme: Any, worker: int, numel: int) -> None:
        torch.set_num_threads(1)
        self.model = {"w": torch.zeros(numel)}
        self.scheme = scheme
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        scheme.init_on_receiver(model=self.model, worker_idx=worker)

    def connect(self, timeout: float) -> int:
        """Connect (applying the current version), then keep receiving in a thread; the version."""
        self.scheme.connect(timeout=timeout)
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()
        return self.scheme.version

    def _loop(self) -> None:
        while not self.stop.is_set():
            try:
                self.scheme.receive(timeout=0.2)
            except Exception as exc:  # reported by state()
                self.errors.append(f"{type(exc).__name__}: {exc}")
                time.sleep(0.05)

    def state(self) -> dict[str, Any]:
        """The version held, its first and last values, and any error the loop met."""
        w = self.model["w"]
        return {"version": self.scheme.version, "first": float(w[0]), "last": float(w[-1]),
                "errors": list(self.errors)}

    def private_plasma_maps(self) -> int:
        """How many private (copy-on-write) mappings of Ray's object store this process holds."""
        with open("/proc/self/maps") as f:
            return sum(1 for line in f if "/plasma" in line and line.split()[1].endswith("p"))

    def wait_version(self, version: int, timeout: float) -> dict[str, Any]:
        """state() once the worker holds ``version`` or more, or when ``timeout`` seconds pass."""
        end = time.monotonic() + timeout
        while self.scheme.version < version and time.monotonic() < end:
            time.sleep(0.01)
        return self.state()

    def pid(self) -> int:
        """This actor's process."""
        return os.getpid()

    def direct_ack(self) -> bool:
        """Whether this worker's receiver acks over a direct connection to the sender."""
        return self.scheme._role.endpoint.link is not None

    def shutdown(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(30)
        self.scheme.shutdown()
