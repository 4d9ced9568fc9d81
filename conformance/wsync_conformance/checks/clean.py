"""clean: shutdown and exit free every resource."""

from __future__ import annotations

import pickle
from typing import Any

from wsync_core import TransportError, WeightSyncScheme, WorkerTimeoutError

from .. import resources
from ..context import Context, send_expect_timeout
from ..guarantees import capability, guarantee, violated
from ..models import build, digests, fill_version, random_values, rich_spec, version_spec

__all__ = ["CleanChecks"]


class CleanChecks:
    """The clean tests (a mixin of ``TransportSuite``)."""

    def _lifecycle(self, wsync: Context, workers: list, mid: dict[str, Any] | None = None) -> None:
        s = wsync.session(rich_spec("module", 1), workers=workers)
        s.fill(random_values(s.spec, 1))
        s.check(s.send())
        if mid is not None:
            mid["parent"] = resources.snapshot()
            mid["workers"] = [w.request("resources") for w in s.workers] if wsync.process else []
        for w in s.workers:
            w.call("shutdown").raise_for_error("receiver shutdown()")
        s.scheme.shutdown()
        s.close()

    def _alone(self, wsync: Context, worker: Any) -> None:
        """A sender whose connect() times out (its worker never comes) and a worker whose
        connect() times out (its sender is gone), both shut down; at the same time."""
        spec = version_spec()
        sender = WeightSyncScheme(wsync.target.make(), timeout=wsync.short_timeout)
        sender.init_on_sender(model=build(spec), num_workers=1)
        orphan = pickle.loads(pickle.dumps(sender))  # what a worker gets; this sender never connects
        sender.shutdown()
        alone = WeightSyncScheme(wsync.target.make(), timeout=wsync.short_timeout)
        alone.init_on_sender(model=build(spec), num_workers=1)
        worker.open(orphan, spec, wsync.device, 0)
        worker.call_async("connect", timeout=wsync.short_timeout)
        try:
            alone.connect()
        except (WorkerTimeoutError, TransportError):
            pass
        finally:
            alone.shutdown()
            worker.recv(wsync.timeout + 60, "answer to connect()")
            worker.close_session()

    @guarantee("clean")
    def test_clean_after_connects_that_time_out(self, wsync: Context) -> None:
        """A sender whose connect() times out with no worker, and a worker whose connect() times
        out with no sender, leave nothing behind once shut down: no thread, file descriptor,
        child process, listening socket or inproc channel (the paths a run that never got going
        takes, which ``test_clean_after_shutdown`` does not)."""
        (worker,) = wsync.workers(1)
        self._alone(wsync, worker)  # warm-up: lazy initialisation is not a leak
        before = resources.snapshot()
        worker_before = worker.request("resources") if wsync.process else None
        self._alone(wsync, worker)
        found = [f"sender process: {f}" for f in resources.wait_for_no_leaks(before, resources.snapshot,
                                                                                ignore_children={worker.pid})]
        if worker_before is not None:
            found += [f"receiver process: {f}" for f in resources.wait_for_no_leaks(
                worker_before, lambda: worker.request("resources"))]
        if found:
            raise violated("clean", "after connects that timed out and shutdown():\n  " + "\n  ".join(found))

    @guarantee("clean")
    def test_clean_after_shutdown(self, wsync: Context) -> None:
        """After shutdown() on both sides: no thread, file descriptor, child process, shared
        memory segment, listening socket or inproc channel is left behind."""
        workers = wsync.workers(2)
        self._lifecycle(wsync, workers)  # warm-up: lazy initialisation is not a leak
        shm_before = resources.shm_entries()
        before = resources.snapshot()
        worker_before = [w.request("resources") for w in workers] if wsync.process else []
        mid: dict[str, Any] = {}
        self._lifecycle(wsync, workers, mid)
        pool = {w.pid for w in workers}
        found = resources.wait_for_no_leaks(before, resources.snapshot, ignore_children=pool)
        found = [f"sender process: {f}" for f in found]
        for i, (w, b) in enumerate(zip(workers, worker_before)):
            found += [f"receiver process {i}: {f}" for f in resources.wait_for_no_leaks(
                b, lambda w=w: w.request("resources"))]
        used = set(mid["parent"]["shm_mapped"]).union(*(m["shm_mapped"] for m in mid["workers"]))
        found += [f"shared memory segment {p} left in /dev/shm" for p in sorted(resources.shm_entries() - shm_before)
                  if p in used]
        if found:
            raise violated("clean", "after shutdown():\n  " + "\n  ".join(found))

    @guarantee("clean")
    @capability("processes")
    def test_clean_receiver_process_exits_with_status_0(self, wsync: Context) -> None:
        """A receiver process that shuts its scheme down and returns from its main (the sender still
        up, as a rollout worker's pool ends) exits with status 0: no thread of the transport's left
        running into the interpreter's exit (C++ aborts it: "terminate called without an active
        exception", SIGABRT)."""
        wsync.require("processes")
        workers = wsync.workers(2)
        s = wsync.session(version_spec(), workers=workers)
        for v in (1, 2):
            fill_version(s.model, v)
            s.check(s.send())
        codes = {i: w.exit() for i, w in enumerate(workers)}  # shutdown(), then a normal end of the process
        s.scheme.shutdown()
        bad = {i: c for i, c in codes.items() if c != 0}
        if bad:
            raise violated("clean", "receiver processes that shut down and returned exited with "
                           + ", ".join(f"worker {i}: status {c}" + (" (SIGABRT: a thread left running into "
                                                                    "the exit)" if c == -6 else "")
                                       for i, c in bad.items()))

    @guarantee("clean")
    @capability("processes")
    def test_clean_after_receiver_exit(self, wsync: Context) -> None:
        """A receiver process that exits without shutdown(): the sender names it, and after the
        sender's shutdown nothing of either is left behind."""
        wsync.require("processes")
        workers = wsync.workers(2)
        self._lifecycle(wsync, workers)
        shm_before = resources.shm_entries()
        before = resources.snapshot()
        s = wsync.session(version_spec(), workers=workers)
        fill_version(s.model, 1)
        s.check(s.send())
        used = set(resources.snapshot()["shm_mapped"]).union(*(w.request("resources")["shm_mapped"] for w in workers))
        workers[1].send("exit", abrupt=True)
        workers[1].runner.join(30)
        fill_version(s.model, 2)
        s.expected[2] = digests(s.model)
        with s.following([0]):
            exc, _ = send_expect_timeout(s, [1], timeout=wsync.short_timeout)
        if exc.workers != [1]:
            raise violated("live", f"WorkerTimeoutError names {exc.workers}, expected the dead worker [1]")
        s.check(2, [0])
        s.close()
        found = resources.wait_for_no_leaks(before, resources.snapshot, ignore_children={w.pid for w in workers})
        found += [f"shared memory segment {p} left in /dev/shm" for p in sorted(resources.shm_entries() - shm_before)
                  if p in used]
        if found:
            raise violated("clean", "after a receiver died and the sender shut down:\n  " + "\n  ".join(found))
