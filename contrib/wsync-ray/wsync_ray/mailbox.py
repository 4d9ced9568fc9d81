"""The mailbox: one small asyncio Ray actor per sender, named after the channel. Headers, acks,
hellos and object references pass through it; payload bytes never do (they stay in Ray's
object store, where the sender put them).

It also hands receivers the address of the sender's direct-ack socket (``acks``), if the sender
has one. It keeps, per worker, the newest delivery not yet taken (a take removes it, so the mailbox never
holds a version a worker already has), the token of the receiver now serving that worker (a
restarted receiver replaces it; calls with an older token are refused), and the events the
sender has not collected yet. Every receiver's process is watched, so that when it dies the
sender gets ``left`` within a second instead of waiting out its timeout: a receiver inside a Ray
actor through its actor handle, any other (a driver, or a task's worker) through the GCS's record
of its Ray worker, which Ray marks dead once the process is gone (or its node is).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

__all__ = ["Mailbox", "WATCH_INTERVAL_S", "worker_alive"]

#: seconds between two liveness probes of a receiver's process (an actor's probe queues behind
#: whatever the actor runs, so a busy actor costs nothing; a dead one fails the probe at once)
WATCH_INTERVAL_S = 0.5


def worker_alive(worker_id: str) -> bool:
    """False once the GCS records Ray worker ``worker_id`` (hex; a driver's or a task worker's) as
    dead; True while it lives or has no record yet. Raises ValueError for a malformed id."""
    import ray
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    info = state._connect_and_get_accessor().get_worker_info(ray.WorkerID(bytes.fromhex(worker_id)))
    # (ray's generated gcs_pb2 has no stubs: its message classes are made at import)
    return info is None or gcs_pb2.WorkerTableData.FromString(info).is_alive  # type: ignore[attr-defined]


class Mailbox:
    """Ray actor body (wrapped with ``ray.remote`` by the sender). Every method takes and returns
    plain values (ints, strings, bytes, lists) and object references nested in lists."""

    def __init__(self, acks: list[Any] | None = None, num_workers: int | None = None,
                 nbytes: int | None = None, origin: str = "") -> None:
        self._acks = acks  # [host, port, secret] of the sender's AckServer, or None
        self._num_workers = num_workers  # the sender's: a receiver of another index is refused
        self._nbytes = nbytes  # the sender's payload size: a model that does not fit never pushes one that does out
        self._fits: dict[int, bool] = {}  # worker -> whether the model of the receiver serving it fits
        self._origin = origin  # the sender's scheme's: a receiver of another trainer's scheme is refused
        self._cond: asyncio.Condition | None = None
        self._entries: dict[int, list[Any]] = {}  # worker -> [seq, header, [ref]]
        self._posted: dict[int, int] = {}  # worker -> the newest seq posted to it
        self._members: dict[int, str] = {}  # worker -> token of the receiver serving it
        # [seq, event] not yet confirmed by the sender; event: ["join", w, token] | ["ack", w, data] | ["left", w, reason]
        self._events: list[list[Any]] = []
        self._seq = 0  # the number of the next event
        self._watches: dict[int, asyncio.Task] = {}
        self._closed = False

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:  # made on the actor's event loop
            self._cond = asyncio.Condition()
        return self._cond

    def _drop(self, worker: int, reason: str) -> None:
        """Forget ``worker``'s receiver and tell the sender (caller holds the condition)."""
        del self._members[worker]
        self._fits.pop(worker, None)
        self._entries.pop(worker, None)
        watch = self._watches.pop(worker, None)
        if watch is not None and watch is not asyncio.current_task():
            watch.cancel()
        self._event(["left", worker, reason])

    def _event(self, event: list[Any]) -> None:
        """Log ``event`` under the next number for the sender (caller holds the condition)."""
        self._events.append([self._seq, event])
        self._seq += 1
        self._condition().notify_all()

    async def hello(self, worker: int, token: str, watch: list[Any], nbytes: int | None = None,
                    origin: str = "") -> list[Any]:
        """Receiver ``token``, whose model's payload is ``nbytes``, of a scheme of ``origin``, now
        serves ``worker`` (replacing any earlier one, unless that one's model fits and this one's
        does not); ``watch`` says how to see its process die: ``["actor", handle]``, ``["worker",
        worker id hex]``, or nothing. ``["ok", acks]`` (the sender's direct-ack address, or None),
        ``["closed"]`` if the sender has shut down, ``["out_of_range", num_workers]`` for a worker
        index out of the sender's range, ``["foreign", the sender's origin]`` for a receiver of
        another trainer's scheme, ``["held", sender's nbytes]`` where the holder keeps the index
        (the receiver says why in wsync's words: this actor imports neither torch nor wsync-core)."""
        cond = self._condition()
        async with cond:
            if self._closed:
                return ["closed"]
            if self._num_workers is not None and not 0 <= worker < self._num_workers:
                return ["out_of_range", self._num_workers]
            if origin and self._origin and origin != self._origin:
                return ["foreign", self._origin]
            fits = self._nbytes is None or nbytes == self._nbytes
            if worker in self._members and self._fits.get(worker) and not fits:
                return ["held", self._nbytes]
            self._members[worker] = token
            self._fits[worker] = fits
            self._entries.pop(worker, None)  # meant for a predecessor: the sender re-publishes on join
            old = self._watches.pop(worker, None)
            if old is not None:
                old.cancel()
            if len(watch) == 2 and watch[0] in ("actor", "worker"):
                probe = self._probe_actor if watch[0] == "actor" else self._probe_worker
                self._watches[worker] = asyncio.get_running_loop().create_task(
                    self._watch(worker, token, probe, watch[1]))
            self._event(["join", worker, token])
        return ["ok", self._acks]

    async def _watch(self, worker: int, token: str, probe: Any, what: Any) -> None:
        """Probe ``what`` every WATCH_INTERVAL_S until it is found dead; then drop ``worker`` if
        ``token`` still serves it."""
        while True:
            reason = await probe(what)
            if reason is not None:
                async with self._condition():
                    if self._members.get(worker) == token:
                        self._drop(worker, reason)
                return
            await asyncio.sleep(WATCH_INTERVAL_S)

    @staticmethod
    async def _probe_actor(actor: Any) -> str | None:
        from ray.exceptions import RayActorError

        try:
            await actor.__ray_ready__.remote()
        except RayActorError as exc:
            return f"its Ray actor died ({type(exc).__name__}: {str(exc).splitlines()[0]})"
        return None

    @staticmethod
    async def _probe_worker(worker_id: Any) -> str | None:
        from ray.exceptions import RayError

        if not isinstance(worker_id, str):
            return None
        try:  # one small GCS call, off the event loop; a failed one is retried at the next probe
            alive = await asyncio.to_thread(worker_alive, worker_id)
        except (ValueError, RayError):
            return None
        return None if alive else f"its process (Ray worker {worker_id[:12]}...) died"

    async def bye(self, worker: int, token: str) -> None:
        """Receiver ``token`` shut down."""
        async with self._condition():
            if self._members.get(worker) == token:
                self._drop(worker, "receiver shut down")

    async def post(self, seq: int, workers: list[int], header: bytes, refs: list[Any]) -> None:
        """Deliver ``header`` and the payload in ``refs`` to ``workers`` (those connected now). Ray
        does not promise to run an async actor's tasks in the order they were sent: a post older
        than one a worker already got is dropped for that worker, never put in place of the newer."""
        cond = self._condition()
        async with cond:
            for w in workers:
                if w in self._members and seq > self._posted.get(w, 0):
                    self._posted[w] = seq
                    self._entries[w] = [seq, header, refs]
            cond.notify_all()

    async def take(self, worker: int, token: str, wait_s: float) -> list[Any]:
        """``["data", seq, header, [ref]]``, or ``["none"]`` after ``wait_s`` seconds without one,
        ``["gone"]`` if ``token`` no longer serves ``worker``, ``["closed"]`` once the sender shut down."""
        cond = self._condition()
        loop = asyncio.get_running_loop()
        end = loop.time() + max(0.0, wait_s)
        async with cond:
            while True:
                if self._closed:
                    return ["closed"]
                if self._members.get(worker) != token:
                    return ["gone"]
                entry = self._entries.pop(worker, None)
                if entry is not None:
                    return ["data", *entry]
                left = end - loop.time()
                if left <= 0:
                    return ["none"]
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(cond.wait(), left)

    async def ack(self, worker: int, token: str, data: bytes, take_s: float | None = None) -> list[Any] | None:
        """Receiver ``token`` acks ``data`` (dropped if another receiver serves ``worker`` now); with
        ``take_s``, then takes as ``take(worker, token, take_s)`` does and returns its answer."""
        cond = self._condition()
        async with cond:
            if self._members.get(worker) == token:
                self._event(["ack", worker, data])
        return None if take_s is None else await self.take(worker, token, take_s)

    async def events(self, seen: int, need: int, wait_s: float) -> list[list[Any]]:
        """``[[n, event], ...]``: the logged events numbered above ``seen``, once one numbered
        ``need`` or above is there (or after ``wait_s`` seconds, or once closed). The sender keeps
        several calls waiting, each with its own ``need``, so that each new event answers one of
        them at once; the events up to ``seen`` (which it has) are forgotten. An answer lost on
        the way costs nothing: the next call hands its events on again."""
        cond = self._condition()
        async with cond:
            self._events = [e for e in self._events if e[0] > seen]
            if self._seq <= need and not self._closed:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(cond.wait_for(lambda: self._seq > need or self._closed), max(0.0, wait_s))
            return [e for e in self._events if e[0] > seen]

    async def close(self) -> None:
        """The sender shuts down: every waiting receiver hears so, every reference is dropped."""
        cond = self._condition()
        async with cond:
            self._closed = True
            self._entries.clear()
            for watch in self._watches.values():
                watch.cancel()
            self._watches.clear()
            cond.notify_all()
