"""The mailbox: one small asyncio Ray actor per sender, named after the channel. Headers, acks,
hellos and object references pass through it; payload bytes never do (they stay in Ray's
object store, where the sender put them).

It keeps, per worker, the newest delivery not yet taken (a take removes it, so the mailbox never
holds a version a worker already has), the token of the receiver now serving that worker (a
restarted receiver replaces it; calls with an older token are refused), and the events the
sender has not collected yet. A receiver that runs inside a Ray actor is watched: when the actor
dies the sender gets ``left`` at once instead of waiting out its timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

__all__ = ["Mailbox", "WATCH_INTERVAL_S"]

#: seconds between two liveness probes of a receiver's actor (a probe queues behind whatever the
#: actor runs, so a busy actor costs nothing; a dead one fails the probe at once)
WATCH_INTERVAL_S = 0.5


class Mailbox:
    """Ray actor body (wrapped with ``ray.remote`` by the sender). Every method takes and returns
    plain values (ints, strings, bytes, lists) and object references nested in lists."""

    def __init__(self) -> None:
        self._cond: asyncio.Condition | None = None
        self._entries: dict[int, list[Any]] = {}  # worker -> [seq, header, [ref]]
        self._members: dict[int, str] = {}  # worker -> token of the receiver serving it
        self._events: list[list[Any]] = []  # ["join", w] | ["ack", w, data] | ["left", w, reason]
        self._watches: dict[int, asyncio.Task] = {}
        self._closed = False

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:  # made on the actor's event loop
            self._cond = asyncio.Condition()
        return self._cond

    def _drop(self, worker: int, reason: str) -> None:
        """Forget ``worker``'s receiver and tell the sender (caller holds the condition)."""
        del self._members[worker]
        self._entries.pop(worker, None)
        watch = self._watches.pop(worker, None)
        if watch is not None and watch is not asyncio.current_task():
            watch.cancel()
        self._events.append(["left", worker, reason])
        self._condition().notify_all()

    async def hello(self, worker: int, token: str, watch: list[Any]) -> bool:
        """Receiver ``token`` now serves ``worker`` (replacing any earlier one); ``watch`` holds its
        actor handle, or nothing. False if the sender has shut down."""
        cond = self._condition()
        async with cond:
            if self._closed:
                return False
            self._members[worker] = token
            self._entries.pop(worker, None)  # meant for a predecessor: the sender re-publishes on join
            old = self._watches.pop(worker, None)
            if old is not None:
                old.cancel()
            if watch:
                self._watches[worker] = asyncio.get_running_loop().create_task(self._watch(worker, token, watch[0]))
            self._events.append(["join", worker])
            cond.notify_all()
        return True

    async def _watch(self, worker: int, token: str, actor: Any) -> None:
        from ray.exceptions import RayActorError

        while True:
            try:
                await actor.__ray_ready__.remote()
            except RayActorError as exc:
                async with self._condition():
                    if self._members.get(worker) == token:
                        self._drop(worker, f"its Ray actor died ({type(exc).__name__}: {str(exc).splitlines()[0]})")
                return
            await asyncio.sleep(WATCH_INTERVAL_S)

    async def bye(self, worker: int, token: str) -> None:
        """Receiver ``token`` shut down."""
        async with self._condition():
            if self._members.get(worker) == token:
                self._drop(worker, "receiver shut down")

    async def post(self, seq: int, workers: list[int], header: bytes, refs: list[Any]) -> None:
        """Deliver ``header`` and the payload in ``refs`` to ``workers`` (those connected now)."""
        cond = self._condition()
        async with cond:
            for w in workers:
                if w in self._members:
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

    async def ack(self, worker: int, token: str, data: bytes) -> None:
        """Receiver ``token`` acks ``data`` (dropped if another receiver serves ``worker`` now)."""
        cond = self._condition()
        async with cond:
            if self._members.get(worker) == token:
                self._events.append(["ack", worker, data])
                cond.notify_all()

    async def events(self, wait_s: float) -> list[list[Any]]:
        """The events since the last call, waiting up to ``wait_s`` seconds for one."""
        cond = self._condition()
        async with cond:
            if not self._events and not self._closed:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(cond.wait_for(lambda: self._events or self._closed), max(0.0, wait_s))
            out, self._events = self._events, []
        return out

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
