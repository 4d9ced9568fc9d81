"""The lifecycle as a hypothesis state machine, with real receivers (processes or threads).

Rules: sends (full, subset, async), receives at random moments, silent workers that time
out, trainer writes that are never sent, pickling, out-of-order calls. After every step:
the sender's version, each receiver's version and its exact content (the content of the
version it reports: never a mix, never a write that was not sent). At the end: shutdown,
and no unpickling happened in any receiver.
"""

from __future__ import annotations

import time
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from wsync_core import StateError, WorkerTimeoutError

from . import profiles, resources
from .context import Context, Session, check_held, classify
from .guarantees import violated
from .models import ORACLE_SIZES, digests, fill, oracle_spec, random_values
from .portable import MAX_PICKLE_BYTES, inspect_pickle
from .trust import trusted_runtime, untrusted_unpickling

__all__ = ["LifecycleMachine", "run_lifecycle_machine"]

N_WORKERS = 3
_SUBSETS = [[0], [1], [2], [0, 1], [1, 2], [0, 2]]


class LifecycleMachine(RuleBasedStateMachine):
    """One sender, three receivers; ``ctx`` and ``pool`` are set by ``run_lifecycle_machine``."""

    ctx: Context
    pool: list

    def __init__(self) -> None:
        super().__init__()
        self.before = resources.snapshot()
        self.s: Session | None = None

    @property
    def session(self) -> Session:
        """The session ``start`` made (hypothesis runs the initialize rule before any other)."""
        assert self.s is not None
        return self.s

    @initialize(size=st.sampled_from(ORACLE_SIZES), kind=st.sampled_from(("module", "tensordict", "state_dict")))
    def start(self, size: str, kind: str) -> None:
        """A model drawn from tiny to >= 4 MiB with many tensors and every dtype."""
        self.s = Session(self.ctx, oracle_spec(size, kind), self.pool, sync=True)
        self.label = 0  # what the trainer's model holds now (the values of seed ``label``)
        self._write()
        self.s.connect()
        self.version = 0
        self.held = {w: 0 for w in range(N_WORKERS)}  # the version each receiver applied
        self.published = {w: 0 for w in range(N_WORKERS)}  # the newest version sent to each
        self.by_version: dict[int, dict[str, str]] = {0: self.s.expected[0]}
        self.pending: list[Any] = []

    def _write(self) -> None:
        fill(self.session.model, random_values(self.session.spec, self.label))

    # -- rules ---------------------------------------------------------------------------------
    @rule()
    def trainer_writes(self) -> None:
        """The trainer changes its model and does not send it."""
        self.label += 1
        self._write()

    def _snapshot(self) -> dict[str, str]:
        return digests(self.session.model)

    @rule(to=st.one_of(st.none(), st.sampled_from(_SUBSETS)))
    def send(self, to: list[int] | None) -> None:
        targets = to
        if targets is not None and not self.ctx.caps.subset_send:
            targets = None
        expected = self._snapshot()
        error = None
        with self.session.following() as reports:
            try:
                v = self.session.scheme.send(worker_ids=targets)
            except WorkerTimeoutError as exc:
                error = exc
        for w, r in reports.items():
            if r.get("errors"):
                raise AssertionError(f"worker {w} raised while receiving: {r['errors'][0]}")
            stray = [a for a in r.get("applied", []) if a > self.published[w] and targets is not None
                     and w not in targets]
            if stray:
                raise violated("targeted", f"worker {w} applied version {stray} that was sent to {targets}")
        if error is not None:
            self._blame(error, self.version + 1)
        self._sent(v, expected, targets)
        for w, r in reports.items():
            self.held[w] = max([self.held[w], *r.get("applied", [])])
        self.pending.clear()  # a later ack completes every earlier send

    def _blame(self, exc: WorkerTimeoutError, version: int) -> None:
        """Name the guarantee a timed-out send to receiving workers breaks."""
        for w in exc.workers:
            if self.session.workers[w].snapshot()["version"] >= version:
                raise violated("versioned", f"worker {w} applied version {version} but its ack never completed "
                                            f"the send: {exc}") from exc
        raise violated("live", f"workers {exc.workers} were receiving but did not get version {version}: {exc}") from exc

    def _sent(self, v: int, expected: dict[str, str], targets: list[int] | None) -> None:
        if v != self.version + 1:
            raise violated("versioned", f"send() returned version {v} after version {self.version}")
        self.version = v
        self.by_version[v] = expected
        for w in targets if targets is not None else range(N_WORKERS):
            self.published[w] = v

    @precondition(lambda self: self.ctx.caps.async_send)
    @rule(to=st.one_of(st.none(), st.sampled_from(_SUBSETS)))
    def send_async(self, to: list[int] | None) -> None:
        targets = to
        if targets is not None and not self.ctx.caps.subset_send:
            targets = None
        expected = self._snapshot()
        handle = self.session.scheme.send_async(worker_ids=targets)
        self._sent(handle.version, expected, targets)
        self.pending.append(handle)

    @precondition(lambda self: self.pending)
    @rule()
    def wait_async(self) -> None:
        with self.session.following() as reports:
            for handle in self.pending:
                try:
                    done = handle.wait()
                except WorkerTimeoutError as exc:
                    self._blame(exc, handle.version)
                if done != handle.version:
                    raise violated("versioned", "SendHandle.wait() returned another version")
        for w, r in reports.items():
            self.held[w] = max([self.held[w], *r.get("applied", [])])
        self.pending.clear()

    @rule(worker=st.integers(0, N_WORKERS - 1))
    def receive(self, worker: int) -> None:
        """A worker reaches a safe point and calls receive()."""
        new = self.published[worker] > self.held[worker]
        reply = self.session.workers[worker].call("receive", timeout=self.ctx.timeout if new else 0.0)
        if reply.error:
            raise AssertionError(f"worker {worker} receive() raised {reply.error}: {reply.get('message')}")
        got = reply.get("result")
        want = self.published[worker] if new else None
        if got != want:
            raise violated("versioned", f"worker {worker} receive() returned {got}, expected {want}")
        if got is not None:
            self.held[worker] = got

    @rule(silent=st.integers(0, N_WORKERS - 1))
    def silent_worker_times_out(self, silent: int) -> None:
        others = [w for w in range(N_WORKERS) if w != silent]
        expected = self._snapshot()
        with self.session.following(others) as reports:
            try:
                self.session.scheme.send(timeout=self.ctx.short_timeout)
            except WorkerTimeoutError as exc:
                if exc.workers != [silent]:
                    raise violated("live", f"WorkerTimeoutError names {exc.workers}, expected [{silent}]") from exc
            else:
                raise violated("live", f"send() returned although worker {silent} was silent")
        self._sent(self.version + 1, expected, None)
        for w, r in reports.items():
            self.held[w] = max([self.held[w], *r.get("applied", [])])
        self.pending.clear()

    @rule(worker=st.integers(0, N_WORKERS - 1))
    def worker_keeps_references(self, worker: int) -> None:
        """A worker keeps a reference to each tensor of its model (checked after every later step)."""
        self.session.workers[worker].hold()

    @rule()
    def pickle_scheme(self) -> None:
        report = inspect_pickle(self.session.scheme)
        if report["pickle_error"] or report["forbidden"] or report["size"] > MAX_PICKLE_BYTES:
            raise violated("portable", f"pickling a connected sender: {report}")

    @rule()
    def out_of_order_call(self) -> None:
        state = self.session.scheme.state
        try:
            self.session.scheme.init_on_sender(model=self.session.model, num_workers=N_WORKERS)
        except StateError:
            pass
        else:
            raise violated("ordered", "init_on_sender() on a connected sender did not raise StateError")
        if self.session.scheme.state != state or self.session.scheme.version != self.version:
            raise violated("ordered", "a refused init_on_sender() changed the scheme")

    # -- invariants ----------------------------------------------------------------------------
    @invariant()
    def versions_and_content(self) -> None:
        if self.session.scheme.version != self.version:
            raise violated("versioned", f"sender version is {self.session.scheme.version}, expected {self.version}")
        for w, worker in enumerate(self.session.workers):
            snap = worker.snapshot()
            if snap["version"] != self.held[w]:
                raise violated("versioned", f"worker {w} reports version {snap['version']}, expected {self.held[w]}")
            kind, detail = classify(snap["digests"], self.by_version)
            if kind == "mixed":
                raise violated("atomic", f"worker {w} holds a mix of versions: {detail}")
            if kind == "unknown":
                raise violated("exact", f"worker {w} holds content that was never sent in keys {detail} "
                                        f"(an unsent trainer write, or damaged bytes)")
            if snap["digests"] != self.by_version[self.held[w]]:
                raise violated("versioned", f"worker {w} reports version {self.held[w]} but holds version {detail}")
            check_held(w, worker.held(), self.by_version)

    def teardown(self) -> None:
        if self.s is None:
            return
        try:
            events = []
            for w in self.s.workers:
                events += w.request("audit").get("events", [])
            events = untrusted_unpickling(events, trusted_runtime(self.ctx.target.cls))
            if events:
                raise violated("safe", f"a receiver unpickled: find_class{tuple(events[0][:2])} in {events[0][2:]} "
                                       f"(all: {events[:8]})")
        finally:
            self.s.close()
        # what a transport holds for a scheme (threads and descriptors are the clean tests' job:
        # they warm up first, so lazy initialisation is not mistaken for a leak)
        pool = {w.pid for w in self.pool}
        deadline = time.monotonic() + 5.0
        while True:
            found = _held(self.before, resources.snapshot(), pool)
            if not found or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if found:
            raise violated("clean", f"after shutdown the sender's process still holds: {found}")


def _held(before: dict[str, Any], after: dict[str, Any], pool: set[int]) -> list[str]:
    found = [f"child process {p}" for p in after["children"] if p not in before["children"] and p not in pool]
    for key, what in (("inproc_channels", "inproc channel"), ("shm_mapped", "shared memory"),
                      ("listening", "listening socket")):
        found += [f"{what} {x}" for x in after[key] if x not in before[key]]
    return found


def run_lifecycle_machine(ctx: Context) -> None:
    """Run the lifecycle machine under the current hypothesis profile (a few short runs in ``ci``)."""
    pool = ctx.workers(N_WORKERS)
    machine = type("Lifecycle", (LifecycleMachine,), {"ctx": ctx, "pool": pool})
    base = profiles.current()
    run_state_machine_as_test(machine, settings=profiles.scaled(0.3, at_least=2,
                                                                stateful_step_count=base.stateful_step_count))
