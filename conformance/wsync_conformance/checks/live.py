"""live: every blocking call honours its timeout; a silent or absent worker is named and the rest go on."""

from __future__ import annotations

import base64
import math
import pickle
import threading
import time

from wsync_core import StateError, WeightSyncScheme, WorkerTimeoutError, WsyncError

from ..context import Context, send_expect_timeout
from ..guarantees import capability, guarantee, violated
from ..models import build, digests, fill_version, many_spec, random_values, version_spec
from .base import SLACK_S, budget, contest_index, expect_connect_refused, send_three

__all__ = ["LiveChecks"]


class LiveChecks:
    """The live tests (a mixin of ``TransportSuite``)."""

    @guarantee("live")
    def test_live_silent_worker(self, wsync: Context) -> None:
        """A silent worker: send() raises WorkerTimeoutError naming exactly it, in time; the
        others are updated and the scheme keeps working for them."""
        s = wsync.session(version_spec(), n=3)
        fill_version(s.model, 1)
        s.expected[1] = digests(s.model)
        with s.following([0, 2]):
            exc, took = send_expect_timeout(s, [1], timeout=wsync.short_timeout)
        if exc.workers != [1]:
            raise violated("live", f"WorkerTimeoutError names workers {exc.workers}, expected [1]")
        if took > wsync.short_timeout + SLACK_S:
            raise violated("live", f"send(timeout={wsync.short_timeout}) took {took:.1f} s")
        s.check(1, [0, 2], guarantee="live")
        if wsync.caps.subset_send:
            fill_version(s.model, 2)
            s.check(s.send(worker_ids=[0, 2]), [0, 2], guarantee="live")
        fill_version(s.model, 3)
        v = s.send()
        s.check(v, guarantee="live")

    @guarantee("live")
    def test_live_receive_and_connect_honour_timeouts(self, wsync: Context) -> None:
        """receive(timeout) returns None in time when nothing comes; connect() on either side
        raises by its timeout when the peer never comes."""
        short = wsync.short_timeout
        # a sender whose worker 1 never connects
        s = wsync.session(version_spec(), n=2, connect=False)
        t0 = time.monotonic()
        # A transport with a static membership (no late_join: e.g. torch RPC's fixed world) cannot
        # update anyone until everyone is there; it must still time out, naming the absent worker.
        partial = wsync.caps.late_join
        try:
            s.connect(workers=[0], timeout=short)
        except WorkerTimeoutError as exc:
            if exc.workers != [1] and (partial or 1 not in exc.workers):
                raise violated("live", f"connect() WorkerTimeoutError names {exc.workers}, expected [1]") from exc
        else:
            raise violated("live", "sender connect() returned although worker 1 never connected")
        if time.monotonic() - t0 > short + SLACK_S:
            raise violated("live", f"connect(timeout={short}) took {time.monotonic() - t0:.1f} s")
        if partial:
            s.check(0, [0], guarantee="live")
            t0 = time.monotonic()
            reply = s.workers[0].call("receive", timeout=0.5)
            took = time.monotonic() - t0
            if reply.error or reply.get("result") is not None:
                raise violated("live", f"receive(timeout=0.5) with nothing sent gave {reply.error or reply.get('result')}")
            if took > 0.5 + SLACK_S:
                raise violated("live", f"receive(timeout=0.5) took {took:.1f} s")
            if wsync.caps.subset_send:
                fill_version(s.model, 1)
                s.check(s.send(worker_ids=[0]), [0], guarantee="live")
        s.close()
        # a receiver whose sender never comes
        (w,) = wsync.workers(1)
        lonely = wsync.scheme()
        w.open(lonely, version_spec(), wsync.device, 0)
        expect_connect_refused(w, short, "a receiver whose sender never comes")

    @guarantee("live")
    @budget(seconds=SLACK_S)
    def test_live_shutdown_ends_a_waiting_send(self, wsync: Context) -> None:
        """``shutdown()`` from another thread while ``send()`` waits for a worker that does not
        receive: the send ends with StateError and ``shutdown()`` returns, both long before the
        send's timeout (the core waits for acks in polls of 50 ms, and the sender endpoint's
        ``wake`` ends a waiting ``poll``: ``test_endpoint_wake_ends_a_waiting_poll``)."""
        s = wsync.session(version_spec(), n=1)
        fill_version(s.model, 1)
        outcome: dict[str, BaseException | int] = {}
        waits = 0.6 * SLACK_S  # longer than the wait below, which a woken send must end within

        def send() -> None:
            try:
                outcome["result"] = s.scheme.send(timeout=waits)
            except BaseException as exc:  # whatever it is, the check below names it
                outcome["result"] = exc

        sender = threading.Thread(target=send, name="conformance-send", daemon=True)
        sender.start()
        time.sleep(0.5)  # the send now waits for the silent worker's ack
        t0 = time.monotonic()
        closer = threading.Thread(target=s.scheme.shutdown, name="conformance-shutdown", daemon=True)
        closer.start()
        sender.join(SLACK_S / 2)
        if sender.is_alive():
            raise violated("live", f"send(timeout={waits:g}), waiting for a silent worker, went on for "
                                   f"{time.monotonic() - t0:.1f} s after shutdown() from another thread: the "
                                   f"sender endpoint's poll() ignores wake()")
        result = outcome.get("result")
        if not isinstance(result, StateError):
            raise violated("live", f"send() interrupted by shutdown() from another thread gave {result!r}, "
                                   f"expected StateError")
        closer.join(SLACK_S)
        if closer.is_alive():
            raise violated("live", f"shutdown() from another thread did not return within {SLACK_S:g} s of the "
                                   f"send it interrupted")

    @guarantee("live")
    @capability("late_join")
    def test_live_restarted_worker_gets_latest(self, wsync: Context) -> None:
        """A worker that shuts down and comes back gets the latest version at connect (late_join)."""
        wsync.require("late_join")
        s = wsync.session(version_spec(), n=2)
        fill_version(s.model, 1)
        s.check(s.send())
        s.workers[1].call("shutdown").raise_for_error("receiver shutdown()")
        fill_version(s.model, 2)
        s.expected[2] = digests(s.model)
        with s.following([0]):
            exc, _ = send_expect_timeout(s, [1], timeout=wsync.short_timeout)
        if exc.workers != [1]:
            raise violated("live", f"WorkerTimeoutError names {exc.workers}, expected [1]")
        s.workers[1].open(s.scheme, s.spec, wsync.device, 1)
        reply = s.workers[1].call("connect", timeout=wsync.timeout)
        reply.raise_for_error("restarted receiver connect()")
        s.check(2, [1], guarantee="live")
        fill_version(s.model, 3)
        s.check(s.send())

    @guarantee("live")
    @capability("late_join")
    def test_live_worker_with_a_forked_child_comes_back(self, wsync: Context) -> None:
        """A worker forks a child after connect() (an env pool, a DataLoader worker), then shuts
        down while the child lives, and comes back under its index: it connects and is served. A
        transport whose forked child keeps the worker's connection open leaves the sender seeing
        the worker as still there: it refuses the worker back, or waits for a worker that is gone."""
        wsync.require("late_join")
        wsync.require("processes")  # a fork copies the whole process: receivers must be processes
        s = wsync.session(version_spec(), n=1)
        fill_version(s.model, 1)
        s.check(s.send())
        s.workers[0].scene("fork")
        try:
            s.workers[0].call("shutdown").raise_for_error("receiver shutdown()")
            s.workers[0].open(s.scheme, s.spec, wsync.device, 0)
            reply = s.workers[0].call("connect", timeout=wsync.timeout)
            if reply.error:
                raise violated("live", f"worker 0 shut down while a child it forked after connect() lived, then "
                                       f"connected again under its index: {reply.error}: {reply.get('message')}")
            for v in (2, 3):
                fill_version(s.model, v)
                s.check(s.send(), guarantee="live")
        finally:
            s.workers[0].scene("end_children")

    @guarantee("live")
    @capability("sender_restart")
    def test_live_sender_restarted_on_its_address(self, wsync: Context) -> None:
        """The sender shuts down and a new one is built from its pickled scheme (the same options:
        the same address, as a restarted trainer has them) while the workers go on calling
        receive(): they reconnect by themselves, the new sender's connect() and sends reach them,
        and each holds exactly its versions, numbered from 0 again though the workers held the
        first sender's version 3."""
        wsync.require("sender_restart")
        s = wsync.session(version_spec(), n=2)
        for v in (1, 2, 3):
            fill_version(s.model, v)
            s.check(s.send())
        again: WeightSyncScheme = pickle.loads(pickle.dumps(s.scheme))
        wsync.on_close(again.shutdown)
        s.scheme.shutdown()
        model = build(s.spec, wsync.sender_device, sender=True)
        fill_version(model, 40)
        again.init_on_sender(model=model, num_workers=len(s.workers))
        expected = {0: digests(model)}
        with s.following() as reports:
            call = "connect()"
            try:
                again.connect(timeout=wsync.timeout)
                for v in (1, 2):
                    fill_version(model, 40 + v)
                    expected[v] = digests(model)
                    call = f"send() of version {v}"
                    again.send(timeout=wsync.timeout)
            except WsyncError as exc:
                raise violated("live", f"a sender restarted on the first one's address: its {call} raised "
                                       f"{type(exc).__name__}: {exc}") from None
        for i, w in enumerate(s.workers):
            errors = reports[i].get("errors", [])
            if errors:  # a clean shutdown is not an error: an alarm at every restart of the trainer
                raise violated("live", f"worker {i}'s receive() raised {errors[0]['error']} after its sender's clean "
                                       f"shutdown(), while it looked for a sender started again (it returns None "
                                       f"meanwhile): {errors[0]['message']}")
            snap = w.snapshot()
            if snap["version"] != 2 or snap["digests"] != expected[2]:
                raise violated("exact", f"worker {i} reports version {snap['version']} but does not hold the restarted "
                                        f"sender's version 2, which it acked")

    @guarantee("live")
    @budget(seconds=30, short_timeouts=30)
    def test_live_silent_worker_stays_connected_under_large_payloads(self, wsync: Context) -> None:
        """Two >= 6 MiB versions sent to every worker while one never calls receive() (12 MiB that
        a transport may queue for it): each send names it in WorkerTimeoutError; afterwards it is
        still connected, gets exactly the newest version when it receives, and the next send to
        everyone completes."""
        s = wsync.session(many_spec("state_dict", 6.0), n=3)
        s.fill(random_values(s.spec, 2000))
        t0 = time.monotonic()
        s.check(s.send())
        # the others must ack within it: five times what the first send to all three took (which
        # counts every first-time cost), between 2 and 5 short timeouts
        wait = min(max(wsync.short_timeout * 2, (time.monotonic() - t0) * 5), wsync.short_timeout * 5)
        for step in range(1, 3):  # (each waits out the timeout: the bytes, not the sends, fill a queue)
            s.fill(random_values(s.spec, 2000 + step))
            s.expected[s.scheme.version + 1] = digests(s.model)
            with s.following([0, 2]):
                exc, _ = send_expect_timeout(s, [1], timeout=wait)
            if exc.workers != [1]:
                raise violated("live", f"WorkerTimeoutError names {exc.workers}, expected the silent worker [1]")
            s.check(s.scheme.version, [0, 2], guarantee="live")
        latest = s.scheme.version
        reply = s.workers[1].call("receive", timeout=wsync.timeout)
        if reply.error:
            raise violated("live", f"the silent worker's receive() raised {reply.error}: {reply.get('message')}")
        if reply.get("result") != latest:
            raise violated("live", f"the silent worker got version {reply.get('result')}, expected the newest ({latest})")
        s.check(latest, [1], guarantee="live")
        s.fill(random_values(s.spec, 2100))
        try:
            s.send()
        except WorkerTimeoutError as exc:
            raise violated("live", f"after two large payloads, a send to every worker timed out for {exc.workers}: "
                                   f"was the silent worker dropped?") from exc

    @guarantee("live")
    def test_live_a_timeout_of_math_inf_waits_as_long_as_it_takes(self, wsync: Context) -> None:
        """``timeout=math.inf``, the documented "wait forever", works in ``connect``, ``send`` and
        ``receive`` on both sides as any other timeout does: nothing turns it into a socket timeout,
        a ``select``, a lock wait or a ``timedelta`` that cannot hold it (OverflowError), nor
        waits forever where the version is there (an outside audit found two transports that did)."""
        s = wsync.session(version_spec(), n=1, connect=False)
        worker = s.workers[0]
        s.expected[0] = digests(s.model)
        worker.call_async("connect", timeout=math.inf)
        outcome: list[BaseException | None] = []

        def connect() -> None:
            try:
                s.scheme.connect(timeout=math.inf)
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 - the test names it; it is no reason to hang
                outcome.append(exc)

        connecting = threading.Thread(target=connect, name="wsync-conformance-connect", daemon=True)
        connecting.start()  # (a worker that failed leaves it waiting: the session's shutdown ends it)
        joined = worker.recv(wsync.timeout + 60.0, "answer to connect(timeout=math.inf)")
        if joined.error:
            raise violated("live", f"a worker's connect(timeout=math.inf) raised {joined.error}: "
                                   f"{str(joined.get('message') or '').strip()[:300]}")
        connecting.join(wsync.timeout)
        if not outcome or outcome[0] is not None:
            raise violated("live", f"the sender's connect(timeout=math.inf) "
                                   f"{'did not return' if not outcome else f'raised {outcome[0]!r:.300}'} "
                                   f"with its worker connected")
        fill_version(s.model, 1)
        worker.call_async("receive", timeout=math.inf)
        try:
            got = s.scheme.send(timeout=math.inf)
        except (WsyncError, OverflowError, ValueError) as exc:
            raise violated("live", f"send(timeout=math.inf) raised {type(exc).__name__}: {exc}") from exc
        finally:
            reply = worker.recv(wsync.timeout + 60.0, "answer to receive(timeout=math.inf)")
        if reply.error or reply.get("result") != got:
            raise violated("live", f"a worker's receive(timeout=math.inf) gave {reply.error or reply.get('result')} "
                                   f"{reply.get('message') or ''}; version {got} was sent")
        s.expected[got] = digests(s.model)
        s.check(got, guarantee="live")

    @guarantee("live")
    def test_live_worker_index_out_of_range_is_told(self, wsync: Context) -> None:
        """A receiver whose worker_idx is not below the sender's num_workers (a launcher's
        off-by-one) is told: its connect() raises an error saying so (not WorkerTimeoutError
        after its whole timeout, saying it got no weights, which sends the user looking at the
        transport's options), and the sender goes on serving its workers."""
        s = wsync.session(version_spec(), n=1)
        (stray,) = wsync.workers(1)
        opened = stray.request("open", 120.0, scheme=base64.b64encode(pickle.dumps(s.scheme)).decode(),
                               spec=s.spec.to_json(), device=wsync.device, worker_idx=1, init=True, model_id=None)
        reply = opened if opened.error else stray.call("connect", timeout=wsync.timeout)
        message = reply.get("message", "") if reply.error else ""
        if not reply.error or reply.error == "WorkerTimeoutError" or "1" not in message:
            raise violated("live", f"a receiver with worker_idx=1 and num_workers=1: connect() gave "
                                   f"{reply.error or 'success'} {message[:200]!r}; expected an error naming the index "
                                   f"as out of range, raised before its timeout")
        fill_version(s.model, 1)
        s.check(s.send(), guarantee="live")

    @guarantee("live")
    def test_live_two_receivers_claim_one_index(self, wsync: Context) -> None:
        """A second receiver claims the index of a connected one (a worker started twice, or again
        while the first still runs): one of them holds the index and gets every version, and the
        other is told, its connect() or receive() raising within the timeout; sends go on, never
        stuck between the two (each taking the index back from the other, over and over)."""
        s = wsync.session(version_spec(), n=1)
        first, second = s.workers[0], wsync.workers(1)[0]
        second.open(s.scheme, s.spec, wsync.device, 0)
        joined = second.call("connect", timeout=wsync.short_timeout)
        claims = [first] if joined.error else [first, second]
        reports = send_three(wsync, s, claims, "live", "with two receivers claiming worker 0")
        told = [not r.get("applied") and bool(r.get("errors")) for r in reports]
        holding = [w.snapshot() for w in claims]
        held = [h["version"] == 3 and h["digests"] == s.expected[3] for h in holding]
        if len(claims) == 1:
            if not held[0]:
                raise violated("live", f"the second receiver was refused ({joined.error}), but the first does "
                                       f"not hold version 3 (it holds {holding[0]['version']})")
            return
        told = [t and all(e["error"] == "TransportError" for e in r["errors"]) for t, r in zip(told, reports)]
        if sorted(held) != [False, True] or sorted(told) != [False, True] or held.index(True) == told.index(True):
            what = [f"{name}: applied {r.get('applied')}, holds {h['version']}, "
                    f"errors {[e['error'] + ': ' + e['message'][:100] for e in r.get('errors', [])[:1]]}"
                    for name, r, h in zip(("first", "second"), reports, holding)]
            raise violated("live", "two receivers claimed worker 0: one must hold it and get every version, the "
                                   "other be told (its receive() raising TransportError); got " + "; ".join(what))
        # the one told shuts down (its process ends): the one holding the index keeps it
        claims[told.index(True)].call("shutdown").raise_for_error("the replaced receiver's shutdown()")
        holder = claims[held.index(True)]
        fill_version(s.model, 4)
        s.expected[4] = digests(s.model)
        holder.follow()
        try:
            s.scheme.send(timeout=wsync.timeout)
        except WorkerTimeoutError as exc:
            raise violated("live", f"once the receiver that lost worker 0's index shut down, the one holding it "
                                   f"did not get version 4: {exc}") from None
        finally:
            holder.stop()
        if holder.snapshot()["digests"] != s.expected[4]:
            raise violated("live", "once the receiver that lost worker 0's index shut down, the one holding it "
                                   "does not hold version 4")

    @guarantee("live")
    def test_live_worker_of_another_model_does_not_take_an_index(self, wsync: Context) -> None:
        """A receiver whose model does not fit the sender's (another model's worker, started with
        this scheme's options by mistake) claims the index of a connected worker whose model fits:
        the holder keeps the index and gets every version, sends go on, and the stray is told (its
        connect() or receive() raises). The newest claim wins only where its model fits: a
        transport that lets it push the holder out leaves every later send waiting on a worker
        that can apply nothing."""
        s = wsync.session(version_spec(), n=1)
        stray = wsync.workers(1)[0]
        stray.open(s.scheme, version_spec(side=32), wsync.device, 0)
        contest_index(wsync, s, stray, "a worker of another model", "live")
