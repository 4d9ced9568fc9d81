"""Fixtures for the ray transport's tests: a Ray head node on this machine (2 CPUs, 512 MiB of
object store), started once per test module and always stopped, with everything that joined it."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from wsync_ray.cluster import RayNode  # imports no Ray: each test module skips itself without it


def _leave_ray() -> None:
    """Disconnect this process and the suite's receiver processes from Ray: a process that joined
    a cluster listens on every interface, which the next transport's tests must not see."""
    import ray
    from wsync_conformance import harness

    harness.close_pool()
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_head() -> Iterator[RayNode]:
    """A fresh Ray head node; this process and the suite's receivers join it as drivers."""
    os.environ["RAY_AUTH_MODE"] = "disabled"  # the node's mode: every process that joins must use it
    _leave_ray()
    node = RayNode(num_cpus=2, object_store_mib=512)
    try:
        # this process joins first, as a trainer in a Ray job does: the sockets Ray listens on
        # from here on are the runtime's, there before any scheme (the suite's forked-sender check
        # compares against them)
        import ray

        ray.init(address=node.address, log_to_driver=False, logging_level="WARNING")
        yield node
    finally:
        try:
            _leave_ray()
        finally:
            node.stop()
