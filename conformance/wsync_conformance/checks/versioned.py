"""versioned: versions rise by one per send; acks name their version; receivers hold what they report."""

from __future__ import annotations

import time

from wsync_core import WorkerTimeoutError

from ..context import Context, classify, send_expect_timeout
from ..guarantees import capability, guarantee, violated
from ..models import digests, fill_version, version_spec

__all__ = ["VersionedChecks"]


class VersionedChecks:
    """The versioned tests (a mixin of ``TransportSuite``)."""

    @guarantee("versioned")
    def test_versioned_counts_and_content(self, wsync: Context) -> None:
        """0 after connect, +1 per send; receivers report what they applied, holding exactly that."""
        s = wsync.session(version_spec(), n=2)
        if s.scheme.version != 0:
            raise violated("versioned", f"sender version after connect is {s.scheme.version}, expected 0")
        s.check(0, guarantee="versioned")
        for expected_v in range(1, 6):
            fill_version(s.model, expected_v)
            try:
                v = s.send()
            except WorkerTimeoutError as exc:
                applied = {i: s.workers[i].snapshot()["version"] for i in exc.workers}
                if any(a >= expected_v for a in applied.values()):
                    raise violated("versioned", f"workers {applied} applied version {expected_v} but their acks "
                                                f"never completed the send: {exc}") from exc
                raise
            if v != expected_v or s.scheme.version != v:
                raise violated("versioned", f"send() #{expected_v} returned {v} (scheme.version {s.scheme.version})")
            for i, w in enumerate(s.workers):
                snap = w.snapshot()
                kind, detail = classify(snap["digests"], s.expected)
                if snap["version"] != v:
                    raise violated("versioned", f"worker {i} reports version {snap['version']} after send {v} returned")
                if kind == "match" and detail != v:
                    raise violated("versioned", f"worker {i} reports version {v} but holds the content of version {detail}")
        reply = s.workers[0].call("receive", timeout=0.2)
        if reply.get("result") is not None or reply.get("version") != 5:
            raise violated("versioned", f"receive() with nothing new returned {reply.get('result')} "
                                        f"(version {reply.get('version')}), expected None (version 5)")

    @guarantee("versioned")
    def test_versioned_old_ack_never_completes_newer_send(self, wsync: Context) -> None:
        """A worker that acked v does not complete the send of v+1 until it applies v+1."""
        s = wsync.session(version_spec(), n=2, sync=not wsync.caps.async_send)
        fill_version(s.model, 1)
        s.check(s.send())
        fill_version(s.model, 2)
        s.expected[2] = digests(s.model)
        if wsync.caps.async_send:
            handle = s.scheme.send_async()
            time.sleep(0.2)
            if handle.done():
                raise violated("versioned", "send_async(v2).done() is True before any worker received v2")
            try:
                handle.wait(timeout=wsync.short_timeout)
            except WorkerTimeoutError as exc:
                if exc.workers != [0, 1]:
                    raise violated("versioned", f"WorkerTimeoutError names {exc.workers}, expected [0, 1]") from exc
            else:
                raise violated("versioned", "an old ack completed a newer send")
            with s.following():
                handle.wait()
        else:
            with s.following([1]):
                timed_out, _ = send_expect_timeout(s, [0], timeout=wsync.short_timeout)
            if timed_out.workers != [0]:
                raise violated("versioned", f"WorkerTimeoutError names {timed_out.workers}, expected [0]")
            with s.following():
                s.send()
        s.check(s.scheme.version)

    @guarantee("versioned")
    @capability("async_send")
    def test_versioned_async_send(self, wsync: Context) -> None:
        """With sync=False, send() returns at the snapshot; send_async().wait() returns the version."""
        wsync.require("async_send")
        s = wsync.session(version_spec(), n=2, sync=False)
        fill_version(s.model, 1)
        s.expected[1] = digests(s.model)
        v = s.scheme.send()  # nobody receives yet: must still return
        if v != 1:
            raise violated("versioned", f"send() returned {v}, expected 1")
        fill_version(s.model, 2)
        s.expected[2] = digests(s.model)
        handle = s.scheme.send_async()
        with s.following():
            if handle.wait() != 2:
                raise violated("versioned", "send_async().wait() did not return version 2")
        s.check(2)
