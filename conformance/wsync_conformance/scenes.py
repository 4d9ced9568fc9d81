"""Scenes of real use that once broke a guarantee (issue 13, scenes 6-9), as checks every transport
must pass: a trainer that forks after ``connect()``, peers that send hostile JSON, a worker that
rejects a version after applying an older one, and ``shutdown()`` from another thread."""

from __future__ import annotations

import base64
import gc
import multiprocessing
import time
import warnings
from typing import Any

from wsync_core import TransportError, WeightSyncScheme

from . import harness, resources
from .checks.base import budget
from .context import Context, RawSender, Session, expect_serving_after_hostile, raw_receiver
from .guarantees import guarantee, violated
from .models import digests, fill_version, version_spec
from .strategies import HOSTILE_TOKENS

__all__ = ["SceneChecks"]

#: slack on top of a timeout before a call counts as not honouring it (the machine may be busy)
_SLACK_S = 20.0
#: how long the forked child of scene 6 lives at most if the test never releases it
_CHILD_LIFE_S = 300.0


def _forked_child(scheme: WeightSyncScheme, release: Any, clean_up: bool) -> None:
    """A trainer's forked helper: with ``clean_up``, shuts down the scheme it inherited and lets
    the collector free it (a child must not close or unlink its parent's resources); then waits
    until released."""
    if clean_up:
        scheme.shutdown()
        del scheme
        gc.collect()
        return
    release.wait(_CHILD_LIFE_S)


def _fork(target: Any, *args: Any) -> multiprocessing.process.BaseProcess:
    ctx = multiprocessing.get_context("fork")
    with warnings.catch_warnings():  # forking a process with threads is the scene under test
        warnings.simplefilter("ignore", DeprecationWarning)
        child = ctx.Process(target=target, args=args, daemon=True, name="wsync-conformance-forked-helper")
        child.start()
    return child


def _hostile_header(raw: RawSender, version: int, token: bytes, field: str) -> bytes:
    """A good header of ``version`` whose ``field`` holds ``token`` instead."""
    good = raw.header(version).decode()
    start = good.index(f'"{field}":') + len(field) + 3
    end = start
    depth = 0
    while end < len(good) and (depth or good[end] not in ",}"):
        depth += {"[": 1, "{": 1, "]": -1, "}": -1}.get(good[end], 0)
        end += 1
    return good[:start].encode() + token + good[end:].encode()


class SceneChecks:
    """Mixed into ``TransportSuite``: uses its ``wsync`` fixture."""

    # == clean: a trainer that forks =================================================================
    @guarantee("clean")
    def test_clean_sender_forks_after_connect(self, wsync: Context) -> None:
        """A trainer forks helpers after connect() (a DataLoader, an env pool): a child that shuts
        down what it inherited and exits changes nothing of the parent's; while another child
        lives, the parent keeps sending, its shutdown() frees the channel at once (a new sender
        with the same options connects), and nothing is left behind."""
        spec = version_spec()
        listening = set(resources.listening_sockets())
        s = wsync.session(spec, n=2)
        fill_version(s.model, 1)
        s.check(s.send())
        release = multiprocessing.get_context("fork").Event()
        cleaner = _fork(_forked_child, s.scheme, release, True)
        cleaner.join(wsync.timeout + 60)
        if cleaner.exitcode != 0:
            raise violated("clean", f"a forked child that called shutdown() exited with {cleaner.exitcode}")
        helper = _fork(_forked_child, s.scheme, release, False)
        try:
            fill_version(s.model, 2)
            s.check(s.send(), guarantee="clean")  # the child's shutdown left the parent's endpoint alone
            transport = s.scheme.transport
            t0 = time.monotonic()
            s.close()
            took = time.monotonic() - t0
            if not helper.is_alive():
                raise violated("clean", f"the forked helper ended during the parent's shutdown() "
                                        f"(exit code {helper.exitcode})")
            end = time.monotonic() + wsync.timeout  # a transport may let go of its sockets a little later
            while not set(resources.listening_sockets()) <= listening and time.monotonic() < end:
                gc.collect()
                time.sleep(0.1)
            kept = sorted(set(resources.listening_sockets()) - listening)
            if kept:
                raise violated("clean", f"{wsync.timeout:g} s after shutdown() of a sender over {transport!r}, its "
                                        f"process still listens on {kept}")
            again = WeightSyncScheme(transport, timeout=wsync.timeout)
            wsync.on_close(again.shutdown)
            model = s.model
            again.init_on_sender(model=model, num_workers=2)
            s2 = Session(wsync, spec, s.workers, scheme=again, model=model)
            wsync.on_close(s2.close)
            try:
                s2.connect()
            except Exception as exc:
                raise violated("clean", f"after shutdown() ({took:.1f} s) a new sender with the same transport "
                                        f"options fails while a forked child lives: {type(exc).__name__}: "
                                        f"{exc}") from exc
            s2.check(0, guarantee="clean")
            fill_version(model, 3)
            s2.check(s2.send(), guarantee="clean")
            s2.close()
        finally:
            release.set()
            helper.join(60)
            if helper.is_alive():
                helper.kill()
                helper.join(10)

    # == safe: hostile JSON ===========================================================================
    @guarantee("safe")
    def test_safe_hostile_json_in_headers(self, wsync: Context) -> None:
        """Headers holding a 5000-digit integer, deeply nested arrays, NaN, non-UTF-8, a mistyped
        layout or a huge size: receive() raises TransportError (or gets nothing), the model is
        untouched, and the receiver keeps working."""
        raw, w, before = raw_receiver(wsync)
        cases = {
            "a 5000-digit version": _hostile_header(raw, 1, b"9" * 5000, "v"),
            "a 5000-digit size": _hostile_header(raw, 1, b"1" * 5000, "n"),
            "a layout nested 5000 deep": _hostile_header(raw, 1, b"[" * 5000 + b"]" * 5000, "l"),
            "an object nested 3000 deep": _hostile_header(raw, 1, b'{"a":' * 3000 + b"1" + b"}" * 3000, "l"),
            "NaN for a size": _hostile_header(raw, 1, b"NaN", "n"),
            "1e999 for a version": _hostile_header(raw, 1, b"1e999", "v"),
            "a non-UTF-8 model id": _hostile_header(raw, 1, b'"\xff\xfe"', "m"),
            "a huge size": _hostile_header(raw, 1, b"1" + b"0" * 30, "n"),
            "a mistyped layout": raw.header(1, digest="0" * 64, layout=[["block0.weight", ["float32"], [64, 64], 0,
                                                                          64 * 64 * 4]]),
            "a layout of the wrong shape": raw.header(1, digest="0" * 64, layout={"block0.weight": 1}),
        }
        fill_version(raw.model, 9)
        for what, header in cases.items():
            raw.publish(header, [0])
            reply = raw.call(w, "receive", timeout=min(wsync.timeout, 5.0))
            if reply.error not in ("TransportError",) and not (reply.error is None and reply.get("result") is None):
                raise violated("safe", f"a header with {what}: receive() gave {reply.error or reply.get('result')} "
                                       f"({reply.get('message', '')[:200]}), expected TransportError (or nothing)")
            if w.snapshot()["digests"] != before:
                raise violated("safe", f"a header with {what} changed the receiver's model")
        expect_serving_after_hostile(raw, w, wsync)

    @guarantee("safe")
    def test_safe_hostile_json_in_acks(self, wsync: Context) -> None:
        """A worker whose acks hold a 5000-digit integer, deeply nested arrays or other hostile
        JSON never stops the sender: it keeps serving every worker, and later sends complete (a
        malformed ack that arrives late may fail the send in flight then, as TransportError)."""
        s = wsync.session(version_spec(), n=2)
        fill_version(s.model, 1)
        s.check(s.send())
        acks = [b'{"wsync":1,"w":1,"v":' + b"7" * 5000 + b"}",
                b'{"wsync":1,"w":1,"v":1,"e":' + b"[" * 5000 + b"]" * 5000 + b"}",
                b'{"wsync":1,"w":1,"v":NaN}', b'{"wsync":1,"w":1,"v":1,"e":"\xff"}'] + list(HOSTILE_TOKENS[:4])
        for data in acks:
            reply = s.workers[1].request("raw_ack", data=base64.b64encode(data).decode())
            reply.raise_for_error("sending a raw ack")
            time.sleep(0.05)  # one at a time: each reaches the sender on its own
        time.sleep(0.5)
        for v in (2, 3, 4):
            fill_version(s.model, v)
            try:
                got = s.send()
            except TransportError as exc:
                if "malformed ack" in str(exc) and v < 4:  # one that arrived late counts against this version
                    continue
                raise violated("safe", f"after hostile acks from worker 1, send() raised TransportError: {exc}") from exc
            except Exception as exc:
                raise violated("safe", f"after hostile acks from worker 1, send() raised {type(exc).__name__}: "
                                       f"{exc}") from exc
            s.check(got, guarantee="safe")

    # == versioned: handles =========================================================================
    @guarantee("versioned")
    def test_versioned_rejection_spares_applied_handles(self, wsync: Context) -> None:
        """Worker 0 applies version 1, then rejects version 2: version 1's handle is done and its
        wait() returns 1; version 2's wait() raises the worker's error."""
        s = wsync.session(version_spec("state_dict"), n=1)
        fill_version(s.model, 1)
        s.expected[1] = digests(s.model)
        with s.following():
            first = s.scheme.send_async()
            if first.wait() != 1:
                raise violated("versioned", "send_async().wait() did not return version 1")
        s.check(1)
        s.workers[0].request("reshape", key=s.spec.tensors[0].key).raise_for_error("reshaping the receiver's model")
        fill_version(s.model, 2)
        with s.following():
            second = s.scheme.send_async()
            try:
                second.wait()
            except Exception as exc:
                if "rejected version 2" not in str(exc):
                    raise violated("versioned", f"version 2's wait() raised {type(exc).__name__}: {exc}; expected "
                                                f"'worker 0 rejected version 2'") from exc
            else:
                raise violated("versioned", "version 2's wait() returned although worker 0 rejected it")
        if not first.done():
            raise violated("versioned", "version 1's handle is not done after worker 0 applied 1 and rejected 2")
        try:
            got = first.wait(timeout=wsync.short_timeout)
        except Exception as exc:
            raise violated("versioned", f"version 1's wait() raised {type(exc).__name__}: {exc} after worker 0 "
                                        f"applied it (it rejected only version 2)") from exc
        if got != 1:
            raise violated("versioned", f"version 1's wait() returned {got}")
        if second.done():
            raise violated("versioned", "version 2's handle is done although worker 0 rejected it")

    # == live: shutdown from another thread ==========================================================
    @guarantee("live")
    @budget(seconds=2 * _SLACK_S)  # (a deaf transport's receive runs out its wait, 1.5 slacks)
    def test_live_shutdown_from_another_thread_ends_receive(self, wsync: Context) -> None:
        """shutdown() called while another thread waits in receive(timeout=30) ends that wait at
        once: receive() raises StateError, and shutdown() does not wait for the timeout."""
        s = wsync.session(version_spec(), n=1)
        fill_version(s.model, 1)
        s.check(s.send())
        _shutdown_ends(s.workers[0], "receive", 1.5 * _SLACK_S)

    @guarantee("live")
    @budget(seconds=2 * _SLACK_S)  # (what a deaf transport makes it wait before it can say so)
    def test_live_shutdown_from_another_thread_ends_connect_with_no_sender(self, wsync: Context) -> None:
        """shutdown() called while another thread waits in connect(timeout=3600) for a sender that
        is not there yet (a worker started before its trainer, stopped by its supervisor) ends that
        wait at once: connect() raises StateError, and shutdown() does not wait for the timeout. A
        transport that dials its sender in a loop, or in one blocking call, deaf to ``wake()``,
        leaves both calls waiting out the timeout, or for ever."""
        s = wsync.session(version_spec(), n=1, connect=False)
        _shutdown_ends(s.workers[0], "connect", 3600.0)


def _shutdown_ends(worker: harness.Worker, call: str, wait: float) -> None:
    """Raise a live violation unless ``shutdown()`` in ``worker``, half a second into its
    ``call(timeout=wait)`` in another thread, ends that call with StateError and returns, both
    within the slack."""
    reply = worker.request("shutdown_while_waiting", 3 * _SLACK_S + 120.0, call=call, wait=wait, after=0.5,
                           patience=_SLACK_S)
    reply.raise_for_error(f"shutdown() while another thread waits in {call}()")
    ended, took = reply.get("ended_after_s"), reply.get("shutdown_s")
    if ended is None or ended > _SLACK_S:
        raise violated("live", f"{call}(timeout={wait:g}) in another thread ended "
                               f"{'never' if ended is None else f'{ended:.1f} s'} after shutdown() (shutdown "
                               f"{'never returned' if took is None else f'took {took:.1f} s'}): it waited for its "
                               f"timeout")
    if reply.get("call_error") != "StateError":
        raise violated("live", f"{call}() ended by shutdown() from another thread gave "
                               f"{reply.get('call_error') or reply.get('result')}, expected StateError")
    if took is None or took > _SLACK_S:
        raise violated("live", f"shutdown() took {'for ever' if took is None else f'{took:.1f} s'} while another "
                               f"thread waited in {call}()")
